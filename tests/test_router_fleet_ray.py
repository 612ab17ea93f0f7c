"""Router replicas on a real local Ray cluster of the demo model: the pools started once, a router
in this process joined to the registry and a second one as a `tandem router` process attached to
the same cluster. Both serve; either one's status lists both with their requests summed; a router
killed drops out within the registry's staleness bound; an attached handle's shutdown leaves the
pools running; the pools' latency signal comes from the routers' reports; a registry that Ray starts
again under live routers loses no stream and is refilled."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ray
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.config import dump_config, parse_config
from cluster.pools import ray_cluster
from cluster.pools.registry import REGISTER_EVERY_S, REPORT_TTL_S
from router.sdk.client import Client
from router.service.replicas import command
from router.service.server import from_config
from tests.streams import run_streams

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
NAMESPACE = ray_cluster.NAMESPACE  # the default, which `tandem router` attaches to

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def config():
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 128},
            "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256},
            "router": {"local_prefill_max_tokens": 8, "port": 0},
            "prefill": {"num_cpus": 1},
            "decode": {"num_cpus": 1},
        }
    )


@pytest.fixture(scope="module")
def cluster():
    ray.init("local", num_cpus=4, include_dashboard=False, namespace="tandem-fleet-tests", log_to_driver=False)
    handle = ray_cluster.start(config(), namespace=NAMESPACE)
    yield handle
    handle.shutdown()
    ray.shutdown()


def start_replica(cluster, tmp_path: Path) -> tuple[subprocess.Popen, str, str]:
    """A `tandem router` process attached to `cluster`, on a port of its own (so that each router
    can be reached alone); returns it, its name and its address."""
    path = tmp_path / "config.json"
    path.write_text(dump_config(config()))
    log = (tmp_path / "router.log").open("w")
    process = subprocess.Popen(
        command(path, 0, cluster.address()), stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT
    )
    line = process.stdout.readline().split()  # "router NAME at ADDRESS"
    assert line[:1] == ["router"], (tmp_path / "router.log").read_text()
    return process, line[1], line[3]


@pytest.fixture(scope="module")
def routers(cluster, tmp_path_factory):
    router = from_config(config(), cluster.discover, cluster)
    address = router.start()
    router.join(cluster)
    process, name, other = start_replica(cluster, tmp_path_factory.mktemp("replica"))
    yield {router.name: address, name: other}, process
    if process.poll() is None:
        process.kill()
        process.wait()
    router.stop()


def status(address: str) -> worker_pb2.ClusterStatus:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


def wait_for(condition, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


PROMPT = list(range(40, 90))  # long enough to be prefilled on the prefill worker


def pid_of(actor) -> int | None:  # type: ignore[no-untyped-def]
    """The actor's process id; None while Ray is still starting it again."""
    try:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    except ray.exceptions.ActorUnavailableError:
        return None


def test_both_routers_serve_the_one_cluster_and_either_shows_both(routers):
    addresses, _ = routers
    answers = []
    for address in addresses.values():
        with Client(address, timeout=120) as client:
            answers.append(client.generate(PROMPT, max_tokens=8, temperature=0).token_ids)
    assert answers[0] == answers[1] and len(answers[0]) == 8, "the same workers answer through either router"

    streams = []
    for address in addresses.values():  # one long request in flight on each router
        client = Client(address, timeout=120)
        # in flight until closed below: on a fast CPU, 300 tokens ended before both routers had reported
        stream = client.stream(PROMPT, max_tokens=900, temperature=0, ignore_eos=True)
        next(stream)
        streams.append((client, stream))
    try:
        for address in addresses.values():
            # a router's placements arrive with its status report, so wait for both
            def settled(a: str = address):  # type: ignore[no-untyped-def]
                s = status(a)
                return s.requests_in_flight == 2 and sum(s.decisions.values()) >= 4 and s

            seen = wait_for(settled, 5, "both in flight, both routers' placements reported")
            assert {r.name: r.address for r in seen.routers} == addresses
            assert [r.requests_in_flight for r in seen.routers] == [1, 1]
            assert sum(seen.decisions.values()) >= 4, "both routers' placements"
            assert {w.name for w in seen.workers} == {"prefill-0", "decode-0"}
    finally:
        for client, stream in streams:
            stream.close()
            client.close()


