"""What the decode worker sends a router: each request's outputs as `WorkerTokens`, and a router's step
stream (`Worker.Steps`), which carries every request that router placed here in one frame per step.

    tokens_message   an output as its `WorkerTokens` (Submit's message, and a frame's entry)
    Outputs          a Submit stream's outputs, handed over by the frame reader, read on the front's
                     event loop; what waits when the stream is read is sent as one output
    Link             one router's step stream: the outputs of its requests as the frame reader hands
                     them over, sent as frames from the front's event loop

Lifecycle of a link:

    open      the router calls Steps: the worker reads its commands on its event loop
    submit    the worker checks the request as Submit does and queues it on the engine (or waits for
              its KV); a refusal goes out as a `RequestEnded` in the next frame
    put       the worker's frame router hands the link every output of its requests in one step; the
              link's sender wakes once and sends one frame, one entry per request (a request whose
              outputs piled up while the sender was busy gets them merged into its one entry)
    close     the stream ended (the router went away, or the worker stops, or a command named neither
              a submit nor a cancel: INVALID_ARGUMENT): the worker aborts every request still on it
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
from tandem.v1 import api_pb2, worker_pb2

from cluster.engine.request import logprob_entries
from decode_worker.text import RequestOutput, merged

FINISH = {
    None: api_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": api_pb2.FINISH_REASON_STOP,
    "length": api_pb2.FINISH_REASON_LENGTH,
    "abort": api_pb2.FINISH_REASON_ABORT,
}


def tokens_message(out: RequestOutput) -> worker_pb2.WorkerTokens:
    """The worker's message for an engine output; the last one carries speculation counts and
    beams, the first one the prompt's logprobs when asked for."""
    msg = worker_pb2.WorkerTokens(
        request_id=out.request_id,
        token_ids=out.token_ids,
        logprobs=logprob_entries(zip(out.token_ids, out.logprobs, strict=False)),
        prompt_logprobs=logprob_entries(out.prompt_logprobs),
        finish_reason=FINISH[out.finish_reason] if out.finished else api_pb2.FINISH_REASON_UNSPECIFIED,
        text=out.text,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.finished and out.num_draft_tokens:
        msg.speculation.CopyFrom(speculation_stats(out))
    for beam in out.beams:
        reason = FINISH[beam.finish_reason]
        msg.beams.append(api_pb2.Beam(text=beam.text, token_ids=beam.token_ids, score=beam.score, finish_reason=reason))
    return msg


def speculation_stats(out: RequestOutput) -> api_pb2.SpeculationStats:
    return api_pb2.SpeculationStats(
        draft_tokens=out.num_draft_tokens,
        accepted_tokens=out.num_accepted_tokens,
        target_passes=out.num_passes,
        acceptance_rate=out.num_accepted_tokens / out.num_draft_tokens if out.num_draft_tokens else 0.0,
        tokens_per_pass=out.num_output_tokens / out.num_passes if out.num_passes else 0.0,
    )


class Outputs:
    """A Submit stream's outputs: `put` and `fail` from any thread, `next` on the event loop that
    made it. A stream that lags behind the engine gets what it owes as one output, never a backlog
    of one message per step."""

    def __init__(self) -> None:
        self._wake = Wake()
        self._pending: list[RequestOutput] = []
        self._failed = False

    def put(self, out: RequestOutput) -> None:
        with self._wake.lock:
            self._pending.append(out)
            self._wake.notify()

    def fail(self) -> None:
        """The engine failed: the stream's next read raises `EngineFailed` after what was pending."""
        with self._wake.lock:
            self._failed = True
            self._wake.notify()

    async def next(self) -> RequestOutput:
        while True:
            with self._wake.lock:
                pending, self._pending = self._pending, []
                if not pending and self._failed:
                    raise EngineFailed
            if pending:
                return merged(pending)
            await self._wake.wait()


class EngineFailed(Exception):
    """The engine's step failed: every request on it ends (the router moves them)."""


class Wake:
    """A wake-up for one coroutine from any thread: `notify` (under `lock`) sets it at most once until
    the coroutine's `wait` takes it, so a burst of hand-overs costs the loop one call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self._set = False

    def notify(self) -> None:
        if not self._set:
            self._set = True
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self) -> None:
        await self._event.wait()
        with self.lock:
            self._event.clear()
            self._set = False


class Link:
    """One router's step stream. `put`, `end` and `close` come from any thread; `frames` runs on the
    front's event loop (which made the link) and is the only reader."""

    def __init__(self) -> None:
        self._wake = Wake()
        self._outputs: dict[str, list[RequestOutput]] = {}  # per request, in arrival order
        self._ended: list[worker_pb2.RequestEnded] = []
        self._closed = False
        self.failed: tuple[grpc.StatusCode, str] | None = None  # why the router's commands ended the stream

    def put(self, outputs: list[RequestOutput]) -> None:
        with self._wake.lock:
            for out in outputs:
                self._outputs.setdefault(out.request_id, []).append(out)
            self._wake.notify()

    def end(self, request_id: str, code: grpc.StatusCode, details: str) -> None:
        """`request_id` ended here without finishing: the router hears it with this status, after any
        output it had. (ALREADY_EXISTS names a request that runs on: the id was taken.)"""
        with self._wake.lock:
            self._ended.append(worker_pb2.RequestEnded(request_id=request_id, code=code.value[0], details=details))
            self._wake.notify()

    def close(self, failed: tuple[grpc.StatusCode, str] | None = None) -> None:
        """No more frames after what is pending; with `failed`, the call then ends with that status."""
        with self._wake.lock:
            self.failed = self.failed or failed
            self._closed = True
            self._wake.notify()

    async def frames(self) -> AsyncIterator[worker_pb2.StepFrame]:
        """One frame for whatever is pending each time the sender is free, until `close`."""
        while True:
            await self._wake.wait()
            with self._wake.lock:
                outputs, self._outputs = self._outputs, {}
                ended, self._ended = self._ended, []
                closed = self._closed
            if outputs or ended:
                tokens = [tokens_message(merged(outs)) for outs in outputs.values()]
                yield worker_pb2.StepFrame(tokens=tokens, ended=ended)
            if closed:
                return
