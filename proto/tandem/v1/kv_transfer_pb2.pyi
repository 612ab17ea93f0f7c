from tandem.v1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHeader(_message.Message):
    __slots__ = ("format_version", "request_id", "model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "num_tokens", "capability", "token_ids", "sampling", "group_id", "tag", "num_output_tokens", "first_position")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    request_id: str
    model_fingerprint: bytes
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens: int
    capability: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingParams
    group_id: str
    tag: int
    num_output_tokens: int
    first_position: int
    def __init__(self, format_version: _Optional[int] = ..., request_id: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., capability: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., group_id: _Optional[str] = ..., tag: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., first_position: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer_start", "layer_count", "key", "value", "checksum")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_count: int
    key: bytes
    value: bytes
    checksum: int
    def __init__(self, layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("first_token", "logprob", "top")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[_api_pb2.TopLogprob]
    def __init__(self, first_token: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[_api_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class KVTransferMessage(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    commit: KVCommit
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., commit: _Optional[_Union[KVCommit, _Mapping]] = ...) -> None: ...

class KVTransferResult(_message.Message):
    __slots__ = ("accepted", "num_blocks")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    num_blocks: int
    def __init__(self, accepted: _Optional[bool] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class Capability(_message.Message):
    __slots__ = ("request_id", "num_blocks", "expires_at", "mac")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_blocks: int
    expires_at: float
    mac: bytes
    def __init__(self, request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., expires_at: _Optional[float] = ..., mac: _Optional[bytes] = ...) -> None: ...

class JoinGroupRequest(_message.Message):
    __slots__ = ("group_id", "store_host", "store_port", "backend", "timeout_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    store_host: str
    store_port: int
    backend: str
    timeout_s: float
    def __init__(self, group_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class JoinGroupResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
