"""Autoscaling on a real local Ray cluster: decode pressure grows the decode pool alone, long prompts
grow the prefill pool, both shrink back when the load stops, and no request fails or changes its
output on the way. A drained worker gets no new requests and stops only once empty."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import ray

from cluster.config import parse_config
from cluster.engine.request import SamplingParams
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from cluster.pools import ray_cluster
from decode_worker.engine import Engine
from router.sdk.client import Client
from router.service.server import from_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SCALING = {
    "min_replicas": 1, "max_replicas": 2, "interval_s": 0.3, "upscale_delay_s": 0.6, "downscale_delay_s": 2.0,
    "drain_grace_s": 0.5,
}  # fmt: skip


def config():
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 1024},
            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 256},
            "router": {"local_prefill_max_tokens": 8},
            # Latency targets this CPU always meets, so each pool scales on its load signals here.
            "slo": {"ttft_s": 60, "tpot_s": 10},
            "prefill": {"num_cpus": 0.5, "autoscaling": {**SCALING, "target_queued_prompt_tokens": 100}},
            "decode": {"num_cpus": 0.5, "autoscaling": {**SCALING, "target_running_seqs": 3}},
        }
    )


@pytest.fixture(scope="module")
def cluster():
    ray.init("local", num_cpus=4, include_dashboard=False, namespace="tandem-scaling-tests", log_to_driver=False)
    cfg = config()
    handle = ray_cluster.start(cfg, namespace="tandem-scaling")
    router = from_config(cfg, handle.discover, handle)
    address = router.start()
    router.join(handle)  # its reports give the pools their latency signals
    yield handle, address
    router.stop()
    handle.shutdown()
    ray.shutdown()


def serving(handle) -> dict[str, int]:
    return {p.role: len(p.workers) for p in handle.pool_status()}


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Load:
    """Closed-loop clients sending requests until stopped; every request and its output is kept."""

    def __init__(self, address: str, clients: int, prompt_len: int, max_tokens: int, seed: int) -> None:
        self.address, self.prompt_len, self.max_tokens = address, prompt_len, max_tokens
        self.rng = random.Random(seed)
        self.done: list[tuple[list[int], int, list[int]]] = []
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        with Client(self.address, timeout=120, retries=0) as client:
            while not self._stop.is_set():
                with self._lock:
                    prompt = [self.rng.randrange(5, 2000) for _ in range(self.prompt_len)]
                try:
                    out = client.generate(prompt, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
                    with self._lock:
                        self.done.append((prompt, self.max_tokens, out.token_ids))
                except Exception as e:  # every failure is a test failure, reported at the end
                    self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def check_outputs(requests: list[tuple[list[int], int, list[int]]]) -> None:
    """Every request's tokens equal the single-process engine's."""
    tok = Tokenizer(DEMO)
    cfg = config()
    engine = Engine(load_model(DEMO, "float32"), tok, cfg.cache, cfg.scheduler, tok.eos_token_ids)
    for i, (prompt, max_tokens, _) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    expected: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    while engine.has_unfinished:
        for out in engine.step():
            expected[out.request_id] += out.token_ids
    for i, (_, _, got) in enumerate(requests):
        assert got == expected[str(i)], f"request {i}"


def test_each_pool_scales_on_its_own_load_and_back_without_losing_a_request(cluster):
    handle, address = cluster
    assert serving(handle) == {"decode": 1, "prefill": 1}
    sent = []

    decode_load = Load(address, clients=8, prompt_len=4, max_tokens=120, seed=1)  # long outputs, local prefill
    try:
        wait_for(lambda: serving(handle)["decode"] == 2, 180, "the decode pool to grow")
        assert serving(handle)["prefill"] == 1, "decode pressure must not grow the prefill pool"
    finally:
        decode_load.stop()
    sent += decode_load.done
    assert not decode_load.errors, decode_load.errors[:3]

    wait_for(lambda: serving(handle) == {"decode": 1, "prefill": 1}, 60, "the pools to shrink back")

    prefill_load = Load(address, clients=8, prompt_len=500, max_tokens=1, seed=2)  # long prompts
    try:
        wait_for(lambda: serving(handle)["prefill"] == 2, 180, "the prefill pool to grow")
    finally:
        prefill_load.stop()
    sent += prefill_load.done
    assert not prefill_load.errors, prefill_load.errors[:3]

    def settled() -> bool:
        pools = handle.pool_status()
        return serving(handle) == {"decode": 1, "prefill": 1} and not any(p.draining for p in pools)

    wait_for(settled, 60, "both pools back at their minimum, drained workers stopped")
    wait_for(lambda: len(handle.discover()) == 2, 10, "stopped workers to leave the registry")
    statuses = {p.role: p for p in handle.pool_status()}
    assert statuses["decode"].scale_ups >= 1 and statuses["prefill"].scale_ups >= 1
    assert statuses["decode"].scale_downs >= 1 and statuses["prefill"].scale_downs >= 1
    check_outputs(sent)


def test_a_draining_worker_gets_no_new_requests_and_stops_only_when_empty(cluster):
    handle, address = cluster
    handle.scale("decode", 2)
    wait_for(lambda: serving(handle)["decode"] == 2 and len(handle.discover()) == 3, 180, "two decode workers")
    with Client(address, timeout=120) as client:
        stream = client.stream([9, 10, 11], max_tokens=400, temperature=0, ignore_eos=True)
        first = next(stream)  # a message may carry several tokens: a reader behind gets them merged
        busy = next(  # the worker holding the long request
            name
            for name, address in handle.discover().items()
            if name.startswith("decode") and handle_load(handle, name).running_seqs
        )
        handle.drain(busy)
        wait_for(lambda: handle_load(handle, busy).draining, 10, f"{busy} to drain")
        time.sleep(0.5)  # the router's pushed view follows within its staleness bound (one heartbeat)
        placed = [client.generate([5, 6, 7], max_tokens=4, temperature=0).metadata["tandem-decode"] for _ in range(8)]
        assert busy not in placed, "the draining worker must get no new request"
        time.sleep(1.5)  # past the grace period: still running its sequence, so still up
        assert busy in handle.discover()
        rest = list(stream)
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 400
    wait_for(lambda: busy not in handle.discover(), 30, f"{busy} to stop after its last sequence")
    handle.scale("decode", None)


def handle_load(handle, name: str):
    from tandem.v1 import worker_pb2

    return worker_pb2.WorkerLoad.FromString(ray.get(handle.actor(name).load.remote()))


def test_a_planned_target_set_through_the_router_grows_an_idle_pool_and_clearing_it_shrinks_it(cluster):
    import grpc
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    handle, address = cluster
    wait_for(lambda: serving(handle)["decode"] == 1, 60, "the decode pool at its minimum")
    with grpc.insecure_channel(address) as channel:
        admin = worker_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            admin.Scale(worker_pb2.ScaleRequest(pool="decode", replicas=1, planned=2), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        pool = admin.Scale(worker_pb2.ScaleRequest(pool="decode", planned=2), timeout=60).pool
        assert pool.planned == 2 and pool.target == 2 and not pool.HasField("override")
        wait_for(lambda: serving(handle)["decode"] == 2 and len(handle.discover()) == 3, 180, "the planned worker")
        time.sleep(3 * SCALING["downscale_delay_s"])  # idle: the signals alone would have shrunk the pool by now
        assert serving(handle)["decode"] == 2
        pool = admin.Scale(worker_pb2.ScaleRequest(pool="decode", clear_planned=True), timeout=60).pool
        assert not pool.HasField("planned")
    wait_for(lambda: serving(handle)["decode"] == 1, 60, "the pool back at its minimum once the plan is cleared")
