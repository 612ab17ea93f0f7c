"""Router replicas as one fleet, without Ray: the registry's reports and their staleness, the
fleet view any router's `GetStatus` answers (over fake workers, real gRPC), `tandem status`'s
routers table, and the replica processes `tandem serve` starts for `router.replicas` > 1.
`tests/test_router_fleet_ray.py` runs the same on a real local Ray cluster."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cli.main import main as cli
from cluster.config import parse_config
from cluster.pools.registry import REPORT_TTL_S, Registry, fleet_latency
from router.sdk.client import Client
from router.service.fleet import fleet, totals
from router.service.replicas import ReplicaFailed, Replicas, command, replica_config
from tests.fake_workers import FakeFleet
from tests.test_router_async import make_router

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class LocalRegistry:
    """`router.service.fleet.RouterRegistry` over a `Registry` in this process (as `RayCluster` is over
    the `controller` actor); the routers' threads call it, hence the lock."""

    def __init__(self, clock: Clock) -> None:
        self.registry = Registry(clock)
        self._lock = threading.Lock()

    def register_router(self, name: str, address: str) -> None:
        with self._lock:
            self.registry.register(name, "router", address)

    def unregister_router(self, name: str) -> None:
        with self._lock:
            self.registry.unregister(name)

    def report_router(self, name: str, report: bytes) -> None:
        with self._lock:
            self.registry.report(name, report)

    def router_reports(self) -> list[tuple[float, bytes]]:
        with self._lock:
            return self.registry.router_reports()


def report(name: str, **fields) -> bytes:  # type: ignore[no-untyped-def]
    return worker_pb2.RouterStatus(name=name, **fields).SerializeToString()


def test_the_registry_keeps_routers_apart_from_workers_and_forgets_silent_ones():
    clock = Clock()
    registry = Registry(clock)
    registry.register("decode-0", "decode", "10.0.0.1:1")
    registry.register("router-a", "router", "10.0.0.2:50051")
    registry.register("router-b", "router", "10.0.0.3:50051")
    assert registry.workers() == {"decode-0": ("decode", "10.0.0.1:1")}
    registry.report("router-a", report("router-a"))
    registry.report("router-b", report("router-b"))
    clock.now += 3
    registry.report("router-b", report("router-b", requests_in_flight=2))
    assert sorted((age, worker_pb2.RouterStatus.FromString(r).name) for age, r in registry.router_reports()) == [
        (0.0, "router-b"),
        (3.0, "router-a"),
    ]
    clock.now += REPORT_TTL_S - 2  # router-a's report is now older than the bound: it died
    assert [worker_pb2.RouterStatus.FromString(r).name for _, r in registry.router_reports()] == ["router-b"]
    assert "router-a" not in registry._members, "forgotten with its report"
    registry.unregister("router-b")
    assert registry.router_reports() == []


def test_a_registry_started_again_is_refilled_and_one_that_left_stays_out():
    """A fresh registry (Ray started it again) learns the workers from their heartbeats and the routers
    from their reports; a router forgotten while silent comes back when it reports; a late heartbeat
    of a worker that unregistered does not bring it back, while one restarted at a new address does."""
    clock = Clock()
    registry = Registry(clock)
    registry.register("decode-0", "decode", "10.0.0.1:1")  # a heartbeat
    registry.report("router-a", report("router-a", address="10.0.0.2:50051"))
    assert registry.workers() == {"decode-0": ("decode", "10.0.0.1:1")}
    assert registry._members["router-a"] == ("router", "10.0.0.2:50051")
    assert len(registry.router_reports()) == 1

    clock.now += REPORT_TTL_S + 1  # silent (Ray's GCS away): forgotten, then back with its next report
    assert registry.router_reports() == []
    registry.report("router-a", report("router-a", address="10.0.0.2:50051"))
    assert len(registry.router_reports()) == 1

    registry.unregister("decode-0")  # retired
    registry.register("decode-0", "decode", "10.0.0.1:1")  # its last heartbeat, arriving late
    assert registry.workers() == {}
    registry.register("decode-0", "decode", "10.0.0.1:2")  # started again under its name
    assert registry.workers() == {"decode-0": ("decode", "10.0.0.1:2")}
    registry.unregister("router-a")
    registry.report("router-a", report("router-a", address="10.0.0.2:50051"))  # one still under way
    assert registry.router_reports() == [] and "router-a" not in registry._members


def test_the_pools_latency_signal_is_the_slowest_routers_p90():
    reports = [
        report("a", ttft_p90_seconds=0.2, tpot_p90_seconds=0.05),
        report("b", ttft_p90_seconds=0.9),
        report("c"),
    ]
    assert fleet_latency(reports) == (0.9, 0.05)
    assert fleet_latency([report("c")]) == (None, None)


def test_the_fleet_view_takes_this_routers_counters_as_they_are_and_sums_the_rest():
    own = worker_pb2.RouterStatus(name="router-b", requests_in_flight=3, decisions={"prefill=remote": 1})
    reports = [
        (0.4, report("router-b", requests_in_flight=1)),  # its own last report: older than its counters
        (0.7, report("router-a", requests_in_flight=2, decisions={"prefill=remote": 4, "prefill=local": 1})),
    ]
    routers = fleet(own, reports)
    assert [(r.name, r.requests_in_flight, r.age_seconds) for r in routers] == [
        ("router-a", 2, pytest.approx(0.7)),
        ("router-b", 3, 0.0),
    ]
    assert totals(routers) == (5, {"prefill=remote": 5, "prefill=local": 1})


