"""The decode engine in one process: `add_request`, `abort`, `step()` (its asyncio front is
`decode_worker.async_engine`).

    engine.add_request(id, prompt_token_ids, params)
    while engine.has_unfinished:
        for out in engine.step():   # schedule -> execute -> update -> detokenise
            ...

`step()` is three calls: the scheduler plans, the runner executes, the scheduler applies the
samples. The engine adds what a client sees: text deltas, stop strings, logprobs, and
`RequestOutput`s. Aborting a request frees its blocks at once.

With a proposer (`cluster.engine.speculative`), each step first asks it for draft tokens for the decoding
requests, the scheduler adds them to the plan, one pass scores them all (each token a decode row,
through a compiled graph where one fits), and `Sampler.verify` keeps what the target model agrees
with: a request may gain several tokens in a step. Requests with and without speculation, and with
different draft lengths, share a batch.

A request with `num_beams > 1` runs beam search (`decode_worker.beam`): its beams are sequences in
the same batch that share KV blocks, and its one output, at the end, carries every beam.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.compiled import CompiledDecode
from cluster.engine.detokenizer import Decoder, IncrementalDetokenizer
from cluster.engine.kv_events import KVJournal
from cluster.engine.model_runner import ModelRunner, num_kv_blocks
from cluster.engine.request import Request, SamplingParams, ScheduledChunk, StepPlan
from cluster.engine.sampler import Draft, Sampler, SampleRow, TokenLogprob
from cluster.engine.speculative import DraftProposer, Proposer
from cluster.engine.structured import Grammars, PendingMasks, grammatical
from cluster.model.causal_lm import CausalLM
from decode_worker.beam import BeamGroups, BeamResult
from decode_worker.scheduler import Scheduler


@dataclass(frozen=True)
class BeamOutput:
    token_ids: list[int]
    text: str
    score: float  # sum of log-probs / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" or "length"


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new this step
    text: str  # new this step
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_passes: int = 0  # target-model passes that gave this request tokens
    num_draft_tokens: int = 0  # speculative tokens proposed
    num_accepted_tokens: int = 0  # and kept
    beams: list[BeamOutput] = field(default_factory=list)  # beam search: every beam, best first, at the end


@dataclass
class _Stream:
    request: Request
    detokenizer: IncrementalDetokenizer


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Decoder,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
        seed: int = 0,
        compile_buckets: Sequence[int] = (),
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        grammars: Grammars | None = None,
    ) -> None:
        self.num_blocks = num_kv_blocks(model, cache)
        self.kv_journal = KVJournal()  # what the prefix cache holds, for the routers' watch streams
        blocks = BlockManager(
            self.num_blocks, cache.block_size, cache.watermark, cache.enable_prefix_caching, self.kv_journal
        )
        max_len = min(max_model_len or model.arch.max_position_embeddings, model.arch.max_position_embeddings)
        self.scheduler = Scheduler(scheduler, blocks, eos_token_ids, max_len)
        sampler = Sampler(model.arch.vocab_size, seed)
        compiled = (
            CompiledDecode(model, compile_buckets, cache.block_size, self.num_blocks) if compile_buckets else None
        )
        self.runner = ModelRunner(model, self.num_blocks, cache.block_size, sampler, compiled, cache.kv_dtype)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs = scheduler.max_num_seqs
        self._streams: dict[str, _Stream] = {}
        # Steps and KV-transfer reservations arrive on different threads; the scheduler and block
        # manager see one at a time.
        self.lock = threading.Lock()
        self._reserved: set[str] = set()  # request ids holding blocks for a KV transfer in flight
        self._pending: list[RequestOutput] = []  # first tokens of admitted transfers, out with the next step
        self.beams = BeamGroups(self.scheduler, eos_token_ids)
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.grammars = grammars  # structured output; None refuses constrained requests

    def warm_up(self) -> None:
        """Compiles every decode bucket now (the target's, and the draft model's when it has its
        own), so that no request waits for a compile; nothing to do without buckets."""
        if self.runner.compiled is not None:
            self.runner.compiled.warm_up(self.kv_cache)
        if isinstance(self.proposer, DraftProposer):
            self.proposer.warm_up()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    @property
    def kv_cache(self):  # type: ignore[no-untyped-def]
        return self.runner.kv_cache

    # -- KV transfer: reserve -> (the transport writes the cache) -> admit | release ---------------

    def reserve(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, num_output: int = 0
    ) -> tuple[list[int], int]:
        """Blocks for tokens whose KV will arrive by transfer (a prompt, and for a request moved
        here its `num_output` last tokens are output it already generated): (block table, leading
        tokens already in this worker's prefix cache). Raises KeyError for an id in use, ValueError
        for a request that can never run here, MemoryError when it does not fit now."""
        request = _request(request_id, token_ids, params, num_output)
        self._constrain(request)  # a constraint this worker cannot compile is refused before any block
        with self.lock:
            if request_id in self._reserved or request_id in self.scheduler.requests:
                raise KeyError(f"request id {request_id!r} is already in use on this worker")
            if params.num_beams > 1:
                raise ValueError("beam search requests are prefilled on the decode worker, not transferred")
            self.scheduler.check(request)
            blocks = self.scheduler.blocks
            if len(self.scheduler.running) + len(self._reserved) >= self.max_num_seqs:
                raise MemoryError(f"the running batch is full ({self.max_num_seqs} sequences)")
            if not blocks.can_allocate(request.all_token_ids):
                raise MemoryError(f"{blocks.num_free_blocks} free KV blocks are not enough for {len(token_ids)} tokens")
            cached = blocks.allocate(request_id, request.all_token_ids)
            self._reserved.add(request_id)
            return list(blocks.block_table(request_id)), cached

    def release(self, request_id: str) -> None:
        """Frees the blocks of a reservation whose transfer failed."""
        with self.lock:
            if request_id in self._reserved:
                self._reserved.discard(request_id)
                self.scheduler.blocks.free(request_id)

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        first_token: int,
        logprob: TokenLogprob | None = None,
        num_output: int = 0,
    ) -> None:
        """Puts a reserved sequence whose KV has fully landed into the running batch (`token_ids`
        and `num_output` as reserved)."""
        request = _request(request_id, token_ids, params, num_output)
        self._constrain(request)
        with self.lock:
            if request_id not in self._reserved:
                raise KeyError(f"no reservation for request {request_id!r}")
            self._reserved.discard(request_id)
            self._open_stream(request)  # before the first token joins the output: it is decoded as new text
            self.scheduler.admit(request, first_token)
            if request.matcher is not None:
                request.matcher.consume([first_token])
            self._pending.append(self._output(request, [first_token], [logprob] if logprob is not None else None))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """Queues a request, with the output it already generated elsewhere when it moved here (its
        KV is computed again, and sampling goes on at output index `len(output_token_ids)`).
        Raises ValueError (nothing queued) if it can never run here."""
        tokens = [*prompt_token_ids, *output_token_ids]
        request = _request(request_id, tokens, params, len(output_token_ids))
        self._constrain(request)
        with self.lock:
            if request_id in self._reserved:
                raise ValueError(f"request id {request_id!r} is already in use")
            if params.num_beams > 1:
                self.beams.add(request)
            else:
                self.scheduler.add(request)
            self._open_stream(request)

    def _constrain(self, request: Request) -> None:
        """Gives a constrained request its matcher, replayed over the output it already has (made
        on a prefill worker, or before it moved here); ValueError if it cannot be compiled here."""
        c = request.params.structured
        if c is None:
            return
        if self.grammars is None:
            raise ValueError("structured output is not available on this worker (no tokenizer)")
        request.matcher = self.grammars.matcher(c, request.output_token_ids)

    def _open_stream(self, request: Request) -> None:
        # The context is every token so far, so that the first new token decodes as it would inline.
        detok = IncrementalDetokenizer(self.tokenizer, request.all_token_ids, request.params.stop)
        self._streams[request.request_id] = _Stream(request, detok)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            self._streams.pop(request_id, None)
            self._pending = [out for out in self._pending if out.request_id != request_id]
            found = self.beams.abort(request_id) or self.scheduler.abort(request_id) is not None
            if self.proposer is not None:
                self.proposer.retain(self.scheduler.requests)
            return found

    def step(self) -> list[RequestOutput]:
        with self.lock:
            outputs, self._pending = self._pending, []
            return outputs + self._step()

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if self.beams:
            plan = self.beams.settle(plan)
        if plan.empty:
            return []
        drafts: dict[str, Draft] = {}
        if self.num_speculative_tokens:
            plan, drafts = self._speculate(plan)
        sampling = [c for c in plan.chunks if c.samples and c.request.group is None]
        before = {c.request.request_id: len(c.request.output_token_ids) for c in sampling}
        tokens, logprobs, beam_logits = self._execute(plan, sampling, drafts)
        ids = [c.request.request_id for c in sampling]
        sampled = dict(zip(ids, tokens, strict=True))
        lps = dict(zip(ids, logprobs, strict=True)) if logprobs is not None else {}
        outputs = []
        stepped = StepPlan(tuple(c for c in plan.chunks if not (c.samples and c.request.group is not None)))
        for request in self.scheduler.update(stepped, sampled):
            new = request.output_token_ids[before[request.request_id] :]
            outputs.append(self._output(request, new, lps.get(request.request_id)))
        for c in sampling:
            if c.request.matcher is not None and not c.request.finished:
                c.request.matcher.consume(c.request.output_token_ids[before[c.request.request_id] :])
        outputs += [self._beam_output(result) for result in self.beams.advance(beam_logits)]
        if self.proposer is not None:
            self.proposer.retain(self.scheduler.requests)  # finished requests' draft state goes now
        return outputs

    def _execute(
        self, plan: StepPlan, sampling: list[ScheduledChunk], drafts: dict[str, Draft]
    ) -> tuple[list[list[int]], list[list[TokenLogprob]] | None, dict[str, torch.Tensor]]:
        """Runs the pass: each sampling request's new tokens (and logprobs), and each beam's logits.
        A plain step samples one token per request (through a compiled graph when it can); a step
        with drafts or beams takes the logits of every row and verifies or hands them on."""
        if not drafts and len(sampling) == sum(c.samples for c in plan.chunks):
            rows = [self._row(c.request) for c in sampling]
            masks = self._masks([(i, c.request, ()) for i, c in enumerate(sampling)])
            result = self.runner.execute(plan, rows, masks=masks)
            if result.logprobs is None:
                return [[t] for t in result.token_ids], None, {}
            pairs = zip(result.logprobs, result.top_logprobs, strict=True)  # type: ignore[arg-type]
            return [[t] for t in result.token_ids], [[pair] for pair in pairs], {}
        rows, verifying, plain_rows, beams, constrained, at = [], [], [], {}, [], 0
        for c in plan.chunks:
            if not c.samples:
                continue
            if c.request.group is not None:
                beams[c.request.request_id] = at
            else:
                constrained.append((len(rows), c.request, c.draft))
                rows += [self._row(c.request, c.draft[:j]) for j in range(len(c.draft) + 1)]
                verifying.append(self._draft(c.draft, drafts.get(c.request.request_id)))
                plain_rows += range(at, at + len(c.draft) + 1)
            at += 1 + len(c.draft)
        masks = self._masks(constrained)  # beside the pass
        logits = self.runner.logits(plan)
        assert logits is not None
        if masks is not None:
            rows = masks.attach(rows)
        verified = self.runner.sampler.verify(logits[plain_rows], rows, verifying)
        return verified.token_ids, verified.logprobs, {rid: logits[i] for rid, i in beams.items()}

    def _masks(self, entries: list[tuple[int, Request, tuple[int, ...]]]) -> PendingMasks | None:
        """Starts the structured-output masks of the constrained entries (first row, request, draft)."""
        work = [(row, r.matcher, d) for row, r, d in entries if r.matcher is not None]
        if not work or self.grammars is None:
            return None
        return self.grammars.masks(work)

    def _beam_output(self, result: BeamResult) -> RequestOutput:
        request = result.request
        del self._streams[request.request_id]
        beams = [
            BeamOutput(list(h.token_ids), self.tokenizer.decode(list(h.token_ids)), h.score, h.finish_reason)
            for h in result.hypotheses
        ]
        best = beams[0]
        return RequestOutput(
            request_id=request.request_id,
            token_ids=best.token_ids,
            text=best.text,
            finished=True,
            finish_reason=best.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(best.token_ids),
            num_passes=len(best.token_ids),
            beams=beams,
        )

    def _speculate(self, plan: StepPlan) -> tuple[StepPlan, dict[str, Draft]]:
        """Asks the proposer for each decoding request's draft and adds what fits to the plan."""
        assert self.proposer is not None
        candidates, ks = [], []
        for c in plan.chunks:
            if c.samples and c.num_new == 1 and c.request.group is None and (k := self._draft_length(c.request)) > 0:
                candidates.append(c.request)
                ks.append(k)
        if not candidates:
            return plan, {}
        proposals = self.proposer.propose(candidates, ks, self._row)
        proposals = [grammatical(r.matcher, d) for r, d in zip(candidates, proposals, strict=True)]
        drafts = {r.request_id: d for r, d in zip(candidates, proposals, strict=True) if d.tokens}
        plan = self.scheduler.speculate(plan, {rid: d.tokens for rid, d in drafts.items()})
        return plan, {c.request.request_id: drafts[c.request.request_id] for c in plan.chunks if c.draft}

    def _draft_length(self, request: Request) -> int:
        asked = request.params.speculative_tokens
        k = self.num_speculative_tokens if asked is None else min(asked, self.num_speculative_tokens)
        return min(k, self.scheduler.room(request))

    @staticmethod
    def _draft(tokens: tuple[int, ...], proposed: Draft | None) -> Draft:
        """The draft as the plan kept it (the scheduler may have shortened it)."""
        if proposed is None or proposed.probs is None:
            return Draft(tokens)
        return Draft(tokens, proposed.probs[: len(tokens)])

    def _row(self, request: Request, drafted: Sequence[int] = ()) -> SampleRow:
        """The sampling row of `request` with `drafted` tokens appended to its output so far."""
        params = request.params
        suppressed: tuple[int, ...] = ()
        if len(request.output_token_ids) + len(drafted) < params.min_tokens:
            suppressed = (*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids))
        output = [*request.output_token_ids, *drafted] if drafted else request.output_token_ids
        return SampleRow(params, request.prompt_token_ids, output, suppressed)

    def _output(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        stream = self._streams[request.request_id]
        text = ""
        for n, token in enumerate(tokens, 1):
            text += stream.detokenizer.add(token)
            if stream.detokenizer.stopped:
                if n < len(tokens):  # tokens a step kept past the stop string are not output
                    del request.output_token_ids[n - len(tokens) :]
                    tokens = tokens[:n]
                    request.finish_reason = "stop" if request.finished else request.finish_reason
                if not request.finished:
                    self.scheduler.finish(request.request_id, "stop")
                break
        if request.finished:
            text += stream.detokenizer.flush()
            del self._streams[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            token_ids=tokens,
            text=text,
            logprobs=logprobs[: len(tokens)] if logprobs is not None and request.params.logprobs is not None else [],
            finished=request.finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_passes=request.num_passes,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )


def _request(request_id: str, token_ids: Sequence[int], params: SamplingParams, num_output: int) -> Request:
    """A request whose last `num_output` of `token_ids` are output it generated before it moved
    here; ValueError if that output already ends it."""
    if num_output and params.num_beams > 1:
        raise ValueError("a beam search request cannot continue from output generated elsewhere")
    if num_output >= params.max_tokens:
        raise ValueError(f"{num_output} tokens already generated reach max_tokens ({params.max_tokens})")
    cut = len(token_ids) - num_output
    return Request(request_id, list(token_ids[:cut]), params, output_token_ids=list(token_ids[cut:]))
