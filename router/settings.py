"""What the router is configured with, and what it needs of the pool controllers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.v1 import worker_pb2

from cluster.config import SLOConfig
from router.validate import Limits


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
    capability_ttl_s: float = 120.0
    migration_limit: int = 2
    migration_wait_s: float = 60.0
    max_queued_requests: int = 256
    local_prefill_max_tokens: int = 64
    metrics_port: int = 0


class PoolAdmin(Protocol):
    """The pool controllers, as the router's Admin service sees them (`cluster.ray_cluster.RayCluster`)."""

    def scale(self, role: str, replicas: int | None) -> worker_pb2.PoolStatus: ...

    def pool_status(self) -> list[worker_pb2.PoolStatus]: ...