def status(address: str) -> worker_pb2.ClusterStatus:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


def wait_for(condition, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


@pytest.fixture
def workers():
    workers = FakeFleet()
    workers.add("decode-0", step_s=0.02)
    yield workers
    workers.close()


def test_every_router_shows_the_fleet_and_a_router_that_stops_leaves_it(workers, capsys):
    clock = Clock()
    registry = LocalRegistry(clock)
    a, b, alone = make_router(workers), make_router(workers), make_router(workers)
    a.name, b.name = "router-a", "router-b"  # one process here; replicas' names differ by pid
    addresses = {r: r.start() for r in (a, b, alone)}
    running = [a, b, alone]
    try:
        a.join(registry)
        b.join(registry)
        with Client(addresses[a], timeout=60) as client:
            client.generate("w0 x y", max_tokens=4, temperature=0)
            stream = client.stream("w1 x y", max_tokens=400, temperature=0)
            next(stream)  # a request in flight on router-a
            seen = wait_for(
                lambda: (s := status(addresses[b])).requests_in_flight == 1 and s, 5, "router-a's report at router-b"
            )
            assert [(r.name, r.address, r.requests_in_flight) for r in seen.routers] == [
                ("router-a", addresses[a], 1),
                ("router-b", addresses[b], 0),
            ]
            assert seen.decisions["prefill=local:short-prompt"] == 2, "router-a's placements, summed at router-b"
            assert seen.routers[0].age_seconds <= 1.5 and seen.routers[1].age_seconds == 0
            assert cli(["status", "--target", addresses[b]]) == 0
            stream.close()
        out = capsys.readouterr().out
        assert "1 requests in flight over 2 routers" in out
        table = out.splitlines()[1:4]
        assert table[0].split()[:3] == ["router", "address", "in"]
        assert table[1].split()[:3] == ["router-a", addresses[a], "1"] and table[2].startswith("router-b")

        running.remove(a)
        a.stop()  # a router that stops leaves at once
        assert [r.name for r in status(addresses[b]).routers] == ["router-b"]
        registry.registry.report("router-dead", report("router-dead", requests_in_flight=7))
        assert status(addresses[b]).requests_in_flight == 7
        clock.now += REPORT_TTL_S + 0.5  # router-b reports again within the second; router-dead never will
        wait_for(lambda: [r.name for r in status(addresses[b]).routers] == ["router-b"], 5, "the dead report dropped")
        assert [r.name for r in status(addresses[alone]).routers] == [alone.name], "no registry: itself only"
    finally:
        for r in running:
            r.stop()


# -- the replicas `tandem serve` starts -----------------------------------------------------------

CONFIG = parse_config(
    {
        "model": {"path": str(ROOT / "models" / "tandem-demo-code")},
        "router": {"port": 0, "http_port": 8000, "replicas": 3},
        "telemetry": {"metrics_port": 9090},
        "auth": {"cluster_secret": "s3cret"},
    }
)
# A stand-in for `tandem router`: prints its ready line, then waits for SIGTERM and exits 0.
STUB = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]); "
    "print('router stub-%d at %s' % (os.getpid(), sys.argv[sys.argv.index('--port') + 1]), flush=True); "
    "signal.sigwait([signal.SIGTERM])",
)


@pytest.mark.ray
def test_a_replica_shares_the_port_and_the_ray_cluster_and_leaves_http_and_metrics_to_others(tmp_path):
    argv = command(tmp_path / "c.json", 50051, "10.0.0.1:6379")
    assert argv == [
        sys.executable, "-m", "cli.main", "router", "--config", str(tmp_path / "c.json"),
        "--port", "50051", "--ray-address", "10.0.0.1:6379",
    ]  # fmt: skip
    replica = replica_config(CONFIG)
    assert replica.router.http_port is None and replica.telemetry.metrics_port == 0
    assert replica.model == CONFIG.model and replica.auth == CONFIG.auth and replica.router.host == CONFIG.router.host


def test_serve_starts_replicas_minus_one_router_processes_and_stops_them():
    replicas = Replicas.start(CONFIG, 43210, "10.0.0.1:6379", CONFIG.router.replicas - 1, program=STUB)
    try:
        assert len(replicas.processes) == 2 and len({line.split()[1] for line in replicas.lines}) == 2
        assert all(line.endswith(" at 43210") for line in replicas.lines)
        assert replicas.config_file.stat().st_mode & 0o777 == 0o600, "it holds the cluster secret"
        written = json.loads(replicas.config_file.read_text())
        assert written["auth"]["cluster_secret"] == "s3cret" and written["router"]["http_port"] is None
        assert all(p.poll() is None for p in replicas.processes)
    finally:
        replicas.stop(timeout_s=10)
    assert [p.returncode for p in replicas.processes] == [0, 0], "they stopped on SIGTERM"
    assert not replicas.config_file.exists()


def test_a_replica_that_exits_before_serving_fails_serve():
    with pytest.raises(ReplicaFailed, match="exited before serving"):
        Replicas.start(CONFIG, 1, "x", 1, program=(sys.executable, "-c", "raise SystemExit(3)"))
