"""Disaggregated equals colocated: prompts prefilled on one engine, their KV shipped over each
transport, then decoded on another engine give exactly the single-process engine's greedy tokens.
The collective transport is also run between two real processes over Gloo."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import CacheConfig, SchedulerConfig, TransferConfig
from cluster.engine.request import SamplingParams
from cluster.kv.collective import CollectiveGroups
from cluster.kv.grpc_transport import GrpcSender, serve
from cluster.kv.transport import LocalSender, TransferState
from cluster.kv.wire import model_fingerprint
from cluster.model.loader import load_model
from decode_worker.engine import Engine
from decode_worker.kv_intake import KVIntake
from prefill_worker.engine import PrefillEngine
from tests.kv_senders import kv_sender

ROOT = Path(__file__).resolve().parents[1]
CACHE = CacheConfig(block_size=4, num_blocks=200, watermark=0.0)
DECODE = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=96, long_prefill_chunk=24)
PREFILL = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=32)  # prompts over 32 tokens go in chunks


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def workload(n: int = 8, seed: int = 3) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        prompt = [rng.randrange(3, 320) for _ in range(rng.choice([1, 5, 17, 33, 70]))]
        out[f"q{i}"] = (prompt, SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0))
    return out


def decode_all(engine: Engine, ids) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        engine.scheduler.blocks.check_integrity()
    return tokens


@pytest.fixture(scope="module")
def model(hf_models):
    return load_model(hf_models["llama"][0], "float32")


@pytest.fixture(scope="module")
def colocated(model) -> dict[str, list[int]]:
    engine = Engine(model, NoText(), CACHE, DECODE)
    requests = workload()
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return decode_all(engine, requests)


def decode_side(model):
    engine = Engine(model, NoText(), CACHE, DECODE)
    intake = KVIntake(engine, model_fingerprint(model, model.arch), timeout_s=30)
    return engine, intake


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "after-pass"])
@pytest.mark.parametrize("transport", ["local", "grpc", "collective"])
def test_disaggregated_equals_colocated(model, colocated, transport, layerwise):
    engine, intake = decode_side(model)
    with kv_sender(transport, intake) as sender:
        transfer = TransferConfig(layerwise=layerwise, layers_per_chunk=1 if layerwise else 2)
        prefill = PrefillEngine(model, CACHE, PREFILL, transfer, num_blocks=CACHE.num_blocks)
        requests = workload()
        for rid, (prompt, params) in requests.items():
            prefill.add_request(rid, prompt, params, sender)
        first, streams = {}, {}
        steps = 0
        while prefill.scheduler.has_work:
            for out in prefill.step():
                first[out.request_id], streams[out.request_id] = out.first_token, out.transfer
            steps += 1
        assert steps > 2, "the token budget should split the workload over several passes"
        for rid in requests:
            assert streams[rid].wait(30) is TransferState.DONE, streams[rid].error
        prefill.poll_leases()
        assert not prefill.has_unfinished
        assert prefill.scheduler.blocks.num_free_blocks == CACHE.num_blocks
        disaggregated = decode_all(engine, requests)
        for rid in requests:
            assert disaggregated[rid][0] == first[rid]
            assert disaggregated[rid] == colocated[rid], rid
        assert engine.scheduler.blocks.num_free_blocks == CACHE.num_blocks


def test_collective_between_two_processes_over_gloo(model, colocated, hf_models):
    engine, intake = decode_side(model)
    groups = CollectiveGroups("cpu", timeout_s=20)
    server, port = serve(intake, groups=groups)
    requests = workload()
    spec = {rid: [prompt, params.max_tokens] for rid, (prompt, params) in requests.items()}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        peer = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "kv_peer.py"), str(hf_models["llama"][0]), f"127.0.0.1:{port}"],
            input=json.dumps(spec), capture_output=True, text=True, timeout=240, env=env,
        )  # fmt: skip
        assert peer.returncode == 0, peer.stderr
        first = json.loads(peer.stdout)
        deadline = time.monotonic() + 10
        while len(engine._pending) < len(requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        disaggregated = decode_all(engine, requests)
        for rid in requests:
            assert first[rid] == disaggregated[rid][0]
            assert disaggregated[rid] == colocated[rid], rid
        assert len(groups) == 1, "one group for the pair, reused by every transfer"
    finally:
        server.stop(None)
        groups.close()


def test_prefix_cache_computes_only_the_uncached_suffix(model):
    rng = random.Random(7)
    shared = [rng.randrange(3, 320) for _ in range(48)]
    a = shared + [rng.randrange(3, 320) for _ in range(5)]
    b = shared + [rng.randrange(3, 320) for _ in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0)

    reference = Engine(model, NoText(), CACHE, DECODE)
    reference.add_request("b", b, params)
    expected = decode_all(reference, ["b"])["b"]

    engine, intake = decode_side(model)
    prefill = PrefillEngine(model, CACHE, PREFILL, TransferConfig(), num_blocks=CACHE.num_blocks)
    sender = LocalSender(intake)
    prefill.add_request("a", a, params, sender)
    outs = []
    while prefill.scheduler.has_work:
        outs += prefill.step()
    assert outs[0].transfer.wait(10) is TransferState.DONE
    prefill.poll_leases()
    assert engine.abort("a")  # only b is decoded below; a's decode blocks go back
    before = prefill.stats().computed_tokens

    prefill.add_request("b", b, params, sender)
    outs = []
    while prefill.scheduler.has_work:
        outs += prefill.step()
    (out,) = outs
    assert out.num_cached_tokens == 48
    assert prefill.stats().computed_tokens - before == len(b) - 48
    assert prefill.stats().prefix_hit_rate > 0
    assert out.transfer.wait(10) is TransferState.DONE
    assert decode_all(engine, ["a", "b"])["b"] == expected


def test_lease_expiry_releases_blocks_when_the_decode_worker_vanishes(model):
    now = [0.0]

    class Silent:  # a decode worker that never answers
        def open(self, header):
            from cluster.kv.transport import SendStream

            class Hang(SendStream):
                def _run(self):
                    for _ in self._messages():
                        pass
                    time.sleep(3600)

            return Hang(header)

    prefill = PrefillEngine(
        model, CACHE, PREFILL, TransferConfig(lease_s=5), num_blocks=CACHE.num_blocks, clock=lambda: now[0]
    )
    prefill.add_request("x", [5] * 20, SamplingParams(max_tokens=3), Silent())
    while prefill.scheduler.has_work:
        prefill.step()
    assert prefill.scheduler.blocks.num_free_blocks < CACHE.num_blocks
    now[0] = 4.0
    assert prefill.poll_leases() == 0
    now[0] = 5.5
    assert prefill.poll_leases() == 1
    assert prefill.scheduler.blocks.num_free_blocks == CACHE.num_blocks
    prefill.scheduler.blocks.check_integrity()


def seeded_workload(n: int = 8, seed: int = 4) -> dict[str, tuple[list[int], SamplingParams]]:
    """Sampled requests, each with its own seed; half with penalties and min_tokens, which count
    the output a moved request brings along."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        prompt = [rng.randrange(3, 320) for _ in range(rng.choice([1, 5, 17, 33, 70]))]
        extra = dict(frequency_penalty=0.7, presence_penalty=0.3, min_tokens=6) if i % 2 else {}
        params = SamplingParams(max_tokens=rng.randint(6, 14), temperature=0.8, top_p=0.95, seed=100 + i, **extra)
        out[f"s{i}"] = (prompt, params)
    return out


