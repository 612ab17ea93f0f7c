"""One admitted request from placement to its last message, on the router's event loop: choose
workers from the pushed view, call them over `grpc.aio`, relay the decode worker's messages as
they came (`Stream.response` appends what the router adds), and migrate when a worker fails.

    place      `LoadIndex.choose` (no RPC); NoCapacity waits up to `migration_wait_s` on a move, and
               `watch_stale_after_s` while no decode worker is in view
    attempt    the request up the decode worker's step stream (`router.service.links`), whose
               entries for it are the response stream; prefill.Submit beside it as a task; the
               prefill worker's first token is streamed as it arrives (`router.first_token_from_prefill`)
    migrate    a migratable failure: the failed worker is set aside until it is heard from
               again, and the prompt and the tokens already streamed go to a live worker as
               output already generated, at most `migration_limit` times
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from tandem.v1 import api_pb2, worker_pb2

from cluster.auth import mint_capability
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.request import SamplingParams, params_to_proto
from cluster.telemetry import Telemetry
from router.placement.index import NoAdapter
from router.placement.placement import Choice, NoCapacity, NoneInView
from router.placement.view import WorkerView
from router.service.links import OnWorker, StepLinks, in_intervals
from router.service.settings import RouterSettings
from router.service.stream import (
    Broken,
    Stream,
    after_early_token,
    describe,
    early_first_token,
    rest_of,
    trace_metadata,
    watch_prefill,
)  # fmt: skip
from router.service.validate import PromptTokenizer

SUBMIT = "/tandem.v1.Worker/Submit"
# The end of a request whose worker broke after streaming its last token (its max_tokens).
LENGTH = worker_pb2.WorkerTokens(finish_reason=api_pb2.FINISH_REASON_LENGTH)


class Abort(Exception):
    """The request ends with this status, sent by the caller (`context.abort`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Dispatcher:
    def __init__(
        self, settings: RouterSettings, view: WorkerView, telemetry: Telemetry, tokenizer: PromptTokenizer
    ) -> None:
        self.settings, self.view, self.telemetry, self.tokenizer = settings, view, telemetry, tokenizer
        self.decisions: collections.Counter[str] = collections.Counter()
        self._rng = random.Random(0)  # `prefix_routing: random`'s choices
        self.links = StepLinks(view)  # on the loop

    async def generate(
        self, stream: Stream, params: SamplingParams, context: grpc.aio.ServicerContext,
        trace_context: otel_context.Context,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """Places the request and relays its stream. When a worker dies mid-request, the request
        migrates: a live worker gets the prompt and, as output already generated, the tokens
        already streamed; it prefills both again and the same client stream continues, no token
        lost or repeated. The tokens keep their output indices, so a seeded request samples on
        as if it had never moved. Raises `Abort` for the caller to end the call with."""
        s = self.settings
        try:
            resumed = stream.generated  # tokens the client had when its stream broke (none for most)
            choice = await self.place(stream.prompt + resumed, rest_of(params, len(resumed)), wait_s=0)
        except NoCapacity as e:
            stream.status = "rejected"
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except NoAdapter as e:
            stream.status = "rejected"
            raise Abort(grpc.StatusCode.NOT_FOUND, str(e)) from None
        placed = await self._announce(choice, stream, context, trace_context)
        root = trace.get_current_span(trace_context)
        carried = dict(trace_metadata(trace_context))  # the trace context, for the workers
        worker_id = uuid.uuid4().hex[:16]  # never the client's id: two clients may send the same one
        trusted = True  # ship only what the decode worker lacks, until a prefill attempt failed
        for attempt in range(s.migration_limit + 1):
            generated = list(stream.generated)
            if attempt and len(generated) >= params.max_tokens:  # it broke after its last token
                yield stream.response(LENGTH)
                return
            if attempt:
                try:
                    rest = rest_of(params, len(generated))
                    choice = await self.place(stream.prompt + generated, rest, s.migration_wait_s)
                    if not trusted:  # the decode worker may have evicted what the index says it holds
                        choice = dataclasses.replace(choice, decode_blocks=0)
                except (NoCapacity, NoAdapter) as e:
                    raise Abort(grpc.StatusCode.UNAVAILABLE, f"no worker to continue the request on: {e}") from None
            tokens = (stream.prompt, generated)
            if (stream.chunks or generated) and params.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=None)  # the client has them: use the cache
            try:
                rid = f"{worker_id}.{attempt}"
                messages = self._attempt(rid, tokens, params, choice, context, carried, stream)
                async for message, arrived, source in messages:
                    first = not stream.chunks
                    yield stream.response(message)
                    if first:
                        self._first_token_spans(trace_context, placed, arrived, source)
                return
            except Broken as broken:
                if stream.finish_reason:  # the call broke after its last message: nothing is missing
                    return
                if not broken.migratable or attempt == s.migration_limit:
                    raise Abort(broken.code, broken.details) from None
                trusted = trusted and broken.where != "prefill"
                self.view.index.suspect(broken.worker)  # until its next heartbeat: not the move's target
                self.telemetry.metrics.migrations.labels(broken.where).inc()
                stream.migrated(self.tokenizer.decode)
                event = {"tandem.worker": broken.worker, "tandem.tokens_streamed": len(stream.generated)}
                root.add_event("migration", {**event, "tandem.error": broken.details})

    async def _announce(
        self, choice: Choice, stream: Stream, context: grpc.aio.ServicerContext, trace_context: otel_context.Context
    ) -> float:
        """Makes the placement visible: counters, the request's trace, its response metadata.
        Returns when it was placed (the end of `router.queue`)."""
        self.decisions[f"prefill={choice.reason}"] += 1
        m = self.telemetry.metrics
        m.placements.labels(choice.reason).inc()
        m.placed_cached_blocks.labels(choice.reason).inc(choice.cached_blocks)
        trace.get_current_span(trace_context).set_attributes(
            {
                "tandem.prefill_mode": choice.reason.split(":")[0],
                "tandem.placement": choice.reason,
                "tandem.cached_blocks": choice.cached_blocks,
            }
        )
        await context.send_initial_metadata(
            (
                ("tandem-request-id", stream.rid), ("tandem-prefill", describe(choice)),
                ("tandem-decode", choice.decode), ("tandem-cached-blocks", str(choice.cached_blocks)),
            )
        )  # fmt: skip
        placed = time.time()
        self.telemetry.record("router.queue", trace_context, stream.received, placed, tandem__prefill=describe(choice))
        m.queue.labels("router").observe(placed - stream.received)
        return placed

    async def place(self, prompt: list[int], params: SamplingParams, wait_s: float) -> Choice:
        """Chooses workers from the view the workers push (no RPC here), waiting up to `wait_s` for
        one to come back (a restarting worker), and at least `watch_stale_after_s` while no decode
        worker is in view at all (every one late with its heartbeat, on a loaded machine). Beam
        search needs the prompt's logits on the decode worker, so it is prefilled there."""
        s = self.settings
        start = time.monotonic()
        local = s.local_prefill_max_tokens if params.num_beams == 1 else len(prompt)
        max_tokens = params.max_tokens * params.num_beams
        rediscovered = False
        while True:
            try:
                if s.prefix_routing == "random":
                    return self.view.index.choose_random(prompt, max_tokens, s.block_size, local, self._rng)
                return self.view.index.choose(
                    prompt, max_tokens, s.block_size, local, cache_salt=params.cache_salt, adapter=params.adapter,
                    adapter_spread=s.adapter_spread,
                )  # fmt: skip
            except NoCapacity as e:
                if not rediscovered:  # a worker added since the last discovery may fit
                    await self.view.refresh_async()
                    rediscovered = True
                    continue
                patience = max(wait_s, s.watch_stale_after_s) if isinstance(e, NoneInView) else wait_s
                if time.monotonic() - start >= patience:
                    raise
                await asyncio.sleep(0.05 if isinstance(e, NoneInView) else 0.2)

    async def _attempt(
        self,
        worker_rid: str,
        tokens: tuple[list[int], list[int]],
        params: SamplingParams,
        choice: Choice,
        context: grpc.aio.ServicerContext,
        carried: dict[str, str],
        stream: Stream,
    ) -> AsyncIterator[tuple[worker_pb2.WorkerTokens, float, str]]:
        """One try on one pair of workers for `tokens` (the prompt, and the output already
        generated): the messages for the client as (worker message, arrival, "prefill" or
        "decode"), with the prefill call beside the decode worker's. Raises `Broken` when either
        fails; the caller decides whether to migrate. However it ends (the client gone included),
        the request is cancelled on both workers."""
        stream.carry = ""  # the worker holds back what the last one did, a stop string's start included
        remaining = context.time_remaining()  # the client's deadline, passed on to every worker call
        timeout = remaining if remaining is not None and remaining < 1e6 else None
        on_decode, prefill_call = self._submit(worker_rid, tokens, params, choice, timeout, carried)
        result: dict[str, object] = {}
        watcher, first = None, None
        if prefill_call is not None:
            # The prefill worker's first message carries the prompt's logprobs: they wait for it.
            early = self.settings.first_token_from_prefill or params.prompt_logprobs is not None
            first = asyncio.get_running_loop().create_future() if early else None
            watcher = asyncio.create_task(watch_prefill(prefill_call, on_decode, result, first))
        try:
            async for message, arrived, source in self._relay(on_decode, first, tokens, params):
                if params.prompt_logprobs is not None and first is not None and not stream.chunks:
                    await self._with_prompt_logprobs(message, first, watcher, result, choice)
                if watcher is not None and "cached" not in result and message.finish_reason:
                    # The decode worker finished before this loop heard the prefill worker's first message,
                    # which carries the prompt's cached tokens for the usage: its call has ended or soon will.
                    await asyncio.wait([watcher], timeout=1.0)
                if "cached" in result:
                    stream.cached_tokens = result["cached"]  # type: ignore[assignment]
                yield message, arrived, source
        except Broken:
            if watcher is not None:
                await asyncio.wait([watcher], timeout=1.0)  # the prefill call's own error, if it failed first
            if (failed := result.get("error")) is not None:
                raise Broken(*failed, "prefill", choice.prefill or "") from None  # type: ignore[misc]
            raise
        finally:
            result["cancelled"] = True
            on_decode.cancel()
            if prefill_call is not None:
                prefill_call.cancel()

    @staticmethod
    async def _with_prompt_logprobs(
        message: worker_pb2.WorkerTokens, first: asyncio.Future, watcher: asyncio.Task, result: dict[str, object],
        choice: Choice,
    ) -> None:  # fmt: skip
        """The request's first message, from the decode worker, gets the prompt's logprobs from the
        prefill worker's first message (waited for, if the KV landed before the router heard it)."""
        if message.prompt_logprobs:  # the prefill worker's own first token, streamed early
            return
        await asyncio.wait([first, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            code, details = result.get("error", (grpc.StatusCode.INTERNAL, "the prefill worker sent no first token"))  # type: ignore[misc]
            raise Broken(code, details, "prefill", choice.prefill or "")
        message.prompt_logprobs.extend(first.result()[0].prompt_logprobs)

    async def _relay(
        self, on_decode: OnWorker, first: asyncio.Future | None, tokens: tuple[list[int], list[int]],
        params: SamplingParams,
    ) -> AsyncIterator[tuple[worker_pb2.WorkerTokens, float, str]]:  # fmt: skip
        """The decode worker's messages as they came. With `first` (remote prefill), the prefill
        worker's first token goes out as soon as it arrives, if it comes before the decode worker's
        first message (which waits for the KV transfer and the admission); that message then goes
        out without it."""
        if first is not None:
            head = asyncio.ensure_future(anext(on_decode))
            try:
                await asyncio.wait((head, first), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not head.done() and not first.done():
                    head.cancel()  # the client left while both waited
            if first.done() and not head.done():
                msg, arrived = first.result()
                token = msg.token_ids[0]
                prompt, output = tokens
                text = IncrementalDetokenizer.after(self.tokenizer, prompt, output, params.stop).add(token)
                yield early_first_token(msg, text), arrived, "prefill"
                message = await head
                try:
                    rest = after_early_token(message, token, text)
                except ValueError as e:
                    raise Broken(grpc.StatusCode.INTERNAL, str(e), "decode", "") from None
                if rest is not None:
                    yield rest, time.time(), "decode"
            else:
                yield await head, time.time(), "decode"
        interval = self.settings.stream_interval
        async for message in on_decode if interval == 1 else in_intervals(on_decode, interval):
            yield message, time.time(), "decode"

    def _first_token_spans(
        self, trace_context: otel_context.Context, placed: float, arrived: float, source: str
    ) -> None:
        """TTFT's parts after `router.queue`: `router.prefill` (placement to the first token's
        arrival at the router: the prefill, and for a decode worker's token the KV transfer and
        admission) and `router.relay` (its arrival to its sending)."""
        sent = time.time()
        self.telemetry.record("router.prefill", trace_context, placed, arrived, tandem__first_token_from=source)
        self.telemetry.record("router.relay", trace_context, arrived, sent)

    def _submit(
        self,
        worker_rid: str,
        tokens: tuple[list[int], list[int]],
        params: SamplingParams,
        choice: Choice,
        timeout: float | None,
        carried: dict[str, str],
    ):  # type: ignore[no-untyped-def]
        """Places the request on the decode worker's step stream and, for remote prefill, starts
        the prefill worker's call."""
        s = self.settings
        prefill = None if choice.prefill is None else self.view.channel(choice.prefill)
        if choice.prefill is not None and prefill is None:
            raise Broken(grpc.StatusCode.UNAVAILABLE, "a chosen worker left", "prefill", choice.prefill)
        sampling = params_to_proto(params)
        prompt, output = tokens
        request = worker_pb2.WorkerRequest(
            request_id=worker_rid, prompt_token_ids=prompt, output_token_ids=output, sampling=sampling,
            remote_prefill=prefill is not None,
        )  # fmt: skip
        on_decode = self.links.submit(choice.decode, request, carried, timeout)
        if prefill is None:
            return on_decode, None
        capability = b""
        if s.capability_secret is not None:
            num_tokens = len(prompt) + len(output)  # the KV that travels
            capability = mint_capability(s.capability_secret, worker_rid, num_tokens, s.block_size, s.capability_ttl_s)
        total = len(prompt) + len(output)
        kept = min(choice.decode_blocks, (total - 1) // s.block_size) * s.block_size  # KV the decode worker has
        request = worker_pb2.WorkerRequest(
            request_id=worker_rid, prompt_token_ids=prompt, output_token_ids=output, sampling=sampling,
            decode_target=on_decode.link.address, capability=capability, decode_cached_tokens=kept,
        )  # fmt: skip
        submit = prefill[1].unary_stream(
            SUBMIT, request_serializer=worker_pb2.WorkerRequest.SerializeToString,
            response_deserializer=worker_pb2.WorkerTokens.FromString,
        )  # fmt: skip
        metadata = [*self.view.pool.metadata, *carried.items()]
        return on_decode, submit(request, timeout=timeout, metadata=metadata)
