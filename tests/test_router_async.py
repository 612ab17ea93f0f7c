"""The async router over fake workers (no model, real gRPC): relayed messages, the admission bound,
and a thousand concurrent streams on a bounded number of threads."""

from __future__ import annotations

import asyncio
import resource
import time
from pathlib import Path

import grpc
import pytest
from tandem.v1 import api_pb2, api_pb2_grpc

from cluster.config import TelemetryConfig
from cluster.telemetry import Telemetry
from router.placement.discovery import WorkerDiscovery
from router.service.server import Router
from router.service.settings import RouterSettings
from router.service.validate import Limits
from tests.fake_workers import VOCAB, FakeFleet, FakeTokenizer, fake_token


def make_router(fleet: FakeFleet, max_queued: int = 2048) -> Router:
    settings = RouterSettings(
        model_name="fake", architecture="fake", limits=Limits(4096, VOCAB), block_size=16, eos_token_ids=(),
        has_chat_template=False, dtype="none", max_queued_requests=max_queued,
    )  # fmt: skip
    return Router(
        settings, FakeTokenizer(), WorkerDiscovery(fleet.addresses), Telemetry(TelemetryConfig(), "test-router")
    )


@pytest.fixture
def fleet():
    fleet = FakeFleet()
    yield fleet
    fleet.close()


def threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


async def stream(stub, text: str, max_tokens: int, timeout: float | None = None) -> list[api_pb2.GenerateResponse]:  # type: ignore[no-untyped-def]
    sampling = api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)
    request = api_pb2.GenerateRequest(text=text, sampling=sampling, request_id="r")
    return [m async for m in stub.Generate(request, timeout=timeout)]


def run_streams(address: str, n: int, max_tokens: int, channels: int = 8):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
        try:
            stubs = [api_pb2_grpc.TandemStub(c) for c in chans]
            calls = [stream(stubs[i % channels], f"w{i} x y", max_tokens) for i in range(n)]
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            for c in chans:
                await c.close()

    return asyncio.run(main())


def test_relayed_messages_carry_the_workers_tokens_and_what_the_router_adds(fleet):
    fleet.add("decode-0", step_s=0.001)
    router = make_router(fleet)
    address = router.start()
    try:
        [messages] = run_streams(address, 1, 5, channels=1)
        prompt = FakeTokenizer().encode("w0 x y")
        assert [t for m in messages for t in m.token_ids] == [fake_token(prompt, i) for i in range(5)]
        assert "".join(m.text for m in messages) == FakeTokenizer().decode([fake_token(prompt, i) for i in range(5)])
        assert {m.request_id for m in messages} == {"r"}, "the client's id, not the worker's"
        assert messages[0].prompt_tokens == 3
        assert messages[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH
        assert messages[-1].usage.completion_tokens == 5 and messages[-1].usage.prompt_tokens == 3
        assert messages[-1].HasField("slo")
        assert router.decisions["prefill=local:short-prompt"] == 1
    finally:
        router.stop()


def test_the_admission_bound_refuses_before_the_stream_and_the_rest_complete(fleet):
    fleet.add("decode-0", step_s=0.02)
    router = make_router(fleet, max_queued=10)
    address = router.start()
    try:
        results = run_streams(address, 40, 10)
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        done = [r for r in results if not isinstance(r, BaseException)]
        assert refused and {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert len(done) >= 10 and all(sum(len(m.token_ids) for m in r) == 10 for r in done)
        assert len(refused) + len(done) == 40
        assert router.in_flight == 0
    finally:
        router.stop()


def test_1000_concurrent_streams_through_one_router_on_bounded_threads(fleet):
    for i in range(16):
        fleet.add(f"decode-{i}", step_s=0.05)
    router = make_router(fleet)
    address = router.start()
    before = threads()
    peak = [before]

    async def watch_threads(stop: asyncio.Event) -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], threads())
            await asyncio.sleep(0.05)

    async def main():  # type: ignore[no-untyped-def]
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_threads(stop))
        chans = [grpc.aio.insecure_channel(address) for _ in range(8)]
        stubs = [api_pb2_grpc.TandemStub(c) for c in chans]
        try:
            return await asyncio.gather(*(stream(stubs[i % 8], f"w{i} x", 8) for i in range(1000)))
        finally:
            stop.set()
            await watcher
            for c in chans:
                await c.close()

    try:
        results = asyncio.run(main())
        # Every stream gets its 8 tokens; one that reads behind gets some of them merged into one message.
        tokens = [sum(len(m.token_ids) for m in r) for r in results]
        assert len(results) == 1000 and all(n == 8 for n in tokens)
        assert all(r[-1].usage.completion_tokens == 8 for r in results)
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"\n1000 streams: threads {before} -> peak {peak[0]}; peak RSS of the test process {rss_mib:.0f} MiB")
        assert peak[0] - before < 32, "a thread per stream would add a thousand"
        assert router.in_flight == 0
    finally:
        router.stop()


