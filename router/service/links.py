"""The router's step streams: one `Worker.Steps` call per decode worker, shared by every request this
router places there. The worker sends one frame per engine step for all of them; the router parses
each frame once and hands each request its entry.

Lifecycle of a link:

    open      the first request for a worker opens its step stream on the worker's channel (the view's)
    submit    a request goes up as a `StepCommand`, with its trace context; it is now `OnWorker`
    frames    each entry goes to its request's queue; a request reading behind the worker gets what
              piled up merged into one message, never a backlog; its last entry (a finish reason) ends it
    interval  with `router.stream_interval` above 1, `in_intervals` holds a request's tokens after its
              first until that many have come, so a client message carries several steps
    ended     a `RequestEnded` fails that request alone with the worker's code (refused at submit, failed
              since), as a failed Submit call would
    cancel    an attempt that ends unfinished (the client left, its deadline passed, its prefill failed)
              sends a cancel: the worker aborts the request and frees its blocks
    broken    the stream failed or ended (the worker died, stopped or left the view): every request on it
              fails with UNAVAILABLE, and the worker's next request opens a new stream
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from tandem.v1 import worker_pb2

from router.placement.view import WorkerView
from router.service.stream import Broken

STEPS = "/tandem.v1.Worker/Steps"
CODES = {code.value[0]: code for code in grpc.StatusCode}


def merged(messages: Sequence[worker_pb2.WorkerTokens]) -> worker_pb2.WorkerTokens:
    """Consecutive messages of one request as one: tokens, logprobs and text in order, the last's finish."""
    if len(messages) == 1:
        return messages[0]
    out = worker_pb2.WorkerTokens()
    for message in messages:
        out.MergeFrom(message)  # repeated fields extend, set scalars and messages overwrite
    out.text = "".join(message.text for message in messages)
    return out


async def in_intervals(
    messages: AsyncIterator[worker_pb2.WorkerTokens], interval: int
) -> AsyncIterator[worker_pb2.WorkerTokens]:
    """`messages` with each held until `interval` tokens have come (or its request finished), then
    sent as one; the first goes at once. What is held when the stream fails goes out before the failure."""
    held: list[worker_pb2.WorkerTokens] = []
    count, first = 0, True
    try:
        async for message in messages:
            held.append(message)
            count += len(message.token_ids)
            if first or count >= interval or message.finish_reason:
                yield merged(held)
                held, count, first = [], 0, False
    except Broken:
        if held:  # the client has them before the request moves
            yield merged(held)
        raise
    if held:
        yield merged(held)


class OnWorker:
    """One request placed on a worker through its step stream: its messages, as an async iterator of
    `WorkerTokens` that raises `Broken` when the request failed there."""

    def __init__(self, link: StepLink, request_id: str, timeout: float | None) -> None:
        self.link, self.request_id = link, request_id
        self._pending: collections.deque[worker_pb2.WorkerTokens | Broken] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._finished = False
        loop = asyncio.get_running_loop()
        self._deadline = None if timeout is None else loop.call_later(timeout, self._expired)

    def put(self, item: worker_pb2.WorkerTokens | Broken) -> None:
        self._pending.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> None:
        """The attempt is over: if the request still runs on the worker, it is cancelled there, and a
        reader still waiting hears it as a cancelled call."""
        if self._deadline is not None:
            self._deadline.cancel()
        if self.link.cancel(self.request_id):
            self.put(Broken(grpc.StatusCode.CANCELLED, "the call was cancelled", "decode", self.link.name))

    def __aiter__(self) -> OnWorker:
        return self

    async def __anext__(self) -> worker_pb2.WorkerTokens:
        while not self._pending:
            if self._finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        messages = []
        while self._pending and not isinstance(self._pending[0], Broken):
            messages.append(self._pending.popleft())
        if not messages:
            raise self._pending.popleft()
        message = merged(messages)
        if message.finish_reason:
            self._finished = True
            if self._deadline is not None:
                self._deadline.cancel()
        return message

    def _expired(self) -> None:
        if self.link.cancel(self.request_id):
            self.put(Broken(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "decode", self.link.name))


