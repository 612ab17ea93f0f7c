"""A real Prometheus (Debian's `prometheus` package; `make test` installs it where it can) scrapes a
local cluster through the configuration `tandem dashboards` writes. Asked by PromQL, it gives the
TTFT p99, the requests by status and the KV cache use that the router and workers served, Tandem's
series through Ray's exporter carry the `ray_` prefix and follow the workers within the stated
time, counters exist from start at 0, and every query of the Grafana dashboard parses and names a
metric Prometheus has."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cli import dashboards
from cluster.config import parse_config
from cluster.pools import ray_cluster
from cluster.pools.ray_observe import ray_view
from cluster.telemetry import PREFILL_MODES, REQUEST_STATUSES
from router.sdk.client import Client, InvalidArgument
from router.service.server import from_config
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 1.0
# docs/operations.md: a worker's gauge reaches Ray's exporter within the report interval (1 s) plus
# one mirror round (1 s); Prometheus sees it one scrape later.
RAY_FOLLOWS_S = 2.0 + SCRAPE_S

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)"),
]


@pytest.fixture(scope="module")
def cluster():
    config = parse_config({
        "model": {"path": str(ROOT / "models" / "tandem-demo-code"), "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": 128},
        "router": {"local_prefill_max_tokens": 4},
        "prefill": {"num_cpus": 1}, "decode": {"num_cpus": 1},
    })  # fmt: skip
    cluster = ray_cluster.start(config, namespace="tandem-prometheus", num_cpus=4, log_to_driver=False)
    router = from_config(config, cluster.discover, cluster)
    address = router.start()
    router.join(cluster)
    yield SimpleNamespace(cluster=cluster, router=router, address=address)
    router.stop()
    cluster.shutdown()


def status(address: str) -> worker_pb2.ClusterStatus:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("dashboards")
    view = ray_view()
    assert view.metrics_address, "the local Ray has a metrics exporter"
    args = SimpleNamespace(out=str(out), target=cluster.address, api_key=None, tls_ca=None,
                           ray_metrics=[view.metrics_address], scrape_interval=SCRAPE_S)  # fmt: skip
    assert dashboards.run(args) == 0
    scrape = yaml.safe_load((out / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert {"tandem-router", "tandem-workers", "ray"} <= set(jobs)
    workers = {c["labels"]["worker"] for c in jobs["tandem-workers"]["static_configs"]}
    assert workers == {"prefill-0", "decode-0"}
    port = free_port()
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={out / 'prometheus.yml'}", f"--storage.tsdb.path={out / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=(out / "prometheus.log").open("w"),
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{api}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (out / "prometheus.log").read_text()
            time.sleep(0.3)
        yield SimpleNamespace(api=api, dashboard=json.loads((out / "grafana" / "tandem.json").read_text()))
    finally:
        server.terminate()
        server.wait(30)


def query(api: str, promql: str) -> list[dict]:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        answer = json.load(r)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def by(api: str, promql: str, label: str) -> dict[str, float]:
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in query(api, promql)}


def wait_for(check, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) buckets."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def gauge(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))


def router_buckets(router, name: str) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    return [
        (float(s.labels["le"]), s.value)
        for family in router.telemetry.metrics.registry.collect()
        for s in family.samples
        if s.name == f"{name}_bucket"
    ]


def test_prometheus_sees_what_the_router_and_workers_served(cluster, prometheus):
    api = prometheus.api
    wait_for(lambda: query(api, 'up{job="tandem-workers"} == 1'), 30, "Prometheus scrapes the workers")
    # Counters exist from start, at 0: every request status, every pool's scaling directions.
    zeros = by(api, "sum by (status) (tandem_requests_total)", "status")
    assert set(zeros) == set(REQUEST_STATUSES) and not any(zeros.values()), zeros
    decisions = wait_for(lambda: query(api, "ray_tandem_scaling_decisions_total"), 30, "decisions from start")
    assert {(s["metric"]["pool"], s["metric"]["direction"]) for s in decisions} == {
        (pool, d) for pool in ("prefill", "decode") for d in ("up", "down")
    }
    assert all(float(s["value"][1]) == 0 for s in decisions)

    prompts = ["def add(a, b):", "x = 1", "class Tree:\n    def __init__(self):", "import os\nimport sys\n"] * 3
    with Client(cluster.address, timeout=120) as client:
        for prompt in prompts:
            client.generate(prompt, max_tokens=6, temperature=0.0)
        with pytest.raises(InvalidArgument):
            client.generate("x", max_tokens=4, temperature=-1.0)
    served = len(prompts)
    counts = wait_for(
        lambda: (c := by(api, "sum by (status) (tandem_requests_total)", "status")).get("ok") == served and c,
        30, "Prometheus counts the requests",
    )  # fmt: skip
    assert counts == {**dict.fromkeys(REQUEST_STATUSES, 0.0), "ok": served, "invalid": 1}, counts
    modes = by(api, "sum by (prefill_mode) (tandem_requests_total)", "prefill_mode")
    assert set(modes) == set(PREFILL_MODES) and modes["remote"] > 0, modes

    p99 = float(query(api, "histogram_quantile(0.99, sum by (le) (tandem_ttft_seconds_bucket))")[0]["value"][1])
    assert p99 == pytest.approx(quantile(0.99, router_buckets(cluster.router, "tandem_ttft_seconds")), rel=1e-6)

    loads = {w.name: w.load for w in status(cluster.address).workers}
    for name, load in loads.items():
        own = gauge(load.metrics_address, "tandem_kv_cache_usage")  # what the worker's /metrics serves
        wait_for(lambda n=name, o=own: by(api, f'tandem_kv_cache_usage{{worker="{n}"}}', "worker").get(n) == o,
                 SCRAPE_S + 5, f"Prometheus has {name}'s KV cache use")  # fmt: skip
        used = 1 - load.free_kv_blocks / load.total_kv_blocks  # the load Ray's gauge mirrors
        promql = f'ray_tandem_kv_cache_usage{{worker="{name}"}}'  # Ray's exporter, with its ray_ prefix
        wait_for(lambda q=promql, n=name, u=used: by(api, q, "worker").get(n) == pytest.approx(u),
                 RAY_FOLLOWS_S + SCRAPE_S + 2, f"{promql} follows the worker")  # fmt: skip


def test_ray_exported_gauges_follow_a_worker_within_the_stated_time(cluster, prometheus):
    api = prometheus.api
    with Client(cluster.address, timeout=120) as client:
        stream = client.stream("def main():", max_tokens=400, temperature=0.0, ignore_eos=True)
        next(iter(stream))
        started = time.monotonic()
        wait_for(lambda: by(api, 'ray_tandem_running_seqs{worker="decode-0"}', "worker").get("decode-0") == 1,
                 RAY_FOLLOWS_S + SCRAPE_S + 2, "ray_tandem_running_seqs follows the decode worker")  # fmt: skip
        print(f"ray_tandem_running_seqs followed in {time.monotonic() - started:.1f} s")
        for _ in stream:
            pass


def test_every_grafana_query_parses_and_names_a_metric_prometheus_has(cluster, prometheus):
    api = prometheus.api

    def names() -> set[str]:
        with urllib.request.urlopen(f"{api}/api/v1/metadata", timeout=10) as r:
            families = set(json.load(r)["data"])
        return families | {family + suffix for family in families for suffix in ("_bucket", "_sum", "_count", "_total")}

    exprs = dashboards.expressions(prometheus.dashboard)
    assert len(exprs) > 20
    named = {expr: set(re.findall(r"\b(?:ray_)?tandem_[a-z0-9_]+\b", expr)) for expr in exprs}
    assert all(named.values()), [expr for expr, found in named.items() if not found]
    # Prometheus keeps a target's metadata from its last good scrape: on a loaded machine a scrape past
    # its 1 s timeout leaves that target's families out until the next good one.
    wanted = set().union(*named.values())
    have = wait_for(lambda: (n := names()) >= wanted and n, 30, "Prometheus has every family the dashboard queries")
    for expr in exprs:
        query(api, expr)  # a query that does not parse is an error (HTTP 400)
        assert named[expr] <= have, (expr, named[expr] - have)
