"""A Ray GCS that stops answering degrades the routers instead of stopping them (`cluster.lifeline` on a
fake clock; a router in each state), and without ray_ha a `tandem serve` whose GCS is killed finishes its
streams, drains, refuses in Tandem's words once the raylets give up, and exits 1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.lifeline import DEGRADED, DRAINING, LOST, OK, RAY_HEALTH, ClusterUnavailable, Lifeline
from router.openai.app import HTTPServer, create_app
from router.sdk.client import Client, Unavailable
from tests.fake_workers import FakeFleet
from tests.net import free_port
from tests.redis_server import RedisServer, needs_redis
from tests.streams import run_streams
from tests.test_router_async import make_router

pytestmark = pytest.mark.ray  # its slow tests start a Ray cluster

ROOT = Path(__file__).resolve().parents[1]
LOST_AFTER_S = 3.0  # router.ray_lost_after_s: degraded after this much silence
GIVES_UP_S, DRAIN_S = 40.0, 12.0  # ray_ha.reconnect_timeout_s and drain_s
STREAMS, STREAM_TOKENS = 24, 48


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_lifeline(answers: list[bool], times: list[float], gives_up_after_s: float | None) -> list[tuple]:
    """The changes a lifeline makes on a fake clock: the probe answers (True) or not at each time."""
    clock, changes = FakeClock(), []

    def probe() -> None:
        if not answers.pop(0):
            raise ClusterUnavailable("Ray's GCS at 10.0.0.1:6379 does not answer")

    lifeline = Lifeline(
        probe, lambda *change: changes.append((clock.now, *change)), 3, gives_up_after_s, drain_s=4, clock=clock
    )
    for t in times:
        clock.now = t
        lifeline.check()
    return changes


def test_without_ray_ha_a_silent_gcs_degrades_then_drains_then_is_lost_once():
    """Silent from 0 (an answer at 1 starts the silence again at 2): degraded at 3 s of silence, draining
    `drain_s` before the raylets give up (20 s), lost at 20 s, once."""
    times = [0, 1, 2, 4, 5, 6, 10, 18, 22, 30]
    answers = [False, True, False, False, False, False, False, False, False, False]
    changes = run_lifeline(answers, times, gives_up_after_s=20)
    assert [(t, state) for t, state, _ in changes] == [(5, DEGRADED), (18, DRAINING), (22, LOST)]
    degraded, draining, lost = (reason for _, _, reason in changes)
    assert (
        degraded == "Ray's GCS at 10.0.0.1:6379 does not answer (for 3 s): serving goes on; its raylets give up at 20 s"
    )
    assert "(for 16 s): its raylets exit with the workers at 20 s" in draining and "no new one is taken" in draining
    assert lost == "Ray's GCS at 10.0.0.1:6379 does not answer (for 20 s): its raylets have exited with the workers"


def test_a_gcs_that_answers_again_ends_degraded_and_draining_but_never_lost():
    times = [0, 3, 4, 5, 8, 21, 30, 40]
    changes = run_lifeline([False, False, True, False, False, False, True, False], times, gives_up_after_s=20)
    assert [(t, state) for t, state, _ in changes] == [(3, DEGRADED), (4, OK), (8, DEGRADED), (21, DRAINING), (30, OK)]
    with_ha = run_lifeline([False, False, False, True], [0, 5, 1000, 1001], gives_up_after_s=None)
    assert [(t, state) for t, state, _ in with_ha] == [(5, DEGRADED), (1001, OK)]  # ray_ha: degraded, never lost
    assert with_ha[0][2].endswith("serving goes on; it comes back with its tables (ray_ha)")


class GonePools:
    """`router.service.settings.PoolAdmin` whose actors Ray cannot reach."""

    def _gone(self, *args: object) -> None:
        raise ClusterUnavailable("the cluster's pool-decode actor cannot be reached (RayActorError)")

    scale = plan = pool_status = _gone


def test_a_router_serves_on_while_ray_is_degraded_drains_then_refuses_once_lost():
    """Degraded: requests are served, health stays SERVING with "tandem.ray" NOT_SERVING, the HTTP face says
    degraded, and only what needs Ray is refused, at once, with the reason. Draining: a stream that started
    before runs to its end, a new one is refused with the reason. Ray back: as before. Lost: nothing more."""
    fleet = FakeFleet()
    fleet.add("decode-0", "decode", step_s=0.01)
    router = make_router(fleet)
    router.pools = GonePools()  # type: ignore[assignment]
    address = router.start()
    http = HTTPServer(create_app(address, "fake"), "127.0.0.1", 0)
    base = f"http://{http.start()}"
    degraded = "Ray's GCS at 10.0.0.1:6379 does not answer (for 10 s): serving goes on; its raylets give up at 60 s"
    try:
        router.ray_changed(OK, "")
        assert (_health(address), _health(address, RAY_HEALTH)) == (SERVING, SERVING)
        assert _http_health(base) == (200, "ok")
        with grpc.insecure_channel(address) as channel:
            admin = worker_pb2_grpc.AdminStub(channel)
            for call, request in ((admin.GetStatus, worker_pb2.GetStatusRequest()),
                                  (admin.Scale, worker_pb2.ScaleRequest(pool="decode", replicas=2))):  # fmt: skip
                with pytest.raises(grpc.RpcError) as failed:  # an actor out of reach: Tandem's words, not Ray's
                    call(request, timeout=10)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                assert failed.value.details() == "the cluster's pool-decode actor cannot be reached (RayActorError)"

            router.ray_changed(DEGRADED, degraded)
            assert (_health(address), _health(address, RAY_HEALTH)) == (SERVING, NOT_SERVING)
            assert _http_health(base) == (200, "degraded")
            with Client(address, timeout=10, retries=0) as client:
                assert len(client.generate("x = 1", max_tokens=4).token_ids) == 4
            status = admin.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
            assert status.ray == f"degraded: {degraded}" and not status.pools and [w.name for w in status.workers]
            with pytest.raises(grpc.RpcError) as refused:
                admin.Scale(worker_pb2.ScaleRequest(pool="decode", replicas=2), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details() == f"{degraded}; scaling needs Ray, and waits for it"

        with Client(address, timeout=30, retries=0) as client, ThreadPoolExecutor(1) as pool:
            running = pool.submit(client.generate, "x = 2", max_tokens=150)  # 1.5 s of steps
            time.sleep(0.3)
            draining = "Ray's GCS ... (for 45 s): its raylets exit with the workers at 60 s"
            router.ray_changed(DRAINING, draining)
            assert _health(address) == NOT_SERVING and _http_health(base) == (503, "unavailable")
            with pytest.raises(Unavailable) as refused:
                client.generate("x = 3", max_tokens=2)
            assert draining in str(refused.value)
            assert len(running.result(30).token_ids) == 150, "a stream admitted before the drain runs to its end"

            router.ray_changed(OK, "")
            assert (_health(address), _health(address, RAY_HEALTH)) == (SERVING, SERVING)
            assert len(client.generate("x = 4", max_tokens=2).token_ids) == 2

        router.ray_changed(LOST, "Ray's GCS at 10.0.0.1:6379 does not answer (for 60 s): its raylets have exited")
        assert _health(address) == NOT_SERVING
        with Client(address, timeout=10, retries=0) as client, pytest.raises(Unavailable) as refused:
            client.generate("x = 1", max_tokens=2)
        assert "its raylets have exited; this router serves nothing more" in str(refused.value)
    finally:
        http.stop()
        router.stop()
        fleet.close()


def _http_health(base: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
            return response.status, json.loads(response.read())["status"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["status"]


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(address: str, service: str = "") -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
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


def _streams(address: str, n: int, first: threading.Event | None = None, retries: int = 0) -> list[list[int]]:
    return run_streams([address], n, "def f{i}(x):", STREAM_TOKENS, first, retries)


class Serve:
    """A `tandem serve` of examples/local.yaml with two decode workers, on a free port, its stderr in a file
    (a pipe could fill with Ray's complaints and block it); `gcs()` its GCS's pid."""

    def __init__(self, tmp_path: Path, extra: str, num_cpus: int) -> None:
        self.port = free_port()
        config = tmp_path / "cluster.yaml"
        text = (ROOT / "examples" / "local.yaml").read_text().replace("port: 50051", f"port: {self.port}")
        two = "decode:\n  replicas: 2\n  autoscaling:\n    min_replicas: 2\n    max_replicas: 3"
        text = text.replace("decode:\n  replicas: 1", two)
        config.write_text(text + f"  ray_lost_after_s: {LOST_AFTER_S}\n" + extra)
        self.log = tmp_path / "serve.log"
        self.address = f"127.0.0.1:{self.port}"
        tandem = str(Path(sys.executable).parent / "tandem")
        self.process = subprocess.Popen(
            [tandem, "serve", "--config", str(config), "--num-cpus", str(num_cpus)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), text=True,
        )  # fmt: skip
        self.ray_processes: dict[int, str] = {}

    def wait_serving(self) -> None:
        deadline = time.monotonic() + 300
        while _health(self.address) != SERVING:
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.5)
        assert _health(self.address, RAY_HEALTH) == SERVING

    def gcs(self) -> int:
        self.ray_processes |= _children(self.process.pid)
        gcs = [pid for pid, name in _children(self.process.pid).items() if name == "gcs_server"]
        assert len(gcs) == 1, self.ray_processes
        return gcs[0]

    def status(self) -> worker_pb2.ClusterStatus:
        with grpc.insecure_channel(self.address) as channel:
            return worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid, name in self.ray_processes.items():  # whatever of this serve's Ray outlived it (the same process)
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                    os.kill(pid, signal.SIGKILL)


def _kill_gcs_under_streams(serve: Serve) -> tuple[list[list[int]], list[list[int]], float]:
    """The 24 streams fault-free, then again with the GCS killed with SIGKILL once each has its first
    token: (fault-free tokens, under-loss tokens, when it was killed)."""
    fault_free = _streams(serve.address, STREAMS)
    gcs, first = serve.gcs(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        under_loss = pool.submit(_streams, serve.address, STREAMS, first)
        assert first.wait(120), "the streams never got going"
        os.kill(gcs, signal.SIGKILL)
        killed = time.monotonic()
        return fault_free, under_loss.result(300), killed


@pytest.mark.slow
def test_serve_whose_gcs_dies_without_ray_ha_finishes_its_streams_drains_then_refuses_and_exits(tmp_path):
    """A local `tandem serve` (1 prefill, 2 decode workers) whose GCS is killed with SIGKILL under 24
    streams, greedy and seeded, without ray_ha: every stream completes with its fault-free output, a new
    request is still served while degraded, then none is taken (draining), the refusals after the
    raylets give up name the cause, and serve exits 1."""
    serve = Serve(tmp_path, f"ray_ha:\n  reconnect_timeout_s: {GIVES_UP_S}\n  drain_s: {DRAIN_S}\n", num_cpus=3)
    try:
        serve.wait_serving()
        started = serve.log.read_text()  # the dashboard's address and how to authenticate
        assert "Ray dashboard at http://127.0.0.1:" in started and "`ray get-auth-token`" in started, started
        fault_free, under_loss, killed = _kill_gcs_under_streams(serve)
        assert under_loss == fault_free, "a stream started before the GCS died changed"
        assert time.monotonic() - killed < GIVES_UP_S - DRAIN_S, "the streams outlasted the drain: make them shorter"

        while _health(serve.address, RAY_HEALTH) != NOT_SERVING:
            assert time.monotonic() - killed < LOST_AFTER_S + 10, "Ray's health should turn NOT_SERVING"
            time.sleep(0.1)
        assert _health(serve.address) == SERVING, "degraded, the router serves on"
        with Client(serve.address, timeout=60, retries=0) as client:
            assert len(client.generate("def g(x):", max_tokens=8, ignore_eos=True).token_ids) == 8
            status = serve.status()
            assert status.ray.startswith("degraded: ") and "does not answer" in status.ray, status.ray
            while _health(serve.address) != NOT_SERVING:  # draining, DRAIN_S before the raylets give up
                assert time.monotonic() - killed < GIVES_UP_S, "the router should stop admitting before the raylets go"
                time.sleep(0.2)
            with pytest.raises(Unavailable) as refused:
                client.generate("x = 1", max_tokens=2)
            assert "no new one is taken" in str(refused.value), refused.value

        code = serve.process.wait(GIVES_UP_S + 30 - (time.monotonic() - killed))
        print(f"serve exited {time.monotonic() - killed:.1f} s after its GCS died")
        stderr = serve.log.read_text()
        assert code == 1, stderr
        assert "tandem: Ray is lost: " in stderr and "its raylets have exited with the workers" in stderr, stderr
        line = stderr.split("tandem: Ray is lost: ")[1].split("\n")[0]
        assert "ray." not in line and "Error" not in line, "Tandem's words, not Ray's exceptions"
    finally:
        serve.stop()


@needs_redis
@pytest.mark.slow
def test_serve_whose_gcs_dies_with_ray_ha_loses_nothing_and_its_head_comes_back(tmp_path):
    """With ray_ha on a real Redis: the GCS killed with SIGKILL under 24 streams (greedy and seeded) is
    started again from Redis on its port; no stream is lost or changed, Ray's health is ok again, and
    then a `scale` starts a worker and a worker killed afterwards is restarted by Ray."""
    redis, serve = _serve_on_redis(tmp_path)
    try:
        serve.wait_serving()
        before = serve.gcs()
        fault_free, under_loss, killed = _kill_gcs_under_streams(serve)
        assert under_loss == fault_free, "a stream changed while the GCS was gone"
        deadline = time.monotonic() + 120
        while serve.gcs() == before or _health(serve.address, RAY_HEALTH) != SERVING or serve.status().ray:
            assert time.monotonic() < deadline, f"the GCS did not come back: {serve.log.read_text()[-3000:]}"
            time.sleep(0.5)
        print(f"Ray ok again {time.monotonic() - killed:.1f} s after its GCS died")
        assert "starting it again from Redis" in serve.log.read_text()
        assert _health(serve.address) == SERVING and len(_streams(serve.address, 4)) == 4

        _scale_once_ray_answers(serve, "decode", 3)
        addresses = _wait_for_workers(serve, 4)  # 1 prefill and 3 decode workers, each healthy
        victim = next(iter(_workers(serve)))
        os.kill(victim, signal.SIGKILL)
        _wait_for_a_restart(serve, addresses)
    finally:
        serve.stop()
        redis.stop()


def _scale_once_ray_answers(serve: Serve, pool: str, replicas: int, timeout_s: float = 60.0) -> None:
    """`Scale`, asked again while it is refused UNAVAILABLE: a GCS started again from Redis may miss
    the router's probe for a few seconds more while its raylets register anew (on two cores), and
    scaling waits for Ray, as the refusal says."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(serve.address) as channel:
        admin = worker_pb2_grpc.AdminStub(channel)
        while True:
            try:
                admin.Scale(worker_pb2.ScaleRequest(pool=pool, replicas=replicas), timeout=60)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


def _serve_on_redis(tmp_path: Path, router: str = "") -> tuple[RedisServer, Serve]:
    """A Redis that evicts nothing (Ray's tables), and a serve whose head keeps its GCS there;
    `router`: more lines of the router's config."""
    redis = RedisServer(tmp_path, password="ray-ha-test", maxmemory="256mb", policy="noeviction").start()
    ha = f"ray_ha:\n  redis_address: 127.0.0.1:{redis.port}\n  redis_password: ray-ha-test\n"
    return redis, Serve(tmp_path, router + ha, num_cpus=4)


def _wait_for_workers(serve: Serve, n: int) -> dict[str, str]:
    """name -> address of the cluster's workers, once `n` are registered and healthy."""
    deadline = time.monotonic() + 180
    while True:
        workers = serve.status().workers
        if len(workers) == n and all(w.healthy for w in workers):
            return {w.name: w.address for w in workers}
        assert time.monotonic() < deadline, f"{n} healthy workers expected: {workers}"
        time.sleep(0.5)


def _wait_for_a_restart(serve: Serve, addresses: dict[str, str]) -> None:
    """Waits until Ray has restarted the one worker killed: the same names, one at a new address."""
    deadline = time.monotonic() + 120
    while (after := _wait_for_workers(serve, len(addresses))) == addresses:
        assert time.monotonic() < deadline, "Ray did not restart the killed worker"
        time.sleep(0.5)
    assert len(set(after.values()) - set(addresses.values())) == 1, "one worker came back at a new address"


def _workers(serve: Serve) -> dict[int, str]:
    """pid -> command line of this serve's Tandem worker actors (descendants of its raylet)."""
    raylets = [pid for pid, name in _children(serve.process.pid).items() if name == "raylet"]
    found = {}
    for raylet in raylets:
        for pid in _children(raylet):
            with contextlib.suppress(OSError):
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if args.startswith("ray::WorkerActor"):
                    found[pid] = args
    return found


@needs_redis
@pytest.mark.slow
def test_while_the_head_is_down_routers_serve_resume_and_report_and_a_new_router_waits_for_it(tmp_path):
    """With ray_ha and two routers sharing the port, the GCS stopped (SIGSTOP: a head that does not
    answer): a router replica killed under 24 streams loses none of them (the SDK resumes each through
    the other router), the routers' and workers' /metrics still answer with Ray marked degraded, a
    `tandem router` started meanwhile says it waits for Ray's GCS, then joins once the GCS answers, and
    a worker killed meanwhile is restarted once it does."""
    redis, serve = _serve_on_redis(tmp_path, "  replicas: 2\n")
    late, late_log = None, tmp_path / "late-router.log"
    try:
        serve.wait_serving()
        while len((status := serve.status()).routers) < 2:  # the replica's first report
            assert serve.process.poll() is None, serve.log.read_text()
            time.sleep(0.5)
        exporters = [w.load.metrics_address for w in status.workers]
        assert len(exporters) == 3, status
        addresses = _wait_for_workers(serve, 3)
        fault_free = _streams(serve.address, STREAMS)
        gcs = serve.gcs()
        (replica,) = [pid for pid in _children(serve.process.pid) if b" router " in _cmdline(pid)]
        os.kill(gcs, signal.SIGSTOP)
        stopped, first = time.monotonic(), threading.Event()
        try:
            with ThreadPoolExecutor(1) as pool:
                under_loss = pool.submit(_streams, serve.address, STREAMS, first, 3)
                assert first.wait(120), "the streams never got going"
                os.kill(replica, signal.SIGKILL)
                late = _start_router(serve, gcs, late_log)
                assert under_loss.result(300) == fault_free, "a stream was lost or changed"
            while _health(serve.address, RAY_HEALTH) == SERVING:
                assert time.monotonic() - stopped < LOST_AFTER_S + 10, "Ray's health should say degraded"
                time.sleep(0.2)
            for exporter in exporters:
                with urllib.request.urlopen(f"http://{exporter}/metrics", timeout=10) as response:
                    assert response.status == 200 and b"tandem_" in response.read()
            router = serve.status().metrics_address  # serve's own router: the replica is gone
            with urllib.request.urlopen(f"http://{router}/metrics", timeout=10) as response:
                assert 'tandem_ray{tandem_ray="degraded"} 1.0' in response.read().decode()
            while "does not answer yet; waiting" not in late_log.read_text():
                assert late.poll() is None and time.monotonic() - stopped < 60, late_log.read_text()
                time.sleep(0.2)
            assert not _ready(late, 0), "it joined before the GCS answered"
            os.kill(next(iter(_workers(serve))), signal.SIGKILL)  # restarted once the GCS answers
        finally:
            os.kill(gcs, signal.SIGCONT)
        assert _ready(late, 120), late_log.read_text()
        while _health(serve.address, RAY_HEALTH) != SERVING:
            assert time.monotonic() - stopped < 120, "Ray's health should be ok again"
            time.sleep(0.2)
        _wait_for_a_restart(serve, addresses)  # the worker killed while the GCS was away
    finally:
        if late is not None:
            late.kill()
            late.wait()
        serve.stop()
        redis.stop()


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    return b""


def _start_router(serve: Serve, gcs: int, log: Path) -> subprocess.Popen:
    """`tandem router` on a port of its own, attaching to the serve's Ray at its GCS's address."""
    args = dict(a.split("=", 1) for a in _cmdline(gcs).decode().split() if a.startswith("--") and "=" in a)
    session, node = Path(args["--session-dir"]), args["--node-id"]
    port = (session / f"gcs_server_port_{node}").read_text().strip()  # Ray starts it on port 0
    host = args["--node-ip-address"]
    config = str(serve.log.parent / "cluster.yaml")
    tandem = str(Path(sys.executable).parent / "tandem")
    argv = [tandem, "router", "--config", config, "--port", str(free_port()), "--ray-address", f"{host}:{port}"]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)


def _ready(router: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `router` printed its "router NAME at ADDRESS" line within `timeout_s`."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(router.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return False
    return router.stdout.readline().startswith("router ")
