"""The prefill engine in a process of its own (`scheduler.engine_core: process`) serves what the
engine on the worker's thread serves.

Real workers of the demo model in this process (no Ray), every prompt prefilled remotely over
`grpc`: one decode worker, a prefill worker whose engine runs in a core process and one whose
engine runs on its thread, each behind a router of its own. Outputs are equal, greedy and seeded;
the core's errors, its transfers' failures and its death reach the front; no block stays held."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

from cluster.config import parse_config
from cluster.engine.block_names import chain
from cluster.engine.request import SamplingParams
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from prefill_worker.core import ProcessCore, ThreadCore
from router.sdk.client import Client
from router.service.server import from_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
PROMPTS = [f"def f{i}(x):\n    return" + " x +" * i for i in range(6)]

pytestmark = pytest.mark.slow


def config(engine_core: str):
    return parse_config({
        "model": {"path": str(DEMO), "dtype": "float32"},
        "scheduler": {"engine_core": engine_core},
        "cache": {"block_size": 16, "num_blocks": 128},
        "transfer": {"transport": "grpc", "timeout_s": 20, "lease_s": 20},
        "router": {"local_prefill_max_tokens": 0, "migration_limit": 3},
    })  # fmt: skip


def wait_until(condition, what: str, timeout_s: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture(scope="module")
def cluster():
    decode = decode_service.from_config(config("thread"), "decode-0")
    prefills = {core: prefill_service.from_config(config(core), f"prefill-{core}") for core in ("process", "thread")}
    decode_address = decode.start()
    addresses = {core: worker.start() for core, worker in prefills.items()}
    fleets = {core: {"decode-0": decode_address, f"prefill-{core}": addresses[core]} for core in prefills}
    routers = {core: from_config(config(core), lambda core=core: fleets[core]) for core in prefills}
    router_addresses = {core: router.start() for core, router in routers.items()}
    yield prefills, addresses, router_addresses, decode_address
    for router in routers.values():
        router.stop()
    for worker in prefills.values():
        worker.stop()
    decode.stop()


def generate_all(address: str, **sampling) -> list[tuple[list[int], str, list[tuple[int, float]]]]:  # type: ignore[no-untyped-def]
    """Each prompt's tokens, text and prompt logprobs (one per prompt token after the first, when
    asked for: scored where the prompt was prefilled, in the core process or on the worker's
    thread), run concurrently."""
    results: dict[int, tuple[list[int], str, list[tuple[int, float]]]] = {}
    with Client(address, timeout=60) as client:

        def run(i: int) -> None:
            out = client.generate(PROMPTS[i], max_tokens=16, **sampling)
            scored = [(lp.token_id, lp.logprob) for lp in out.prompt_logprobs]
            assert len(scored) == (out.prompt_tokens - 1 if "prompt_logprobs" in sampling else 0)
            results[i] = (out.token_ids, out.text, scored)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return [results[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}, {"temperature": 0.0, "prompt_logprobs": 1}],
    ids=["greedy", "seeded", "prompt logprobs"],
)
def test_the_core_process_serves_what_the_engine_on_the_workers_thread_serves(cluster, sampling):
    prefills, _, routers, _ = cluster
    assert isinstance(prefills["process"].engine, ProcessCore) and isinstance(prefills["thread"].engine, ThreadCore)
    results = {core: generate_all(address, **sampling) for core, address in routers.items()}
    for process, thread in zip(results["process"], results["thread"], strict=True):
        assert process[:2] == thread[:2]
        assert [t for t, _ in process[2]] == [t for t, _ in thread[2]]
        assert [lp for _, lp in process[2]] == pytest.approx([lp for _, lp in thread[2]], abs=1e-4)
    assert all(tokens for tokens, _, _ in results["process"])
    core = prefills["process"].engine
    wait_until(lambda: not core.stats().leased, "each transfer's answer releases its blocks in the core")
    stats = core.stats()
    assert stats.free_blocks == stats.total_blocks and stats.computed_tokens > 0


def submit(address: str, rid: str, prompt: list[int], decode_target: str, max_tokens: int = 8):  # type: ignore[no-untyped-def]
    """A prefill worker's Submit: its messages, then the status it ended with."""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.WorkerRequest(
            request_id=rid, prompt_token_ids=prompt, decode_target=decode_target,
            sampling=api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )  # fmt: skip
        messages = []
        try:
            for message in stub.Submit(request, timeout=60):
                messages.append(message)
        except grpc.RpcError as e:
            return messages, e.code(), e.details()
        return messages, grpc.StatusCode.OK, ""


