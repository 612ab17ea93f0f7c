"""A Ray cluster that dies says so in Tandem's words: `cluster.lifeline.Lifeline` on a fake clock,
and `tandem serve` whose local Ray loses its GCS (killed here): clients get UNAVAILABLE with
Tandem's message, health turns NOT_SERVING, and serve exits 1 within the stated time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.lifeline import ClusterUnavailable, Lifeline
from router.sdk.client import Client, Unavailable
from tests.fake_workers import FakeFleet
from tests.net import free_port
from tests.test_router_async import make_router

pytestmark = pytest.mark.ray  # its slow tests start a Ray cluster

ROOT = Path(__file__).resolve().parents[1]
LOST_AFTER_S = 3.0
# docs/operations.md: serve exits within router.ray_lost_after_s + 30 s of the GCS's death.
EXIT_WITHIN_S = LOST_AFTER_S + 30


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lifeline_is_lost_once_after_the_probe_fails_without_a_break():
    clock, answers, lost = FakeClock(), [], []

    def probe() -> None:
        if not answers.pop(0):
            raise ClusterUnavailable("the Ray cluster is gone")

    lifeline = Lifeline(probe, lost.append, lost_after_s=5, clock=clock)
    answers.extend([False, True, False, False, False, False])
    for t in (0, 1, 2, 4, 6.5, 8):  # fails at 0, answers at 1: the failing run starts again at 2
        clock.now = t
        lifeline.check()
    assert lost == ["the Ray cluster is gone (for 6 s)"]  # at 8, six seconds after 2; once
    assert lifeline.lost and lifeline.check()


class GonePools:
    """`router.service.settings.PoolAdmin` whose actors Ray cannot reach."""

    def _gone(self, *args: object) -> None:
        raise ClusterUnavailable("the cluster's pool-decode actor cannot be reached (RayActorError)")

    scale = plan = pool_status = _gone


def test_the_router_says_unavailable_in_its_own_words_and_stops_serving_once_ray_is_lost():
    fleet = FakeFleet()
    fleet.add("decode-0", "decode")
    router = make_router(fleet)
    router.pools = GonePools()  # type: ignore[assignment]
    address = router.start()
    try:
        with grpc.insecure_channel(address) as channel:
            admin = worker_pb2_grpc.AdminStub(channel)
            for call, request in ((admin.GetStatus, worker_pb2.GetStatusRequest()),
                                  (admin.Scale, worker_pb2.ScaleRequest(pool="decode", replicas=2))):  # fmt: skip
                with pytest.raises(grpc.RpcError) as failed:
                    call(request, timeout=10)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                assert failed.value.details() == "the cluster's pool-decode actor cannot be reached (RayActorError)"
            assert _health(address) == health_pb2.HealthCheckResponse.SERVING
            router.lose_cluster("the Ray cluster is gone: its GCS at 10.0.0.1:6379 does not answer (for 10 s)")
            assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with Client(address, timeout=10, retries=0) as client, pytest.raises(Unavailable) as refused:
            client.generate("x = 1", max_tokens=2)
        assert "does not answer (for 10 s); this router serves nothing more" in str(refused.value)
    finally:
        router.stop()
        fleet.close()


def _health(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def _children(pid: int) -> dict[int, str]:
    """pid -> command name of `pid`'s direct children (from /proc: this serve's own Ray processes
    only, never another Ray on the machine)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(rest[1]) == pid:
            found[int(entry.name)] = name
    return found


@pytest.mark.slow
def test_serve_whose_ray_loses_its_gcs_refuses_turns_not_serving_and_exits(tmp_path):
    port = free_port()
    config = tmp_path / "cluster.yaml"
    text = (ROOT / "examples" / "local.yaml").read_text().replace("port: 50051", f"port: {port}")
    config.write_text(text + f"  ray_lost_after_s: {LOST_AFTER_S}\n")
    log = tmp_path / "serve.log"  # a file, not a pipe: Ray's own complaints could fill a pipe and block serve
    serve = subprocess.Popen(
        [str(Path(sys.executable).parent / "tandem"), "serve", "--config", str(config), "--num-cpus", "2"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    ray_processes: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300
        while _health(address) != health_pb2.HealthCheckResponse.SERVING:
            assert serve.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.5)
        with Client(address, timeout=60, retries=0) as client:
            assert client.generate("def add(a, b):", max_tokens=4, temperature=0).text
        started = log.read_text()  # the dashboard's address and how to authenticate
        assert "Ray dashboard at http://127.0.0.1:" in started and "`ray get-auth-token`" in started, started
        ray_processes = _children(serve.pid)
        gcs = [pid for pid, name in ray_processes.items() if name == "gcs_server"]
        assert len(gcs) == 1, ray_processes
        os.kill(gcs[0], signal.SIGKILL)
        killed = time.monotonic()

        while _health(address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - killed < LOST_AFTER_S + 10, "health should turn NOT_SERVING"
            time.sleep(0.1)
        with Client(address, timeout=10, retries=0) as client, pytest.raises(Unavailable) as refused:
            client.generate("x = 1", max_tokens=2)
        assert "the Ray cluster is gone" in str(refused.value), refused.value
        assert "ray" not in str(refused.value).replace("Ray", ""), "Tandem's message, not Ray's"
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as status:
            worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        assert status.value.code() == grpc.StatusCode.UNAVAILABLE

        code = serve.wait(EXIT_WITHIN_S - (time.monotonic() - killed))
        print(f"serve exited {time.monotonic() - killed:.1f} s after its GCS died")
        stderr = log.read_text()
        assert code == 1, stderr
        assert "tandem: the Ray cluster is gone: its GCS at" in stderr
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        for pid, name in ray_processes.items():  # whatever of this serve's Ray outlived it (the same process)
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                    os.kill(pid, signal.SIGKILL)
