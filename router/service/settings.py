"""What the router is configured with, and what it needs of the pool controllers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel
from tandem.v1 import worker_pb2

from cluster.config import AuthConfig, ClusterConfig, RouterConfig, SLOConfig, TelemetryConfig
from cluster.model.arch import ModelArch
from cluster.model.tokenizer import Tokenizer
from router.service.validate import Limits


def _default(part: type[BaseModel], name: str) -> Any:
    """The default of `part`'s field `name`: written once, in the config, and read here."""
    return part.model_fields[name].default


@dataclass(frozen=True)
class RouterSettings:
    model_name: str
    architecture: str
    limits: Limits
    block_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    dtype: str
    slo: SLOConfig = field(default_factory=SLOConfig)
    capability_secret: bytes | None = None  # mint a capability for every KV transfer
    capability_ttl_s: float = _default(AuthConfig, "capability_ttl_s")
    migration_limit: int = _default(RouterConfig, "migration_limit")
    migration_wait_s: float = _default(RouterConfig, "migration_wait_s")
    max_queued_requests: int = _default(RouterConfig, "max_queued_requests")
    local_prefill_max_tokens: int = _default(RouterConfig, "local_prefill_max_tokens")
    metrics_port: int = _default(TelemetryConfig, "metrics_port")
    watch_heartbeat_s: float = 0.5  # a worker's Watch stream sends at least this often
    watch_stale_after_s: float = 2.0  # a worker silent this long takes no new request
    first_token_from_prefill: bool = _default(RouterConfig, "first_token_from_prefill")
    stream_interval: int = _default(RouterConfig, "stream_interval")  # tokens per client message after the first
    prefix_routing: str = _default(RouterConfig, "prefix_routing")  # "kv", "hash" (the prefill ring) or "random"
    prefix_index_max_blocks: int = _default(RouterConfig, "prefix_index_max_blocks")
    # What a request that leaves a sampling field unset gets (the model's generation_config.json)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    adapters_at_runtime: bool = False  # lora.runtime_loading: Admin.LoadAdapter and UnloadAdapter are served
    adapter_spread: int | None = None  # lora.max_workers_per_adapter


class PoolAdmin(Protocol):
    """The pool controllers, as the router's Admin service sees them (`cluster.pools.ray_cluster.RayCluster`)."""

    def scale(self, role: str, replicas: int | None) -> worker_pb2.PoolStatus: ...

    def plan(self, role: str, planned: int | None) -> worker_pb2.PoolStatus: ...

    def pool_status(self) -> list[worker_pb2.PoolStatus]: ...


def settings_from_config(config: ClusterConfig, arch: ModelArch, tokenizer: Tokenizer) -> RouterSettings:
    m, r = config.model, config.router
    context = min(m.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    secret = config.auth.cluster_secret
    return RouterSettings(
        model_name=m.served_name,
        architecture=arch.architecture,
        limits=Limits(context, arch.vocab_size, r.max_stop_strings),
        block_size=config.cache.block_size,
        eos_token_ids=tokenizer.eos_token_ids,
        has_chat_template=tokenizer.chat_template is not None,
        dtype=m.dtype,
        slo=config.slo,
        max_queued_requests=r.max_queued_requests,
        local_prefill_max_tokens=r.local_prefill_max_tokens,
        metrics_port=config.telemetry.metrics_port,
        capability_secret=secret.get_secret_value().encode() if secret else None,
        capability_ttl_s=config.auth.capability_ttl_s,
        migration_limit=r.migration_limit,
        migration_wait_s=r.migration_wait_s,
        first_token_from_prefill=r.first_token_from_prefill,
        stream_interval=r.stream_interval,
        prefix_routing=r.prefix_routing,
        prefix_index_max_blocks=r.prefix_index_max_blocks,
        sampling_defaults=dict(tokenizer.sampling_defaults) if m.generation_config == "auto" else {},
        adapters_at_runtime=config.lora.runtime_loading,
        adapter_spread=config.lora.max_workers_per_adapter,
    )
