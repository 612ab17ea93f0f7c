"""One request's stream to its client, as `router.service.dispatch` relays it across attempts.

`Stream` is the request's state: what the client has been sent, and the bytes the router appends
to each worker message (request id, prompt length, usage, SLO). Beside it: what a worker's failure
means (`Broken`, `MIGRATABLE`) and what is left to generate after one (`rest_of`); the prefill
worker's first token sent ahead of the decode worker's (`watch_prefill`, `early_first_token`,
`after_early_token`); the request's bytes parsed (`parse`), its trace context for the workers
(`trace_metadata`), and its latency and SLO accounting once it ends (`account`)."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from tandem.v1 import api_pb2, worker_pb2

from cluster.engine.request import SamplingParams
from cluster.slo import RequestTiming, SLOWindow, Targets
from cluster.telemetry import Telemetry, inject
from router.placement.placement import Choice


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse."""

    error: str


def parse(message_type):  # type: ignore[no-untyped-def]
    def parse(data: bytes):  # type: ignore[no-untyped-def]
        try:
            return message_type.FromString(data)
        except Exception as e:  # protobuf's DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(str(e) or type(e).__name__)

    return parse


def trace_metadata(trace_context: otel_context.Context) -> list[tuple[str, str]]:
    token = otel_context.attach(trace_context)
    try:
        return inject()
    finally:
        otel_context.detach(token)


def slo_report(timing: RequestTiming, targets: Targets) -> api_pb2.SloReport:
    return api_pb2.SloReport(
        met=targets.met(timing.ttft, timing.tpot),
        ttft_seconds=timing.ttft,
        tpot_seconds=timing.tpot or 0.0,
        ttft_target_seconds=targets.ttft_s,
        tpot_target_seconds=targets.tpot_s,
    )


# A worker that died or vanished: the request can continue elsewhere.
MIGRATABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}  # fmt: skip


class Broken(Exception):
    """An attempt failed at a worker (`where` is "decode" or "prefill")."""

    def __init__(self, code: grpc.StatusCode, details: str, where: str, worker: str) -> None:
        super().__init__(details)
        self.code, self.details, self.where, self.worker = code, details, where, worker

    @property
    def migratable(self) -> bool:
        return self.code in MIGRATABLE


def rest_of(params: SamplingParams, streamed: int) -> SamplingParams:
    """What is left of a request that has already streamed `streamed` tokens, as placement sizes
    it (the workers get the whole request's parameters, and the streamed tokens as output)."""
    if not streamed:
        return params
    return dataclasses.replace(
        params, max_tokens=params.max_tokens - streamed, min_tokens=max(0, params.min_tokens - streamed)
    )


async def watch_prefill(prefill_call, decode_call, result: dict[str, object], first=None) -> None:  # type: ignore[no-untyped-def]
    """Consumes the prefill call: its first token goes to `first` (a future) as it arrives, with
    its arrival time; if the call fails, the request fails with its error (`result["error"]`, as
    (code, details))."""
    try:
        async for msg in prefill_call:
            result["cached"] = msg.num_cached_tokens
            if first is not None and not first.done():
                first.set_result((msg, time.time()))
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.CANCELLED and result.get("cancelled"):
            return  # the router cancelled it itself
        result["error"] = (e.code(), e.details() or "")
        decode_call.cancel()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if result.get("cancelled") or (task is not None and task.cancelling()):
            raise
        # The call was cancelled beneath this task: its channel closed (the worker left the view).
        result["error"] = (grpc.StatusCode.UNAVAILABLE, "the call was cancelled: the worker left")
        decode_call.cancel()


def early_first_token(msg: worker_pb2.WorkerTokens, text: str) -> worker_pb2.WorkerTokens:
    """The prefill worker's first token as a decode worker's message would carry it, with `text`,
    what the decode worker's detokenizer will release for it."""
    early = worker_pb2.WorkerTokens(request_id=msg.request_id, text=text, token_ids=msg.token_ids)
    early.logprobs.extend(msg.logprobs)
    early.prompt_logprobs.extend(msg.prompt_logprobs)
    return early


def after_early_token(msg: worker_pb2.WorkerTokens, token: int, text: str) -> worker_pb2.WorkerTokens | None:
    """The decode worker's first message without the first token (`token`, streamed early with
    `text`): the rest of its tokens, logprobs and text, or None if nothing is left to send.
    Raises ValueError if the decode worker's first token is not `token`."""
    if not msg.token_ids or msg.token_ids[0] != token:
        raise ValueError(f"the decode worker began with {list(msg.token_ids[:1])}, the prefill worker with [{token}]")
    rest = worker_pb2.WorkerTokens()
    rest.CopyFrom(msg)
    del rest.token_ids[:1]
    if rest.logprobs:
        del rest.logprobs[:1]
    rest.text = msg.text[len(text) :] if msg.text.startswith(text) else msg.text
    if not (rest.token_ids or rest.text or rest.finish_reason):
        return None
    return rest


