"""What the decode worker sends a router: each request's outputs as `WorkerTokens`, and a router's step
stream (`Worker.Steps`), which carries every request that router placed here in one frame per step.

    tokens_message   an output as its `WorkerTokens` (Submit's message, and a frame's entry)
    caught_up        a Submit stream's outputs waiting for it, as one output
    Link             one router's step stream: the outputs of its requests as the engine loop hands
                     them over, sent as frames by the call's own thread

Lifecycle of a link:

    open      the router calls Steps: the worker reads its commands on a thread of their own
    submit    the worker checks the request as Submit does and queues it on the engine (or waits for
              its KV); a refusal goes out as a `RequestEnded` in the next frame
    put       the worker's frame router hands the link every output of its requests in one step; the
              link's sender wakes once and sends one frame, one entry per request (a request whose
              outputs piled up while the sender was busy gets them merged into its one entry)
    close     the stream ended (the router went away, or the worker stops, or a command named neither
              a submit nor a cancel: INVALID_ARGUMENT): the worker aborts every request still on it
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

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


def caught_up(out: RequestOutput, stream: queue.Queue[RequestOutput | None]) -> RequestOutput:
    """`out` and every output queued behind it, as one: a stream that lags behind the engine sends
    one message for what it owes, never a backlog of one message per step. An engine failure queued
    among them stays queued, for the next read."""
    outputs = [out]
    while not outputs[-1].finished:
        try:
            following = stream.get_nowait()
        except queue.Empty:
            break
        if following is None:
            stream.put(None)
            break
        outputs.append(following)
    return merged(outputs)


class Link:
    """One router's step stream. `put` and `end` come from the worker's threads; `frames` runs on the
    call's thread and is the only reader."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._outputs: dict[str, list[RequestOutput]] = {}  # per request, in arrival order
        self._ended: list[worker_pb2.RequestEnded] = []
        self._closed = False
        self.failed: tuple[grpc.StatusCode, str] | None = None  # why the router's commands ended the stream

    def put(self, outputs: list[RequestOutput]) -> None:
        with self._ready:
            for out in outputs:
                self._outputs.setdefault(out.request_id, []).append(out)
            self._ready.notify()

    def end(self, request_id: str, code: grpc.StatusCode, details: str) -> None:
        """`request_id` ended here without finishing: the router hears it with this status, after any
        output it had. (ALREADY_EXISTS names a request that runs on: the id was taken.)"""
        with self._ready:
            self._ended.append(worker_pb2.RequestEnded(request_id=request_id, code=code.value[0], details=details))
            self._ready.notify()

    def close(self, failed: tuple[grpc.StatusCode, str] | None = None) -> None:
        """No more frames after what is pending; with `failed`, the call then ends with that status."""
        with self._ready:
            self.failed = self.failed or failed
            self._closed = True
            self._ready.notify()

    def frames(self, active: Callable[[], bool]) -> Iterator[worker_pb2.StepFrame]:
        """One frame for whatever is pending each time the sender is free, until `close` (or until
        `active` says the call is over)."""
        while True:
            with self._ready:
                while not (self._outputs or self._ended or self._closed):
                    if not self._ready.wait(0.1) and not active():
                        return
                outputs, self._outputs = self._outputs, {}
                ended, self._ended = self._ended, []
                closed = self._closed
            if outputs or ended:
                tokens = [tokens_message(merged(outs)) for outs in outputs.values()]
                yield worker_pb2.StepFrame(tokens=tokens, ended=ended)
            if closed:
                return
