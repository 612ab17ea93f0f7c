from tandem.v1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class AdapterResult(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, workers: _Optional[_Iterable[str]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterList(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterPlacement]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterPlacement, _Mapping]]] = ...) -> None: ...

class AdapterPlacement(_message.Message):
    __slots__ = ("name", "digest", "workers", "resident_on")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ON_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: bytes
    workers: _containers.RepeatedScalarFieldContainer[str]
    resident_on: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[bytes] = ..., workers: _Optional[_Iterable[str]] = ..., resident_on: _Optional[_Iterable[str]] = ...) -> None: ...

class StepCommand(_message.Message):
    __slots__ = ("submit", "cancel", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    submit: WorkerRequest
    cancel: str
    trace: _containers.ScalarMap[str, str]
    def __init__(self, submit: _Optional[_Union[WorkerRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepFrame(_message.Message):
    __slots__ = ("tokens", "ended")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[WorkerTokens]
    ended: _containers.RepeatedCompositeFieldContainer[RequestEnded]
    def __init__(self, tokens: _Optional[_Iterable[_Union[WorkerTokens, _Mapping]]] = ..., ended: _Optional[_Iterable[_Union[RequestEnded, _Mapping]]] = ...) -> None: ...

class RequestEnded(_message.Message):
    __slots__ = ("request_id", "code", "details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    details: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_target", "capability", "remote_prefill", "output_token_ids", "decode_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingParams
    decode_target: str
    capability: bytes
    remote_prefill: bool
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., decode_target: _Optional[str] = ..., capability: _Optional[bytes] = ..., remote_prefill: _Optional[bool] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., decode_cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerTokens(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "speculation", "beams", "prompt_logprobs", "num_prompt_tokens", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    finish_reason: _api_pb2.FinishReason
    speculation: _api_pb2.SpeculationStats
    beams: _containers.RepeatedCompositeFieldContainer[_api_pb2.Beam]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    num_prompt_tokens: int
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_api_pb2.FinishReason, str]] = ..., speculation: _Optional[_Union[_api_pb2.SpeculationStats, _Mapping]] = ..., beams: _Optional[_Iterable[_Union[_api_pb2.Beam, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResult(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "role", "running_seqs", "waiting_seqs", "queued_prompt_tokens", "free_kv_blocks", "total_kv_blocks", "draining", "metrics_address", "wedged", "tier_block_cost", "tier_hit_blocks", "adapters", "max_loras")
    class TierBlockCostEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TierHitBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEDGED_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCK_COST_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    running_seqs: int
    waiting_seqs: int
    queued_prompt_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    draining: bool
    metrics_address: str
    wedged: bool
    tier_block_cost: _containers.ScalarMap[str, float]
    tier_hit_blocks: _containers.ScalarMap[str, int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoadedAdapter]
    max_loras: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., running_seqs: _Optional[int] = ..., waiting_seqs: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., draining: _Optional[bool] = ..., metrics_address: _Optional[str] = ..., wedged: _Optional[bool] = ..., tier_block_cost: _Optional[_Mapping[str, float]] = ..., tier_hit_blocks: _Optional[_Mapping[str, int]] = ..., adapters: _Optional[_Iterable[_Union[LoadedAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ...) -> None: ...

class LoadedAdapter(_message.Message):
    __slots__ = ("name", "digest", "resident", "retiring")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    RETIRING_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: bytes
    resident: bool
    retiring: bool
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[bytes] = ..., resident: _Optional[bool] = ..., retiring: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("min_interval_seconds", "heartbeat_seconds", "kv_events")
    MIN_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    min_interval_seconds: float
    heartbeat_seconds: float
    kv_events: bool
    def __init__(self, min_interval_seconds: _Optional[float] = ..., heartbeat_seconds: _Optional[float] = ..., kv_events: _Optional[bool] = ...) -> None: ...

class WorkerUpdate(_message.Message):
    __slots__ = ("load", "sequence", "kv")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    load: WorkerLoad
    sequence: int
    kv: KVEvents
    def __init__(self, load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., sequence: _Optional[int] = ..., kv: _Optional[_Union[KVEvents, _Mapping]] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("first", "last", "snapshot", "stored", "removed", "root", "tiers")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    root: bytes
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., root: _Optional[bytes] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ...) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("tier", "stored", "removed")
    TIER_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tier: _Optional[str] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResult(_message.Message):
    __slots__ = ("remaining_seqs",)
    REMAINING_SEQS_FIELD_NUMBER: _ClassVar[int]
    remaining_seqs: int
    def __init__(self, remaining_seqs: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("pool", "replicas", "planned", "clear_planned")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    CLEAR_PLANNED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    planned: int
    clear_planned: bool
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ..., planned: _Optional[int] = ..., clear_planned: _Optional[bool] = ...) -> None: ...

class ScaleResult(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolStatus
    def __init__(self, pool: _Optional[_Union[PoolStatus, _Mapping]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("role", "target", "workers", "draining", "reason", "override", "min_replicas", "max_replicas", "scale_ups", "scale_downs", "planned")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SCALE_UPS_FIELD_NUMBER: _ClassVar[int]
    SCALE_DOWNS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    role: str
    target: int
    workers: _containers.RepeatedScalarFieldContainer[str]
    draining: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    override: int
    min_replicas: int
    max_replicas: int
    scale_ups: int
    scale_downs: int
    planned: int
    def __init__(self, role: _Optional[str] = ..., target: _Optional[int] = ..., workers: _Optional[_Iterable[str]] = ..., draining: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., override: _Optional[int] = ..., min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., scale_ups: _Optional[int] = ..., scale_downs: _Optional[int] = ..., planned: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("model", "workers", "decisions", "requests_in_flight", "slo_attainment", "metrics_address", "pools", "ttft_p90_seconds", "tpot_p90_seconds", "routers", "ray")
    class DecisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P90_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    RAY_FIELD_NUMBER: _ClassVar[int]
    model: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    decisions: _containers.ScalarMap[str, int]
    requests_in_flight: int
    slo_attainment: float
    metrics_address: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    ttft_p90_seconds: float
    tpot_p90_seconds: float
    routers: _containers.RepeatedCompositeFieldContainer[RouterStatus]
    ray: str
    def __init__(self, model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., decisions: _Optional[_Mapping[str, int]] = ..., requests_in_flight: _Optional[int] = ..., slo_attainment: _Optional[float] = ..., metrics_address: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., ttft_p90_seconds: _Optional[float] = ..., tpot_p90_seconds: _Optional[float] = ..., routers: _Optional[_Iterable[_Union[RouterStatus, _Mapping]]] = ..., ray: _Optional[str] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("name", "address", "metrics_address", "requests_in_flight", "decisions", "slo_attainment", "ttft_p90_seconds", "tpot_p90_seconds", "age_seconds")
    class DecisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P90_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    metrics_address: str
    requests_in_flight: int
    decisions: _containers.ScalarMap[str, int]
    slo_attainment: float
    ttft_p90_seconds: float
    tpot_p90_seconds: float
    age_seconds: float
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., requests_in_flight: _Optional[int] = ..., decisions: _Optional[_Mapping[str, int]] = ..., slo_attainment: _Optional[float] = ..., ttft_p90_seconds: _Optional[float] = ..., tpot_p90_seconds: _Optional[float] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("name", "address", "healthy", "load")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    healthy: bool
    load: WorkerLoad
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...