def test_the_cores_refusals_reach_the_caller_by_name(cluster):
    prefills, addresses, _, decode = cluster
    messages, code, details = submit(addresses["process"], "bad", [5, 10**6, 7], decode)
    assert (messages, code) == ([], grpc.StatusCode.INVALID_ARGUMENT) and "token ids must be in" in details
    core = prefills["process"].engine
    with pytest.raises(ValueError, match="reach max_tokens"):
        core.add_request("done", [1, 2, 3], SamplingParams(max_tokens=2), decode, b"", [9, 9])
    assert core.abort("never-here") is False
    messages, code, _ = submit(addresses["process"], "after", list(range(10, 40)), decode)
    assert code == grpc.StatusCode.OK and len(messages) == 1, "the worker goes on serving"


def test_a_transfer_that_fails_in_the_core_fails_its_call_and_frees_its_blocks(cluster):
    """The core ships to a decode worker that is not there: the first token still comes (it streams
    before the KV lands), then the call ends with the transfer's own status, and the lease ends."""
    prefills, addresses, _, _ = cluster
    prompt = list(range(10, 60))
    messages, code, details = submit(addresses["process"], "nowhere", prompt, "127.0.0.1:1")
    assert len(messages) == 1 and len(messages[0].token_ids) == 1 and messages[0].num_prompt_tokens == 50
    assert code == grpc.StatusCode.UNAVAILABLE and "KV transfer to 127.0.0.1:1" in details
    core = prefills["process"].engine
    wait_until(lambda: core.stats().free_blocks == core.stats().total_blocks, "the failed transfer's blocks are freed")
    # Watch's mirror of the core's prefix cache (fed by the frames) holds the prompt's full blocks
    assert set(chain(prompt, 16, core.kv_journal.root)) <= core.kv_journal.held()


def test_a_prefill_core_that_dies_takes_its_worker_out_and_the_cluster_serves_on():
    expected = generate_alone()
    victim = prefill_service.from_config(config("process"), "prefill-victim")
    other = prefill_service.from_config(config("thread"), "prefill-other")
    decode = decode_service.from_config(config("thread"), "decode-0")
    fatal = threading.Event()
    victim.on_fatal = fatal.set
    workers = {"decode-0": decode.start(), "prefill-victim": victim.start(), "prefill-other": other.start()}
    router = from_config(config("thread"), lambda: workers)
    address = router.start()
    try:
        os.kill(victim.engine.process.pid, signal.SIGKILL)
        assert fatal.wait(10), "the worker calls its on_fatal when its core dies"
        assert victim.load().draining
        messages, code, _ = submit(workers["prefill-victim"], "late", list(range(10, 40)), workers["decode-0"])
        assert (messages, code) == ([], grpc.StatusCode.UNAVAILABLE)
        assert generate_all(address, temperature=0.0) == expected
    finally:
        router.stop()
        for worker in (victim, other, decode):
            worker.stop()


def generate_alone() -> list[tuple[list[int], str]]:
    """The greedy outputs of a cluster with one prefill worker on its thread."""
    prefill = prefill_service.from_config(config("thread"), "prefill-0")
    decode = decode_service.from_config(config("thread"), "decode-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = from_config(config("thread"), lambda: workers)
    try:
        return generate_all(router.start(), temperature=0.0)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