def prefill_remotely(model, requests, sender, outputs=None) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Prefills every request on a prefill engine (with `outputs[rid]` as output already generated)
    and ships its KV through `sender`: each request's first token."""
    prefill = PrefillEngine(model, CACHE, PREFILL, TransferConfig(), num_blocks=CACHE.num_blocks)
    for rid, (prompt, params) in requests.items():
        prefill.add_request(rid, prompt, params, sender, output_token_ids=(outputs or {}).get(rid, ()))
    first, streams = {}, {}
    while prefill.scheduler.has_work:
        for out in prefill.step():
            first[out.request_id], streams[out.request_id] = out.first_token, out.transfer
    for rid in requests:
        assert streams[rid].wait(30) is TransferState.DONE, streams[rid].error
    return first


def test_seeded_sampling_is_the_same_prefilled_remotely_or_locally(model):
    """A seeded request's first token sampled on the prefill worker and the rest on the decode
    worker give the tokens of one engine doing both."""
    requests = seeded_workload()
    local = Engine(model, NoText(), CACHE, DECODE, seed=1)
    for rid, (prompt, params) in requests.items():
        local.add_request(rid, prompt, params)
    expected = decode_all(local, requests)
    engine, intake = decode_side(model)
    first = prefill_remotely(model, requests, LocalSender(intake))
    remote = decode_all(engine, requests)
    assert {rid: tokens[0] for rid, tokens in remote.items()} == first
    assert remote == expected
    assert len({tuple(t) for t in expected.values()}) == len(requests)


@pytest.mark.parametrize("prefill", ["local", "remote"])
def test_a_seeded_request_moved_with_its_output_continues_as_if_undisturbed(model, prefill):
    """What the router sends after a worker dies: the prompt and, as output, the tokens already
    streamed. Prefilled again on the decode worker or on a prefill worker (the KV header carrying
    the output's count over gRPC), the rest equals the undisturbed run's tail, penalties and
    min_tokens included."""
    requests = seeded_workload()
    whole = Engine(model, NoText(), CACHE, DECODE)
    for rid, (prompt, params) in requests.items():
        whole.add_request(rid, prompt, params)
    expected = decode_all(whole, requests)
    carried = {rid: tokens[: len(tokens) // 2] for rid, tokens in expected.items()}
    engine, intake = decode_side(model)
    if prefill == "local":
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params, output_token_ids=carried[rid])
    else:
        server, port = serve(intake)
        try:
            prefill_remotely(model, requests, GrpcSender(f"127.0.0.1:{port}"), carried)
        finally:
            server.stop(None)
    rest = decode_all(engine, requests)
    assert {rid: carried[rid] + rest[rid] for rid in requests} == expected
    assert engine.scheduler.blocks.num_free_blocks == CACHE.num_blocks
