"""KV tiers through the cluster (demo model, float32, engines on the workers' threads, gRPC on
loopback, a real Redis): turn 2 of a chat whose blocks the pools evicted loads them and computes only
the rest, with the tokens of a fresh prefill (greedy and seeded); a worker that never saw a prompt
loads its prefix from the shared tier; a worker restarted with its disk tier keeps its hits; Redis
killed mid-run loses no request, and its tier comes back with it."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import pytest

from cluster.config import parse_config
from cluster.generate import generate
from cluster.model.loader import load_model
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from router.sdk.client import Client
from router.service.server import from_config
from tests.redis_server import RedisServer, needs_redis

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
SECRET = "tiers-cluster-secret"

pytestmark = [pytest.mark.slow, needs_redis]


def config(redis_url: str, disk: Path | None = None, num_blocks: int = 24, spans: Path | None = None):  # type: ignore[no-untyped-def]
    tiers: dict = {"host": {"gib": 0.05}, "shared": {"url": redis_url, "timeout_s": 0.3}, "write": "computed"}
    tiers["retry_after_s"] = 0.5
    if disk is not None:
        tiers["disk"] = {"path": str(disk), "gib": 0.05}
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": "thread"},
            "cache": {"block_size": 16, "num_blocks": num_blocks, "tiers": tiers},
            "transfer": {"transport": "grpc", "timeout_s": 20},
            "router": {"local_prefill_max_tokens": 32},
            "auth": {"cluster_secret": SECRET},
            "telemetry": {"exporter": "console", "console_dir": str(spans)} if spans else {},
        }
    )


class Cluster:
    """Decode and prefill workers and a router over them, started from one config."""

    def __init__(self, cfg, decode: int = 1, prefill: int = 1, tag: str = "") -> None:  # type: ignore[no-untyped-def]
        self.workers = {f"decode-{tag}{i}": decode_service.from_config(cfg, f"decode-{tag}{i}") for i in range(decode)}
        self.workers |= {
            f"prefill-{tag}{i}": prefill_service.from_config(cfg, f"prefill-{tag}{i}") for i in range(prefill)
        }
        addresses = {name: worker.start() for name, worker in self.workers.items()}
        self.router = from_config(cfg, lambda: addresses)
        self.address = self.router.start()

    def metric(self, name: str, tier: str) -> float:
        """A tier metric summed over the workers, as their /metrics serve it after a load report."""
        total = 0.0
        for worker in self.workers.values():
            worker.load()  # brings the worker's metrics up to its engine's counts
            total += worker.telemetry.metrics.registry.get_sample_value(name, {"tier": tier}) or 0.0
        return total

    def waited(self, name: str) -> float:
        """How many first tokens a histogram of the decode workers' counted."""
        labels = {"stage": "decode"} if name == "tandem_queue_seconds" else {}
        decode = [w for n, w in self.workers.items() if n.startswith("decode")]
        return sum(w.telemetry.metrics.registry.get_sample_value(f"{name}_count", labels) or 0.0 for w in decode)

    def stop(self) -> None:
        self.router.stop()
        for worker in self.workers.values():
            worker.stop()


@pytest.fixture(scope="module")
def model():
    return load_model(DEMO, "float32")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path_factory.mktemp("redis"), password=SECRET).start()
    yield server
    server.stop()


def chat(seed: int, n: int = 120) -> list[int]:
    return [(seed * 53 + 11 * i) % 1900 + 5 for i in range(n)]


