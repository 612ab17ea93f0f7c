"""The router's step streams (`router.service.links`): one `Worker.Steps` call per decode worker for
every request the router places there, a lagging request's entries merged into one message, and a
request that ends unfinished cancelled on its worker."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2

from router.service.links import OnWorker, in_intervals, merged
from router.service.stream import Broken
from tests.fake_workers import FakeFleet, FakeTokenizer, fake_token
from tests.test_router_async import make_router, run_streams, stream


@pytest.fixture
def fleet():
    fleet = FakeFleet()
    yield fleet
    fleet.close()


def entry(tokens: list[int], finish: int = 0) -> worker_pb2.WorkerTokens:
    logprobs = [api_pb2.TokenLogprob(token_id=t, logprob=-t / 10) for t in tokens]
    text = "".join(f"t{t} " for t in tokens)
    return worker_pb2.WorkerTokens(request_id="r", token_ids=tokens, logprobs=logprobs, text=text, finish_reason=finish)


def test_entries_merge_in_order_and_keep_the_last_finish():
    one = merged([entry([1]), entry([2, 3]), entry([4], api_pb2.FINISH_REASON_STOP)])
    assert list(one.token_ids) == [1, 2, 3, 4]
    assert [lp.token_id for lp in one.logprobs] == [1, 2, 3, 4]
    assert one.text == "t1 t2 t3 t4 " and one.finish_reason == api_pb2.FINISH_REASON_STOP
    assert merged([entry([7])]).token_ids == [7]


class Link:
    """What `OnWorker` asks of its link."""

    name = "decode-0"

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True


def test_a_request_reading_behind_gets_what_piled_up_as_one_message_then_its_failure():
    async def main() -> None:
        link = Link()
        on = OnWorker(link, "r", timeout=None)  # type: ignore[arg-type]
        for tokens in ([1], [2], [3]):
            on.put(entry(tokens))
        assert list((await anext(on)).token_ids) == [1, 2, 3], "one message for three steps"
        on.put(entry([4]))
        on.put(Broken(grpc.StatusCode.UNAVAILABLE, "gone", "decode", "decode-0"))
        on.put(entry([5]))  # nothing after a failure reaches the reader before it
        assert list((await anext(on)).token_ids) == [4]
        with pytest.raises(Broken, match="gone"):
            await anext(on)

    asyncio.run(main())


def test_a_request_past_its_deadline_is_cancelled_on_its_worker_and_fails_with_deadline_exceeded():
    async def main() -> None:
        link = Link()
        on = OnWorker(link, "r", timeout=0.05)  # type: ignore[arg-type]
        with pytest.raises(Broken) as failed:
            await anext(on)
        assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and not failed.value.migratable
        assert link.cancelled == ["r"]

    asyncio.run(main())


def test_every_request_of_a_router_on_a_worker_shares_one_step_stream(fleet):
    workers = [fleet.add(f"decode-{i}", step_s=0.001) for i in range(2)]
    router = make_router(fleet)
    address = router.start()
    try:
        results = run_streams(address, 40, 8)
        for i, messages in enumerate(results):
            assert not isinstance(messages, BaseException), messages
            prompt = FakeTokenizer().encode(f"w{i} x y")
            assert [t for m in messages for t in m.token_ids] == [fake_token(prompt, j) for j in range(8)]
        assert sum(w.submitted for w in workers) == 40
        assert [w.step_streams for w in workers] == [1 if w.submitted else 0 for w in workers]
    finally:
        router.stop()


def test_a_client_that_gives_up_has_its_request_cancelled_on_the_worker_and_others_run_on(fleet):
    worker = fleet.add("decode-0", step_s=0.01)
    router = make_router(fleet)
    address = router.start()

    async def main():  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(address) as channel:
            stub = api_pb2_grpc.TandemStub(channel)
            short = stream(stub, "w1 x", 200, timeout=0.3)
            whole = stream(stub, "w2 y", 40)
            return await asyncio.gather(short, whole, return_exceptions=True)

    try:
        short, whole = asyncio.run(main())
        assert isinstance(short, grpc.aio.AioRpcError) and short.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert len([t for m in whole for t in m.token_ids]) == 40
        deadline = time.monotonic() + 2
        while worker.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.running == 0 and worker.cancelled == 1, "the given-up request was cancelled there"
    finally:
        router.stop()


async def listed(items):  # type: ignore[no-untyped-def]
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def test_stream_interval_sends_the_first_token_alone_then_that_many_a_message():
    async def main():  # type: ignore[no-untyped-def]
        steps = [entry([t]) for t in range(1, 10)] + [entry([10], api_pb2.FINISH_REASON_LENGTH)]
        return [list(m.token_ids) async for m in in_intervals(listed(steps), 4)]

    assert asyncio.run(main()) == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]


def test_stream_interval_sends_what_it_held_before_a_failure():
    async def main():  # type: ignore[no-untyped-def]
        broken = Broken(grpc.StatusCode.UNAVAILABLE, "gone", "decode", "decode-0")
        got = []
        with pytest.raises(Broken):
            async for m in in_intervals(listed([entry([1]), entry([2]), entry([3]), broken]), 4):
                got.append(list(m.token_ids))
        return got

    assert asyncio.run(main()) == [[1], [2, 3]]


def test_a_router_with_a_stream_interval_sends_fewer_messages_with_the_same_tokens(fleet):
    fleet.add("decode-0", step_s=0.001)
    router = make_router(fleet)
    router.settings = router.dispatcher.settings = dataclasses.replace(router.settings, stream_interval=4)
    address = router.start()
    try:
        [messages] = run_streams(address, 1, 17, channels=1)
        prompt = FakeTokenizer().encode("w0 x y")
        assert [t for m in messages for t in m.token_ids] == [fake_token(prompt, i) for i in range(17)]
        sizes = [len(m.token_ids) for m in messages]  # [1, 4, 4, 4, 4], unless a frame came late with two
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 5, sizes
        assert messages[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH and messages[-1].usage.completion_tokens == 17
    finally:
        router.stop()


def test_a_client_that_reads_nothing_holds_up_no_other_stream_on_its_worker_and_then_gets_the_rest_merged(fleet):
    """Two requests on one worker share the router's step stream. The client of one reads nothing (its
    HTTP/2 window fills, so the router's writes to it wait): the other runs to its end meanwhile, and
    the first, read at last, gets every token, what piled up merged into fewer messages than steps."""
    fleet.add("decode-0", step_s=0.0)
    router = make_router(fleet)
    address = router.start()

    async def main():  # type: ignore[no-untyped-def]
        no_window_growth = [("grpc.http2.bdp_probe", 0)]
        async with (
            grpc.aio.insecure_channel(address, options=no_window_growth) as held_channel,
            grpc.aio.insecure_channel(address) as channel,
        ):
            sampling = api_pb2.SamplingParams(max_tokens=4000, temperature=0)
            held = api_pb2_grpc.TandemStub(held_channel).Generate(
                api_pb2.GenerateRequest(text="w1 x", sampling=sampling, request_id="held")
            )
            await held.initial_metadata()  # placed: its tokens are coming
            other = await stream(api_pb2_grpc.TandemStub(channel), "w2 y", 300)
            return other, [m async for m in held]

    try:
        other, held = asyncio.run(main())
        assert len([t for m in other for t in m.token_ids]) == 300, "the other stream ran to its end"
        tokens = [t for m in held for t in m.token_ids]
        assert tokens == [fake_token(FakeTokenizer().encode("w1 x"), i) for i in range(4000)]
        assert len(held) < 4000, "what piled up while its client read nothing came merged"
    finally:
        router.stop()


def test_a_worker_that_goes_leaves_no_step_stream_behind(fleet):
    fleet.add("decode-0", step_s=0.001)
    router = make_router(fleet)
    address = router.start()
    try:
        [messages] = run_streams(address, 1, 4, channels=1)
        assert not isinstance(messages, BaseException), messages
        assert "decode-0" in router.dispatcher.links
        fleet.remove("decode-0")  # its server stops: the stream ends
        deadline = time.monotonic() + 5
        while "decode-0" in router.dispatcher.links and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "decode-0" not in router.dispatcher.links
    finally:
        router.stop()
