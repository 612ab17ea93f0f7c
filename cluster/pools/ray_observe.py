"""What Ray shows an operator, read from the Ray this process joined: the dashboard's address and
whether it asks for Ray's authentication token, and where Ray's own metrics exporter serves the
`ray.util.metrics` series (with the `ray_` prefix it adds); and the series the actors send there
(`mirror_load`, `ray_metric`, `zero`). The Ray calls of
`cluster.pools.ray_cluster` that concern observability only, kept apart so that module stays small.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.util.metrics import Counter, Gauge

from cluster.telemetry import RAY_METRICS

# How often Ray's metrics agent reads the `ray.util.metrics` values the actors set: a worker's
# gauges reach Ray's exporter within this plus one `WorkerActor` mirror round (1 s).
METRICS_REPORT_INTERVAL_MS = 1000
TOKEN_COMMAND = "ray get-auth-token"


@dataclass(frozen=True)
class RayView:
    dashboard_url: str | None  # "http://host:port", None when the cluster runs no dashboard
    token_auth: bool  # the dashboard and Ray's API ask for the token `ray get-auth-token` prints
    metrics_address: str | None  # this node's Ray metrics exporter, "host:port"

    def lines(self) -> list[str]:
        """What `tandem serve` and `tandem control` print about the dashboard."""
        if self.dashboard_url is None:
            return ["Ray dashboard: none (this Ray runs without one)"]
        auth = (
            f"; it asks for Ray's token: paste what `{TOKEN_COMMAND}` prints (the file ~/.ray/auth_token)"
            if self.token_auth
            else ""
        )
        lines = [f"Ray dashboard at {self.dashboard_url}{auth}"]
        if self.metrics_address:
            where = f"http://{self.metrics_address}/metrics"
            lines.append(f"Ray's metrics exporter at {where} (Tandem's series there start with ray_)")
        return lines


def ray_view() -> RayView:
    """The dashboard and metrics endpoints of the Ray this process is connected to."""
    from ray._private import worker
    from ray._private.authentication import authentication_utils

    url, metrics = None, None
    with contextlib.suppress(Exception):  # no dashboard on this cluster
        url = worker.get_dashboard_url() or None
    node = getattr(worker, "_global_node", None)
    with contextlib.suppress(Exception):
        port = node.metrics_export_port if node is not None else None
        metrics = f"{node.node_ip_address}:{port}" if port else None
    return RayView(f"http://{url}" if url else None, bool(authentication_utils.is_token_auth_enabled()), metrics)


# A local Ray's processes (the driver of `tandem serve` among them) wait this much longer for a silent
# GCS than Tandem's lifeline does: serve says the cluster is lost, in its own words, before Ray ends it.
LOST_GRACE_S = 5


def local_ray_options(reconnect_timeout_s: float) -> dict[str, object]:
    """`ray.init` options for a local Ray that Tandem starts: Ray's metrics follow the actors'
    gauges within `METRICS_REPORT_INTERVAL_MS` (Ray's default is 10 s); its raylets wait for a
    silent GCS `ray_ha.reconnect_timeout_s` and `LOST_GRACE_S`."""
    system = {
        "metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS,
        "gcs_rpc_server_reconnect_timeout_s": round(reconnect_timeout_s) + LOST_GRACE_S,
    }
    return {"_system_config": system}


def ray_metric(name: str) -> Any:
    """The `ray.util.metrics` object for one of `cluster.telemetry.RAY_METRICS`."""
    kind, doc, tags = RAY_METRICS[name]
    return (Gauge if kind == "gauge" else Counter)(name, doc, tags)


def zero(counter: Counter, tags: dict[str, str]) -> None:
    """Makes a counter's series exist at 0 before its first increment (Prometheus's convention,
    so `rate()` and alerts see it from start); Ray's `inc` refuses 0, its recorder does not."""
    counter._record(0.0, tags=tags)


def mirror_load(load: Callable[[], Any], name: str, role: str, interval_s: float = 1.0) -> None:
    """A worker's load gauges, also through Ray's metrics (`ray_tandem_...` on Ray's exporter),
    every `interval_s`; runs on a thread of the worker's actor for its life."""
    keys = ("kv_cache_usage", "running_seqs", "waiting_seqs", "queued_prompt_tokens")
    gauges = {key: ray_metric(f"tandem_{key}") for key in keys}
    while True:
        try:
            now = load()
        except Exception:  # a load read racing the engine: try again next round
            time.sleep(interval_s)
            continue
        values = {
            "kv_cache_usage": 1 - now.free_kv_blocks / max(now.total_kv_blocks, 1),
            "running_seqs": now.running_seqs,
            "waiting_seqs": now.waiting_seqs,
            "queued_prompt_tokens": now.queued_prompt_tokens,
        }
        for key, gauge in gauges.items():
            gauge.set(values[key], tags={"worker": name, "role": role})
        time.sleep(interval_s)