@dataclass
class Stream:
    """One request's relay state across its attempts: what the client has been sent, and how the
    request ended (`status`: ok, cancelled, rejected, error)."""

    rid: str
    prompt: list[int]
    received: float  # when the router got it (time.time())
    targets: Targets
    chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (arrival, tokens)
    generated: list[int] = dataclasses.field(default_factory=list)
    sent: list[str] = dataclasses.field(default_factory=list)  # the text sent, piece by piece (joined when moved)
    # Text a failed worker held back (a stop string's possible start, a partial character): the next
    # worker replays the output's tail and holds it back too; it goes out here only if no worker is asked
    # for more (`generate`'s length end after a move).
    carry: str = ""
    cached_tokens: int | None = None  # prompt tokens the prefill worker found cached
    status: str = "error"
    finish_reason: int = 0
    timing: RequestTiming | None = None
    speculation: api_pb2.SpeculationStats | None = None
    prompt_text: str = ""  # the prompt decoded, for a client that asked for it (return_prompt_text)
    token_bytes: Callable[[int], bytes] | None = None  # the tokenizer's: each logprob entry's text and bytes
    # The stream's bytes decoded as its tokens come: each logprob entry's text is what its token completes.
    utf8: codecs.IncrementalDecoder = dataclasses.field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def response(self, msg: worker_pb2.WorkerTokens) -> bytes:
        """The client's message for a worker's `WorkerTokens`: its bytes, whose shared fields are
        GenerateResponse's, with what the router adds appended (a later field wins, repeated ones
        extend): the request id, the first message's prompt length (and text, when asked for),
        held-back text after a migration, the last one's usage and SLO. Logprob entries are
        rewritten with their tokens' text and bytes."""
        first = not self.chunks
        if msg.token_ids or first:
            self.chunks.append((time.time(), len(msg.token_ids)))
        self.generated += msg.token_ids
        self.sent.append(self.carry + msg.text)
        out = api_pb2.GenerateResponse(request_id=self.rid)
        if msg.logprobs and self.token_bytes is not None:
            out.logprobs.extend(self._with_text(lp, self.utf8) for lp in msg.logprobs)
            del msg.logprobs[:]
        if msg.prompt_logprobs and self.token_bytes is not None:
            prompt_utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            prompt_utf8.decode(self.token_bytes(self.prompt[0]))  # the first token's text has no entry
            out.prompt_logprobs.extend(self._with_text(lp, prompt_utf8) for lp in msg.prompt_logprobs)
            del msg.prompt_logprobs[:]
        if self.carry:
            out.text, self.carry = self.carry + msg.text, ""
        if first:
            out.prompt_tokens, out.prompt_text = len(self.prompt), self.prompt_text
        if msg.finish_reason:
            self.timing = timing = RequestTiming(self.received, tuple(self.chunks))
            cached = self.cached_tokens if self.cached_tokens is not None else msg.num_cached_tokens
            out.usage.CopyFrom(
                api_pb2.Usage(
                    prompt_tokens=len(self.prompt), completion_tokens=len(self.generated),
                    cached_prompt_tokens=cached,
                )
            )  # fmt: skip
            out.slo.CopyFrom(slo_report(timing, self.targets))
            self.speculation = msg.speculation if msg.HasField("speculation") else None
            self.status, self.finish_reason = "ok", msg.finish_reason
        return msg.SerializeToString() + out.SerializeToString()

    def _with_text(self, lp: api_pb2.TokenLogprob, utf8: codecs.IncrementalDecoder) -> api_pb2.TokenLogprob:
        """`lp` with its token's bytes, and the text they complete in the text `utf8` decodes."""
        assert self.token_bytes is not None
        raw = self.token_bytes(lp.token_id)
        entry = api_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, token=utf8.decode(raw), token_bytes=raw)
        for top in lp.top:
            b = self.token_bytes(top.token_id)
            entry.top.add(token_id=top.token_id, logprob=top.logprob, token=b.decode(errors="replace"), token_bytes=b)
        return entry

    def resumed(self, resume: api_pb2.Resume, decode: Callable[[list[int]], str]) -> None:
        """A stream resumed through this router: the client has these tokens and this text already."""
        self.generated, self.sent = list(resume.token_ids), [resume.text]
        self.migrated(decode)

    def migrated(self, decode: Callable[[list[int]], str]) -> None:
        """The tokens streamed so far go to the next worker as output already generated; `carry` is
        their text the failed worker had not released yet."""
        whole, sent = decode(self.generated) if self.generated else "", "".join(self.sent)
        self.carry = whole[len(sent) :] if whole.startswith(sent) else ""


def account(telemetry: Telemetry, slo: SLOWindow, root: trace.Span, stream: Stream) -> None:
    """Latency metrics, SLO attainment and the root span's attributes for a finished request."""
    timing = stream.timing
    if timing is None:
        return
    m = telemetry.metrics
    m.ttft.observe(timing.ttft)
    m.e2e.observe(timing.e2e)
    if timing.tpot is not None:
        m.tpot.observe(timing.tpot)
    for gap in timing.itl:
        m.itl.observe(gap)
    met = stream.targets.met(timing.ttft, timing.tpot)
    slo.record(met, timing.ttft, timing.tpot)
    m.slo_requests.labels("true" if met else "false").inc()
    attainment = slo.attainment()
    if attainment is not None:
        m.slo_attainment.set(attainment)
    finish = {api_pb2.FINISH_REASON_STOP: "stop", api_pb2.FINISH_REASON_LENGTH: "length"}
    root.set_attributes(
        {
            "gen_ai.usage.input_tokens": len(stream.prompt),
            "gen_ai.usage.output_tokens": timing.output_tokens,
            "gen_ai.response.finish_reasons": [finish.get(stream.finish_reason, "abort")],
            "tandem.ttft_s": timing.ttft,
            "tandem.tpot_s": timing.tpot if timing.tpot is not None else 0.0,
            "tandem.slo_met": met,
        }
    )
    if (spec := stream.speculation) is not None:
        root.set_attributes(
            {
                "tandem.spec.draft_tokens": spec.draft_tokens,
                "tandem.spec.accepted_tokens": spec.accepted_tokens,
                "tandem.spec.acceptance_rate": spec.acceptance_rate,
                "tandem.spec.tokens_per_pass": spec.tokens_per_pass,
            }
        )


def describe(choice: Choice) -> str:
    return choice.reason if choice.prefill is None else f"{choice.reason}:{choice.prefill}"
