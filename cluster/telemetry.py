"""Traces and metrics for every Tandem process: one `Telemetry` object per process, passed in.

Traces (OpenTelemetry): one trace per request. The router starts `router.generate` (continuing a
client's W3C `traceparent` when it sends one) and passes the context to the workers in gRPC
metadata; each worker records its spans (`prefill.queue`, `prefill.compute`, `kv.transfer`,
`decode.admit`, `decode`) as children of it, with the times it measured. Nothing is global: each
`Telemetry` owns its tracer provider, so several roles can share a process (as in tests).

Metrics (Prometheus): each process serves `/metrics` from its own registry on its own port. The
names are DESIGN.md's; latencies are in seconds.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import prometheus_client as prom
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cluster.config import TelemetryConfig
from cluster.engine.changes import TierCounts

_PROPAGATOR = TraceContextTextMapPropagator()
# What the Ray actors send through `ray.util.metrics`: name -> (kind, help, tag keys). Ray's exporter
# serves each as RAY_PREFIX + name (a counter with `_total` after it); the workers' own `/metrics`
# serve their load gauges under the bare names as well.
RAY_PREFIX = "ray_"
RAY_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "tandem_kv_cache_usage": ("gauge", "Share of KV blocks in use.", ("worker", "role")),
    "tandem_running_seqs": ("gauge", "Sequences in the running batch.", ("worker", "role")),
    "tandem_waiting_seqs": ("gauge", "Sequences waiting.", ("worker", "role")),
    "tandem_queued_prompt_tokens": ("gauge", "Prompt tokens waiting.", ("worker", "role")),
    "tandem_pool_workers": ("gauge", "Workers serving in the pool (draining ones apart).", ("pool",)),
    "tandem_pool_target": ("gauge", "The pool's target size (autoscaler, plan or manual override).", ("pool",)),
    "tandem_scaling_decisions": ("counter", "Pool size changes, by pool and direction.", ("pool", "direction")),
}
# Latency buckets (seconds) from a millisecond to two minutes.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REQUEST_STATUSES = ("ok", "cancelled", "rejected", "invalid", "error")  # tandem_requests{status}
PREFILL_MODES = ("remote", "local", "none")  # tandem_requests{prefill_mode}
_BYTES = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB


def loaded_attributes(tiers: Sequence[str]) -> dict[str, int]:
    """A span's attributes for the prompt blocks a request loaded from the KV tiers: how many from
    each tier (`tandem.kv.loaded_blocks.host`, ...)."""
    return {f"tandem__kv__loaded_blocks__{tier}": n for tier, n in collections.Counter(tiers).items()}


class Metrics:
    """The Prometheus metrics of one process (a role uses the ones that concern it)."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        self._latencies()
        self._request_counts()
        self._worker_gauges()
        self._kv_tiers()
        self._speculation_and_slo()
        self._zero_known_labels()
        self.address: str | None = None
        self._server: Any = None

    def _histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = _LATENCY
    ) -> prom.Histogram:
        return prom.Histogram(name, doc, labels, registry=self.registry, buckets=buckets)

    # The metrics are registered in this order, which is the order `/metrics` lists them in.
    def _latencies(self) -> None:
        """Request latencies (router), queueing before a worker and KV transfers."""
        self.ttft = self._histogram("tandem_ttft_seconds", "Time to first token, measured at the router.")
        self.tpot = self._histogram("tandem_tpot_seconds", "Time per output token after the first, per request.")
        self.itl = self._histogram("tandem_itl_seconds", "Gaps between successive token messages.")
        self.e2e = self._histogram("tandem_e2e_seconds", "Request latency, sent to last token.")
        self.queue = self._histogram(
            "tandem_queue_seconds", "Time a request waits before a worker starts on it, by stage.", ["stage"]
        )
        self.tier_wait = self._histogram(
            "tandem_kv_tier_wait_seconds", "Time a prompt waited for its blocks to load from the KV tiers."
        )
        self.local_prefill = self._histogram(
            "tandem_local_prefill_seconds", "A prompt's prefill on its decode worker: first pass to first token."
        )
        self.kv_transfer = self._histogram(
            "tandem_kv_transfer_seconds", "KV transfer, header to admission.", ["transport"]
        )
        self.kv_bytes = self._histogram("tandem_kv_transfer_bytes", "Bytes of one KV transfer.", ["transport"], _BYTES)

    def _request_counts(self) -> None:
        """Finished requests, migrations, placement decisions and failed KV transfers."""
        r = self.registry
        self.requests = prom.Counter("tandem_requests", "Finished requests.", ["status", "prefill_mode"], registry=r)
        self.migrations = prom.Counter(
            "tandem_migrations", "Requests moved to another worker after a worker failed.", ["failed"], registry=r
        )
        self.placements = prom.Counter(
            "tandem_placements", "Requests placed, by decision (`router.placement`).", ["decision"], registry=r
        )
        self.placed_cached_blocks = prom.Counter(
            "tandem_placed_cached_blocks",
            "Prompt blocks the chosen worker already held when the request was placed (KV-aware routing).",
            ["decision"],
            registry=r,
        )
        self.transfer_failures = prom.Counter(
            "tandem_kv_transfer_failures", "KV transfers that failed.", ["code"], registry=r
        )

    def _worker_gauges(self) -> None:
        """A worker's preemptions, batch, KV cache use and prefix-cache hit rate."""
        r = self.registry
        self.preemptions = prom.Gauge("tandem_preemptions", "Preemptions on this worker since start.", registry=r)
        self.kv_usage = prom.Gauge("tandem_kv_cache_usage", "Share of this worker's KV blocks in use.", registry=r)
        self.running = prom.Gauge("tandem_running_seqs", "Sequences in the running batch.", registry=r)
        self.waiting = prom.Gauge("tandem_waiting_seqs", "Sequences waiting.", registry=r)
        self.prefix_hit_rate = prom.Gauge("tandem_prefix_cache_hit_rate", "Prefix-cache block hit rate.", registry=r)

    def _kv_tiers(self) -> None:
        """A worker's KV tiers (`cache.tiers`), each metric labelled by tier: host, disk or shared."""
        r, tier = self.registry, ["tier"]
        self._tier_counters = {
            "hits": prom.Counter("tandem_kv_tier_hit_blocks", "KV blocks loaded from a tier.", tier, registry=r),
            "bytes_loaded": prom.Counter("tandem_kv_tier_loaded_bytes", "Bytes loaded from a tier.", tier, registry=r),
            "load_seconds": prom.Counter(
                "tandem_kv_tier_load_seconds", "Time spent loading from a tier.", tier, registry=r
            ),
            "writes": prom.Counter("tandem_kv_tier_written_blocks", "KV blocks written to a tier.", tier, registry=r),
            "rejected": prom.Counter(
                "tandem_kv_tier_rejected_entries", "Entries read back whose seal failed (misses).", tier, registry=r
            ),
            "failures": prom.Counter(
                "tandem_kv_tier_failures", "Times a tier's store failed and the tier went off.", tier, registry=r
            ),
        }
        self.tier_up = prom.Gauge(
            "tandem_kv_tier_up", "1 while a tier is on, 0 while off after a failure.", tier, registry=r
        )
        self._tiers_seen: dict[str, TierCounts] = {}

    def observe_tiers(self, counts: Sequence[TierCounts]) -> None:
        """Brings the tier metrics up to an engine's published counts."""
        for c in counts:
            last = self._tiers_seen.get(c.tier)
            for field, counter in self._tier_counters.items():
                delta = getattr(c, field) - (getattr(last, field) if last is not None else 0)
                if delta > 0:
                    counter.labels(c.tier).inc(delta)
            self.tier_up.labels(c.tier).set(1 if c.up else 0)
            self._tiers_seen[c.tier] = c

    def _speculation_and_slo(self) -> None:
        """Speculative decoding on a worker; requests that met their SLO targets at the router."""
        r = self.registry
        self.spec_draft_tokens = prom.Counter(
            "tandem_spec_draft_tokens", "Speculative tokens proposed on this worker.", registry=r
        )
        self.spec_accepted_tokens = prom.Counter(
            "tandem_spec_accepted_tokens", "Speculative tokens the target model kept.", registry=r
        )
        self.spec_tokens_per_pass = self._histogram(
            "tandem_spec_tokens_per_pass", "Output tokens per target-model pass, per speculating request.",
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0),
        )  # fmt: skip
        self.slo_attainment = prom.Gauge(
            "tandem_slo_attainment", "Share of recent requests that met both TTFT and TPOT targets.", registry=r
        )
        self.slo_requests = prom.Counter(
            "tandem_slo_requests", "Finished requests, by whether they met both TTFT and TPOT targets (goodput).",
            ["met"], registry=r,
        )  # fmt: skip
        self.ray_state = prom.Enum(
            "tandem_ray", "Ray's GCS as this process sees it (cluster.lifeline): ok, degraded, draining or lost.",
            states=["ok", "degraded", "draining", "lost"], registry=r,
        )  # fmt: skip

    def _zero_known_labels(self) -> None:
        """Counters exist from start at 0 for every label value known in advance."""
        for status in REQUEST_STATUSES:
            for mode in PREFILL_MODES:
                self.requests.labels(status, mode)
        for where in ("decode", "prefill"):
            self.migrations.labels(where)
        for met in ("true", "false"):
            self.slo_requests.labels(met)

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Starts the `/metrics` HTTP endpoint; returns "host:port"."""
        self._server, _ = prom.start_http_server(port, host, registry=self.registry)
        self.address = f"{host}:{self._server.server_port}"
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class Telemetry:
    def __init__(self, config: TelemetryConfig, service: str) -> None:
        self.config = config
        self.service = service
        self.metrics = Metrics()
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}), sampler=sampler)
        processor = _processor(config, service)
        if processor is not None:
            self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("tandem")

    @contextmanager
    def span(self, name: str, parent: otel_context.Context | None = None, **attributes: Any) -> Iterator[trace.Span]:
        with self.tracer.start_as_current_span(name, context=parent, attributes=_clean(attributes)) as span:
            yield span

    def record(
        self, name: str, parent: otel_context.Context | None, start_s: float, end_s: float, **attributes: Any
    ) -> None:
        """A finished span from times measured elsewhere (`time.time()` seconds)."""
        start = int(start_s * 1e9)
        span = self.tracer.start_span(name, context=parent, start_time=start, attributes=_clean(attributes))
        span.end(end_time=int(end_s * 1e9))

    def shutdown(self) -> None:
        self.provider.shutdown()
        self.metrics.stop()


def inject(metadata: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current trace context (`traceparent`, `tracestate`)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [*(metadata or []), *carrier.items()]


def extract(metadata: Sequence[tuple[str, str]] | None) -> otel_context.Context:
    """The trace context in incoming gRPC metadata (an empty context when there is none)."""
    return _PROPAGATOR.extract({k: v for k, v in (metadata or ())})


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("__", "."): v for k, v in attributes.items() if v is not None}


def _processor(config: TelemetryConfig, service: str):  # type: ignore[no-untyped-def]
    if config.exporter == "none":
        return None
    if config.exporter == "console":
        out = sys.stderr
        if config.console_dir is not None:
            config.console_dir.mkdir(parents=True, exist_ok=True)
            out = open(config.console_dir / f"{service}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        return SimpleSpanProcessor(ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n"))
    try:
        if config.exporter == "otlp-grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[no-redef]
    except ImportError:
        raise ValueError(
            f"telemetry.exporter {config.exporter!r} needs the opentelemetry-exporter-otlp package "
            "(pip install 'tandem-serve[otlp]')"
        ) from None
    return BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint) if config.endpoint else OTLPSpanExporter())