def test_turn_2_loads_what_the_pools_evicted_and_equals_a_fresh_prefill(redis_server, model, tmp_path):
    cluster = Cluster(config(redis_server.url, spans=tmp_path / "spans"))
    try:
        with Client(cluster.address, timeout=60) as client:
            history = chat(1)
            first = client.generate(history, max_tokens=8, temperature=0.0, ignore_eos=True)
            for seed in (2, 3, 4):  # 120-token prompts through 24-block pools: turn 1's blocks go
                client.generate(chat(seed), max_tokens=8, temperature=0.0, ignore_eos=True)
            turn_2 = [*history, *first.token_ids, 7, 8, 9]
            done = client.generate(turn_2, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert done.token_ids == generate(model, [turn_2], 8)[0].tokens
            assert done.cached_prompt_tokens >= 112, "turn 2 computed what the tiers held"
            seeded = {"max_tokens": 8, "temperature": 0.8, "seed": 5, "ignore_eos": True}
            loaded = client.generate(turn_2, **seeded)
            fresh = client.generate(turn_2, cache_salt="nobody's cache", **seeded)  # computed whole
            assert loaded.cached_prompt_tokens > 0 and fresh.cached_prompt_tokens == 0
            assert loaded.token_ids == fresh.token_ids
        assert (
            cluster.metric("tandem_kv_tier_hit_blocks_total", "host")
            + cluster.metric("tandem_kv_tier_hit_blocks_total", "shared")
            >= 7
        )
        assert cluster.metric("tandem_kv_tier_written_blocks_total", "shared") > 0
        assert cluster.metric("tandem_kv_tier_up", "shared") == 2  # on, on both workers
    finally:
        cluster.stop()
    spans = [json.loads(line) for f in (tmp_path / "spans").glob("*.jsonl") for line in f.read_text().splitlines()]
    per_span = [
        sum(n for key, n in s["attributes"].items() if key.startswith("tandem.kv.loaded_blocks."))
        for s in spans
        if s["name"] in ("prefill.compute", "decode")
    ]
    assert max(per_span) >= 7, "no span says what its request loaded from the tiers"


def test_a_worker_that_never_saw_a_prompt_loads_its_prefix_from_the_shared_tier(redis_server, model):
    prompt = chat(9, 160)
    owner = Cluster(config(redis_server.url), prefill=0, tag="a")
    try:
        with Client(owner.address, timeout=60) as client:
            client.generate(prompt, max_tokens=2, temperature=0.0)
    finally:
        owner.stop()  # its written-through blocks are in Redis; its pools are gone
    stranger = Cluster(config(redis_server.url), prefill=0, tag="b")
    try:
        with Client(stranger.address, timeout=60) as client:
            turn = [*prompt, 3, 4, 5]
            done = client.generate(turn, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert done.token_ids == generate(model, [turn], 8)[0].tokens
        assert done.cached_prompt_tokens >= 144, "the stranger computed more than 10 % of the shared prefix"
        # its decode worker prefilled it: the wait for Redis's load, its queue and its passes are counted
        assert stranger.waited("tandem_kv_tier_wait_seconds") == 1
        assert stranger.waited("tandem_queue_seconds") == stranger.waited("tandem_local_prefill_seconds") == 1
    finally:
        stranger.stop()


def test_a_worker_restarted_with_its_disk_tier_keeps_its_hits(tmp_path, model):
    down = "redis://127.0.0.1:1/0"  # no Redis there: the shared tier is off, the disk tier serves
    prompt = chat(13, 96)
    before = Cluster(config(down, tmp_path / "kv"), prefill=0, tag="r")
    try:
        with Client(before.address, timeout=60) as client:
            client.generate(prompt, max_tokens=2, temperature=0.0)
            time.sleep(0.5)  # the writer thread puts the blocks on disk
    finally:
        before.stop()
    after = Cluster(config(down, tmp_path / "kv"), prefill=0, tag="r")
    try:
        with Client(after.address, timeout=60) as client:
            done = client.generate([*prompt, 1], max_tokens=6, temperature=0.0, ignore_eos=True)
        assert done.cached_prompt_tokens >= 80
        assert done.token_ids == generate(model, [[*prompt, 1]], 6)[0].tokens
    finally:
        after.stop()


def test_redis_killed_mid_run_loses_no_request_and_its_tier_comes_back(tmp_path, model):
    server = RedisServer(tmp_path, password=SECRET).start()
    cluster = Cluster(config(server.url), prefill=0, tag="k")
    prompts = [chat(20 + i, 64) for i in range(12)]
    expected = [r.tokens for r in generate(model, prompts, 6)]
    try:
        with Client(cluster.address, timeout=60) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
            ask = lambda p: client.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True)  # noqa: E731
            running = [pool.submit(ask, p) for p in prompts]
            time.sleep(0.2)
            server.stop()
            assert [f.result(60).token_ids for f in running] == expected, "a request was lost or changed"
            assert [ask(p).token_ids for p in prompts[:3]] == expected[:3], "serving without Redis failed"
            assert cluster.metric("tandem_kv_tier_failures_total", "shared") >= 1
            server.start()
            time.sleep(0.6)  # past retry_after_s
            fresh = chat(40, 80)
            ask(fresh)
            time.sleep(0.3)  # written through to the new Redis
        again = Cluster(config(server.url), prefill=0, tag="k2")
        try:
            with Client(again.address, timeout=60) as client:
                assert client.generate([*fresh, 2], max_tokens=2, temperature=0.0).cached_prompt_tokens >= 64
        finally:
            again.stop()
    finally:
        cluster.stop()
        server.stop()