@pytest.mark.parametrize("watch_breaks", [True, False], ids=["watch-breaks", "watch-beats-on"])
@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_a_worker_that_fails_mid_request_is_migrated_and_the_output_is_unchanged(fleet, where, watch_breaks):
    """A failed call sets its worker aside, so the move goes elsewhere even before the worker's
    Watch stream breaks (or when it never does)."""
    broken = fleet.add(f"{where}-0", role=where, step_s=0.002)
    fleet.add(f"{where}-1", role=where, step_s=0.002)
    if where == "prefill":
        fleet.add("decode-0", step_s=0.002)
    broken.fail_after = 0 if where == "prefill" else 3
    broken.watch_survives = not watch_breaks
    router = make_router(fleet)
    address = router.start()
    try:
        # Past local_prefill_max_tokens: prefilled remotely, on both prefill workers by their prefixes.
        texts = [" ".join(f"w{i}" for i in range(k, k + 80)) for k in range(8)]
        results = asyncio.run(_streams_of(address, texts, 10))
        for text, messages in zip(texts, results, strict=True):
            assert not isinstance(messages, BaseException), messages
            prompt = FakeTokenizer().encode(text)
            assert [t for m in messages for t in m.token_ids] == [fake_token(prompt, i) for i in range(10)]
        assert router.telemetry.metrics.migrations.labels(where)._value.get() >= 1
    finally:
        router.stop()


def test_a_worker_that_leaves_discovery_mid_stream_has_its_requests_moved(fleet):
    """Discovery drops a worker while it streams: the router closes its channel, which cancels the
    calls beneath their tasks. Each request moves to the other worker and ends as undisturbed."""
    leaving = fleet.add("decode-0", step_s=0.01)
    fleet.add("decode-1", step_s=0.01)
    router = make_router(fleet)
    address = router.start()
    try:
        texts = [f"w{i} x y" for i in range(8)]
        pending = asyncio.run_coroutine_threadsafe(_streams_of(address, texts, 150, timeout=60), fleet.loop)
        while leaving.running < 2:
            time.sleep(0.01)
        time.sleep(0.2)  # some tokens out
        del fleet.workers["decode-0"]  # out of discovery; the worker itself streams on
        router.view.pool.rediscover()
        for text, messages in zip(texts, pending.result(90), strict=True):
            assert not isinstance(messages, BaseException), messages
            prompt = FakeTokenizer().encode(text)
            assert [t for m in messages for t in m.token_ids] == [fake_token(prompt, i) for i in range(150)]
        assert router.telemetry.metrics.migrations.labels("decode")._value.get() >= 2
    finally:
        router.stop()
        fleet.call(leaving.stop())


def test_a_worker_that_fails_after_the_last_token_ends_the_request_without_moving_it(fleet):
    """All max_tokens streamed, the finish lost with the worker: the router ends the stream with
    "length" itself (a move would ask a worker for no tokens at all)."""
    broken = fleet.add("decode-0", step_s=0.002)
    broken.finish_apart, broken.fail_after = True, 6
    router = make_router(fleet)
    address = router.start()
    try:
        messages = _one_whole_stream(address, "w1 x y", 6)
        assert messages[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH
        assert messages[-1].usage.completion_tokens == 6
        assert router.telemetry.metrics.migrations.labels("decode")._value.get() == 1
        assert broken.submitted == 1, "nothing was left to ask a worker for"
    finally:
        router.stop()


def test_a_worker_that_fails_after_its_last_message_leaves_the_request_complete(fleet):
    """The call breaks once the finish is out: the client has everything, nothing moves, and no
    worker is asked for more (a move would add a token past the end)."""
    broken = fleet.add("decode-0", step_s=0.002)
    fleet.add("decode-1", step_s=0.002)
    broken.fail_after = 6
    router = make_router(fleet)
    address = router.start()
    try:
        messages = _one_whole_stream(address, "w1 x y", 6)
        assert [m.finish_reason for m in messages].count(api_pb2.FINISH_REASON_LENGTH) == 1
        assert router.telemetry.metrics.migrations.labels("decode")._value.get() == 0
        assert broken.submitted == 1 and sum(w.submitted for w in fleet.workers.values()) == 1
    finally:
        router.stop()


def _one_whole_stream(address: str, text: str, max_tokens: int) -> list[api_pb2.GenerateResponse]:
    """One request's messages, checked to carry exactly its `max_tokens` tokens in order."""
    [messages] = asyncio.run(_streams_of(address, [text], max_tokens))
    assert not isinstance(messages, BaseException), messages
    prompt = FakeTokenizer().encode(text)
    assert [t for m in messages for t in m.token_ids] == [fake_token(prompt, i) for i in range(max_tokens)]
    return messages


async def _streams_of(address: str, texts: list[str], max_tokens: int, timeout: float | None = None):  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_pb2_grpc.TandemStub(channel)
        calls = (stream(stub, t, max_tokens, timeout) for t in texts)
        return await asyncio.gather(*calls, return_exceptions=True)
