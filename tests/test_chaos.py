"""Chaos on a real local Ray cluster: under a steady load of concurrent requests, greedy ones and
seeded sampled ones (temperature 0.8, each with its own seed), a worker's process is killed with
SIGKILL mid-request. Ray restarts it; the router moves each broken request to a live worker (the
prompt, and the tokens already streamed as output, prefilled again) and continues the same client
stream. Every request completes with exactly the fault-free tokens and text: a seeded one samples
each token from (seed, its index in the output, the logits), so moving does not change it."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from cluster.config import parse_config
from cluster.engine.request import SamplingParams
from cluster.engine.structured import for_tokenizer
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from cluster.pools import ray_cluster
from decode_worker.engine import Engine
from router.sdk.client import Client
from router.service.server import from_config
from tests.test_structured import CONSTRAINTS, check
from tests.test_structured_cluster import KINDS, PROMPTS, TYPED

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def config():
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 512},
            "scheduler": {"max_num_batched_tokens": 256},
            "router": {"local_prefill_max_tokens": 8, "migration_limit": 3, "migration_wait_s": 90},
            "prefill": {"num_cpus": 0.5},
            "decode": {"num_cpus": 0.5},
        }
    )


@pytest.fixture(scope="module")
def cluster():
    ray.init("local", num_cpus=4, include_dashboard=False, namespace="tandem-chaos-tests", log_to_driver=False)
    cfg = config()
    handle = ray_cluster.start(cfg, namespace="tandem-chaos")
    router = from_config(cfg, handle.discover, handle)
    address = router.start()
    yield handle, router, address
    router.stop()
    handle.shutdown()
    ray.shutdown()


# A request: (prompt, max_tokens, sampling fields beyond greedy).
Requests = dict[str, tuple[list[int], int, dict[str, float]]]


def seeded(i: int) -> dict[str, float]:
    return {"temperature": 0.8, "seed": 7001 + 31 * i}


def reference(requests: Requests) -> dict[str, tuple[list[int], str]]:
    """Every request run undisturbed in one engine in this process (a constrained one's
    `structured` is the name of its kind)."""
    tok = Tokenizer(DEMO)
    cfg = config()
    model = load_model(DEMO, "float32")
    grammars = for_tokenizer(tok, model.arch.vocab_size, tok.eos_token_ids)
    engine = Engine(model, tok, cfg.cache, cfg.scheduler, tok.eos_token_ids, grammars=grammars)
    for rid, (prompt, max_tokens, sampling) in requests.items():
        fields = {"temperature": 0.0, "ignore_eos": True, **sampling}
        if "structured" in fields:
            fields["structured"] = CONSTRAINTS[fields["structured"]]  # type: ignore[index]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **fields))  # type: ignore[arg-type]
    out: dict[str, tuple[list[int], str]] = {rid: ([], "") for rid in requests}
    while engine.has_unfinished:
        for o in engine.step():
            tokens, text = out[o.request_id]
            out[o.request_id] = (tokens + o.token_ids, text + o.text)
    return out


def run_with_a_kill(address: str, handle, victim: str, requests, kill_when) -> dict[str, tuple[list[int], str]]:  # type: ignore[no-untyped-def]
    results: dict[str, tuple[list[int], str]] = {}
    progress: dict[str, int] = {rid: 0 for rid in requests}
    errors: list[Exception] = []

    def one(rid: str, prompt: list[int], max_tokens: int, sampling: dict[str, float]) -> None:
        tokens, text = [], ""
        fields = {"temperature": 0, "ignore_eos": True, **sampling}
        if "structured" in fields:
            fields["structured"] = TYPED[fields["structured"]]  # type: ignore[index]
        try:
            with Client(address, timeout=300, retries=0) as client:
                for delta in client.stream(prompt, max_tokens=max_tokens, **fields):
                    tokens += delta.token_ids
                    text += delta.text
                    progress[rid] = len(tokens)
        except Exception as e:  # reported below: no request may fail
            errors.append(e)
        results[rid] = (tokens, text)

    threads = [threading.Thread(target=one, args=(rid, *req)) for rid, req in requests.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not kill_when(progress):
        assert time.monotonic() < deadline, "the load never got going"
        time.sleep(0.02)
    pid = ray.get(handle.actor(victim).pid.remote())
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    return results


def test_a_killed_decode_worker_loses_no_request(cluster):
    handle, router, address = cluster
    rng = random.Random(5)
    requests: Requests = {}
    for i in range(12):  # six greedy, six seeded sampled
        prompt = [rng.randrange(5, 2000) for _ in range(rng.choice([4, 30]))]
        requests[f"d{i}"] = (prompt, 256, {}) if i < 6 else (prompt, 160, seeded(i))
    before = router.telemetry.metrics.migrations.labels("decode")._value.get()
    results = run_with_a_kill(
        address, handle, "decode-0", requests, kill_when=lambda p: all(n >= 20 for n in p.values())
    )
    assert results == reference(requests)
    assert router.telemetry.metrics.migrations.labels("decode")._value.get() - before >= len(requests)


def test_a_killed_prefill_worker_loses_no_request(cluster):
    handle, router, address = cluster
    rng = random.Random(6)
    requests: Requests = {
        f"p{i}": ([rng.randrange(5, 2000) for _ in range(600)], 8, seeded(i) if i % 2 else {}) for i in range(12)
    }
    before = router.telemetry.metrics.migrations.labels("prefill")._value.get()
    results = run_with_a_kill(
        address, handle, "prefill-0", requests, kill_when=lambda p: sum(1 for n in p.values() if n) >= 2
    )
    assert results == reference(requests)
    assert router.telemetry.metrics.migrations.labels("prefill")._value.get() - before >= 1


def test_a_killed_decode_worker_loses_no_constrained_request(cluster):
    """Every constraint kind, prefilled locally and remotely, greedy and seeded: the requests the
    kill breaks move with the tokens they streamed, the matcher is replayed over them where they
    land, and every output validates and is the undisturbed one."""
    handle, router, address = cluster
    tok = Tokenizer(DEMO)
    requests: Requests = {}
    for p, prompt in enumerate(PROMPTS):
        for kind in KINDS:
            base = {"structured": kind, "ignore_eos": False}
            requests[f"{kind}-{p}-g"] = (tok.encode(prompt), 96, base)  # type: ignore[dict-item]
            requests[f"{kind}-{p}-s"] = (tok.encode(prompt), 96, {**base, **seeded(10 * p + len(kind))})  # type: ignore[dict-item]
    before = router.telemetry.metrics.migrations.labels("decode")._value.get()
    results = run_with_a_kill(
        address, handle, "decode-0", requests, kill_when=lambda p: sum(1 for n in p.values() if n >= 3) >= 4
    )
    assert results == reference(requests)
    for rid, (_, _, sampling) in requests.items():
        check(sampling["structured"], results[rid][1])  # type: ignore[arg-type]
    assert router.telemetry.metrics.migrations.labels("decode")._value.get() > before