class StepLink:
    """This router's step stream to one decode worker (on the router's event loop)."""

    def __init__(
        self, name: str, address: str, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]],
        on_broken: Callable[[StepLink], None] = lambda link: None,
    ) -> None:  # fmt: skip
        self.name, self.address, self.channel = name, address, channel
        self._on_broken = on_broken  # told once the stream has failed or ended
        self.broken: Broken | None = None
        self._requests: dict[str, OnWorker] = {}
        self._commands: asyncio.Queue[worker_pb2.StepCommand | None] = asyncio.Queue()
        steps = channel.stream_stream(
            STEPS, request_serializer=worker_pb2.StepCommand.SerializeToString,
            response_deserializer=worker_pb2.StepFrame.FromString,
        )  # fmt: skip
        self._call = steps(self._outgoing(), metadata=tuple(metadata))
        self._reader = asyncio.create_task(self._read())

    def submit(self, request: worker_pb2.WorkerRequest, trace: dict[str, str], timeout: float | None) -> OnWorker:
        placed = self._requests[request.request_id] = OnWorker(self, request.request_id, timeout)
        self._commands.put_nowait(worker_pb2.StepCommand(submit=request, trace=trace))
        return placed

    def cancel(self, request_id: str) -> bool:
        """Cancels `request_id` on the worker if it still runs there; says whether it did."""
        if self._requests.pop(request_id, None) is None:
            return False
        if self.broken is None:
            self._commands.put_nowait(worker_pb2.StepCommand(cancel=request_id))
        return True

    def close(self) -> None:
        self._commands.put_nowait(None)
        self._call.cancel()

    async def _outgoing(self):  # type: ignore[no-untyped-def]
        while (command := await self._commands.get()) is not None:
            yield command

    async def _read(self) -> None:
        try:
            async for frame in self._call:
                for message in frame.tokens:
                    placed = self._requests.get(message.request_id)
                    if placed is not None:
                        if message.finish_reason:
                            del self._requests[message.request_id]
                        placed.put(message)
                for ended in frame.ended:
                    if (placed := self._requests.pop(ended.request_id, None)) is not None:
                        code = CODES.get(ended.code, grpc.StatusCode.UNKNOWN)
                        placed.put(Broken(code, ended.details, "decode", self.name))
            broken = Broken(grpc.StatusCode.UNAVAILABLE, f"{self.name} ended its step stream", "decode", self.name)
        except grpc.RpcError as e:
            broken = Broken(e.code(), e.details() or "", "decode", self.name)
        except asyncio.CancelledError:  # the channel closed beneath it (the worker left) or `close`
            broken = Broken(grpc.StatusCode.UNAVAILABLE, "the call was cancelled: the worker left", "decode", self.name)
        self.broken = broken
        self._commands.put_nowait(None)
        self._on_broken(self)
        requests, self._requests = self._requests, {}
        for placed in requests.values():
            placed.put(broken)


class StepLinks:
    """The router's step stream to each decode worker it places on, opened on first use."""

    def __init__(self, view: WorkerView) -> None:
        self.view = view
        self._links: dict[str, StepLink] = {}

    def submit(
        self, worker: str, request: worker_pb2.WorkerRequest, trace: dict[str, str], timeout: float | None
    ) -> OnWorker:
        """Places `request` on `worker`; raises `Broken` if the worker has left the view."""
        member = self.view.channel(worker)
        if member is None:
            raise Broken(grpc.StatusCode.UNAVAILABLE, "a chosen worker left", "decode", worker)
        link = self._links.get(worker)
        if link is None or link.channel is not member[1]:  # none yet, or the worker's channel is new
            if link is not None:
                link.close()
            link = self._links[worker] = StepLink(worker, *member, self.view.pool.metadata, self._forget)
        return link.submit(request, trace, timeout)

    def _forget(self, link: StepLink) -> None:
        """A broken link leaves at once: the worker's next request opens a new one, and a worker gone
        for good leaves nothing behind."""
        if self._links.get(link.name) is link:
            del self._links[link.name]

    def __contains__(self, worker: str) -> bool:
        """Whether a step stream to `worker` is open."""
        return worker in self._links

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