def test_the_pools_read_the_routers_latency_from_their_reports(cluster, routers):
    addresses, _ = routers
    reports = [status(a).routers for a in addresses.values()]
    slowest = max(r.ttft_p90_seconds for r in reports[0])
    ops = ray_cluster._RayWorkers("decode", config(), NAMESPACE, "127.0.0.1")
    ops.refresh_latency()
    ttft, tpot = ops.latency()
    assert ttft is not None and tpot is not None
    assert ttft == pytest.approx(slowest, rel=0.5), "the highest TTFT p90 among the routers"


def streams(addresses: dict[str, str], first: threading.Event | None = None) -> list[list[int]]:
    return run_streams(list(addresses.values()), 8, PROMPT, 64, first)


def test_a_registry_started_again_under_live_routers_loses_nothing_and_is_refilled(cluster, routers):
    """The registry (the `controller` actor) killed under 8 streams through both routers: Ray starts it
    again in a new process; every stream ends with its fault-free tokens, and the new registry lists
    every worker (their heartbeats) and both routers (their reports) again, as either router shows."""
    addresses, _ = routers
    registry = cluster.actors[ray_cluster.CONTROLLER]
    pid = ray.get(registry.__ray_call__.remote(lambda self: os.getpid()))
    workers = ray.get(registry.workers.remote())
    fault_free, first = streams(addresses), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        under_loss = pool.submit(streams, addresses, first)
        assert first.wait(60), "the streams never got going"
        ray.kill(registry, no_restart=False)
        assert under_loss.result(180) == fault_free, "a stream changed while the registry was away"
    assert wait_for(lambda: pid_of(registry), 60, "the registry started again") != pid, "a new process"
    wait_for(lambda: ray.get(registry.workers.remote()) == workers, 2 * REGISTER_EVERY_S + 5, "every worker back")
    for address in addresses.values():
        wait_for(lambda a=address: {r.name for r in status(a).routers} == set(addresses), 10, "both routers back")


def test_a_killed_router_drops_out_within_the_staleness_bound(routers):
    addresses, process = routers
    name = next(n for n, a in addresses.items() if not n.endswith(f"-{os.getpid()}"))
    survivor = addresses[next(n for n in addresses if n != name)]
    process.send_signal(signal.SIGKILL)  # no chance to unregister
    process.wait()
    killed = time.monotonic()
    wait_for(lambda: name not in {r.name for r in status(survivor).routers}, REPORT_TTL_S + 3, "the dead router gone")
    assert time.monotonic() - killed <= REPORT_TTL_S + 3


def test_a_router_that_stops_leaves_at_once_and_an_attached_handle_leaves_the_pools(cluster, routers):
    addresses, _ = routers
    survivor = next(a for n, a in addresses.items() if n.endswith(f"-{os.getpid()}"))
    attached = ray_cluster.attach(config(), namespace=NAMESPACE, timeout_s=10)
    assert not attached.owned and attached.discover() == cluster.discover()
    extra = from_config(config(), attached.discover, attached)
    extra.start()
    extra.name = "router-extra"  # this process holds another router already
    extra.join(attached)
    assert "router-extra" in {r.name for r in status(survivor).routers}
    extra.stop()
    assert "router-extra" not in {r.name for r in status(survivor).routers}
    attached.shutdown()
    assert {p.role: len(p.workers) for p in cluster.pool_status()} == {"decode": 1, "prefill": 1}
    with Client(survivor, timeout=120) as client:
        assert len(client.generate(PROMPT, max_tokens=4, temperature=0).token_ids) == 4


def test_attach_waits_for_the_cluster_then_says_what_is_missing(cluster):
    with pytest.raises(TimeoutError, match="no controller, pool-decode, pool-prefill in Ray namespace 'nowhere'"):
        ray_cluster.attach(config(), namespace="nowhere", timeout_s=1)
