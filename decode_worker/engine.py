"""The decode engine in one process: `add_request`, `abort`, `step()` (its asyncio front is
`decode_worker.async_engine`).

    engine.add_request(id, prompt_token_ids, params)
    while engine.has_unfinished:
        for out in engine.step():   # schedule -> run -> update
            ...

`step()` is three calls, as in nano-vllm and vLLM v1:

    plan = self._schedule()                # StepPlan: the scheduler's, beam groups settled, drafts added
    output = self.runner.run(plan)         # StepOutput: each sampling request's new tokens, each beam's logits
    outputs = self._update(plan, output)   # the scheduler appends the tokens; text, stop strings, beams

The engine adds what a client sees: logprobs and `RequestOutput`s, with their text deltas and stop
strings (`decode_worker.text`) unless built with `text=False`, as a served worker's engine core is:
its front applies them. Aborting a request frees its blocks at once. Each variant lives in its own module:

- Speculative decoding (`cluster.engine.speculative`): the `Speculator` asks the proposer for draft
  tokens for the decoding requests and the scheduler adds them to the plan; the runner scores
  them all in one pass (each token a decode row, through a compiled graph where one fits) and
  `Sampler.verify` keeps what the target model agrees with, so a request may gain several tokens
  in a step. Requests with and without speculation, and with different draft lengths, share a batch.
- Beam search (`decode_worker.beam`): a request with `num_beams > 1` has its beams as sequences in
  the same batch that share KV blocks; the runner hands back their logits, `BeamGroups` steps the
  search, and the request's one output, at the end, carries every beam.
- Structured output (`cluster.engine.structured`): a constrained request carries a matcher; the
  runner computes its masks beside the forward pass, and the scheduler advances it over new tokens.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from cluster.config import CacheConfig, LoraConfig, SchedulerConfig
from cluster.engine.adapters import Adapters, resolve
from cluster.engine.changes import Changes, Occupancy
from cluster.engine.compiled import CompiledDecode
from cluster.engine.detokenizer import Decoder
from cluster.engine.model_runner import ModelRunner, StepOutput, num_kv_blocks
from cluster.engine.request import FirstToken, Request, SamplingParams, StepPlan, UnknownAdapter, adapters_fit
from cluster.engine.sampler import Sampler, TokenLogprob
from cluster.engine.speculative import Proposer, Speculator
from cluster.engine.structured import Grammars
from cluster.kv.tiering import PARKED_WAIT_S, Tiering, named_pool
from cluster.model.causal_lm import CausalLM
from cluster.model.lora import Adapter
from decode_worker.beam import BeamGroups, BeamResult
from decode_worker.scheduler import Scheduler
from decode_worker.text import BeamOutput, RequestOutput, TextStreams


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
        shared_kv: bool = False,  # the KV cache in shared memory, for a front in another process
        text: bool = True,  # False: outputs carry no text and stop strings are left to the caller
        secret: str = "",  # the cluster's: it seals the KV tiers' entries
        lora: LoraConfig | None = None,  # LoRA adapters' slots; None serves the base model only
    ) -> None:
        self.num_blocks = num_kv_blocks(model, cache)
        self.adapters = Adapters.build(model, lora) if lora is not None else None
        pool = named_pool(model, model.arch, cache, self.num_blocks)
        self.fingerprint, blocks = pool.fingerprint, pool.blocks
        self.kv_journal = pool.journal  # what the prefix cache holds, for the routers' watch streams
        max_len = min(max_model_len or model.arch.max_position_embeddings, model.arch.max_position_embeddings)
        self.max_adapters = lora.max_loras if lora is not None else 0
        self.scheduler = Scheduler(scheduler, blocks, eos_token_ids, max_len, self.max_adapters)
        sampler = Sampler(model.arch.vocab_size, seed)
        compiled = (
            CompiledDecode(model, compile_buckets, cache.block_size, self.num_blocks) if compile_buckets else None
        )
        self.runner = ModelRunner(
            model, self.num_blocks, cache.block_size, sampler, compiled, cache.kv_dtype, eos_token_ids, grammars,
            shared_kv, self.adapters,
        )  # fmt: skip
        self.tiering = Tiering.build(cache.tiers, secret, blocks, self.runner)  # None without KV tiers
        self.tokenizer = tokenizer
        self.max_num_seqs = scheduler.max_num_seqs
        self.text = TextStreams(tokenizer) if text else None
        # Steps and KV-transfer reservations arrive on different threads; the scheduler and block
        # manager see one at a time.
        self.lock = threading.Lock()
        self._reserved: dict[str, Request] = {}  # requests holding blocks for a KV transfer in flight, by id
        self._pending: list[RequestOutput] = []  # first tokens of admitted transfers, out with the next step
        self.first_tokens: deque[FirstToken] = deque(maxlen=4096)  # where prompts prefilled here waited, untaken
        self.beams = BeamGroups(self.scheduler, eos_token_ids)
        self.proposer = proposer
        self.speculator = (
            Speculator(proposer, num_speculative_tokens, self.scheduler, self.runner.row)
            if proposer is not None
            else None
        )
        self.grammars = grammars  # structured output; None refuses constrained requests
        self.changes = Changes()  # bumped after every change below; the loop and Watch wait on it
        self.occupancy = Occupancy()  # the load as of the last change, published under the lock
        self._changed()

    def warm_up(self) -> None:
        """Compiles every decode bucket now (the target's, and the draft model's when it has its
        own), so that no request waits for a compile; nothing to do without buckets."""
        if self.runner.compiled is not None:
            self.runner.compiled.warm_up(self.kv_cache, self.adapters.slots if self.adapters is not None else None)
        if self.speculator is not None:
            self.speculator.warm_up()

    def close(self) -> None:
        """Stops the threads the engine started (its KV tiers', its masks'), once its loop has ended."""
        if self.tiering is not None:
            self.tiering.close()
        if self.grammars is not None:
            self.grammars.close()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending) or bool(self.tiering and self.tiering.parked)

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
            resolve(self.adapters, request, in_flight=True)  # prefilled before its adapter was unloaded here
            parked = self.tiering is not None and request_id in self.tiering
            if request_id in self._reserved or request_id in self.scheduler.requests or parked:
                raise KeyError(f"request id {request_id!r} is already in use on this worker")
            if params.num_beams > 1:
                raise ValueError("beam search requests are prefilled on the decode worker, not transferred")
            self.scheduler.check(request)
            blocks = self.scheduler.blocks
            if len(self.scheduler.running) + len(self._reserved) >= self.max_num_seqs:
                raise MemoryError(f"the running batch is full ({self.max_num_seqs} sequences)")
            if not adapters_fit([*self.scheduler.running, *self._reserved.values()], request, self.max_adapters):
                raise MemoryError(f"the running batch's adapters fill this worker's {self.max_adapters} slots")
            if not blocks.can_allocate(request.all_token_ids, scope=request.scope):
                raise MemoryError(f"{blocks.num_free_blocks} free KV blocks are not enough for {len(token_ids)} tokens")
            cached = blocks.allocate(request_id, request.all_token_ids, scope=request.scope)
            if self.tiering is not None:
                self.tiering.move()  # the blocks it evicted go down before the transfer overwrites them
            self._reserved[request_id] = request
            self._changed()
            return list(blocks.block_table(request_id)), cached

    def release(self, request_id: str) -> None:
        """Frees the blocks of a reservation whose transfer failed."""
        with self.lock:
            if request_id in self._reserved:
                del self._reserved[request_id]
                self.scheduler.blocks.free(request_id)
                self._changed()

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
            request.adapter = self._reserved.pop(request_id).adapter
            self._open_stream(request)  # before the first token joins the output: it is decoded as new text
            request.num_prompt_logprobs = max(request.num_prompt_tokens - 1, 0)  # scored where it was prefilled
            self.scheduler.admit(request, first_token)  # and the matcher takes the first token
            self._pending.append(self._output(request, [first_token], [logprob] if logprob is not None else None))
            self._changed()

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
        request.queued_at = time.monotonic()
        self._constrain(request)
        with self.lock:
            resolve(self.adapters, request)
            if request_id in self._reserved or (self.tiering is not None and request_id in self.tiering):
                raise ValueError(f"request id {request_id!r} is already in use")
            if params.num_beams > 1:
                self.beams.add(request)
            else:
                self.scheduler.check(request)
                if self.tiering is None or not self.tiering.park(request):  # parked: its KV loads first
                    self.scheduler.add(request)
            self._open_stream(request)
            self._changed()

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
        if self.text is not None:
            self.text.open(request.request_id, request.prompt_token_ids, request.output_token_ids, request.params.stop)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            if self.text is not None:
                self.text.close(request_id)
            self._pending = [out for out in self._pending if out.request_id != request_id]
            found = self.beams.abort(request_id) or self.scheduler.abort(request_id) is not None
            found = found or (self.tiering is not None and self.tiering.abort(request_id) is not None)
            if self.speculator is not None:
                self.speculator.retain(self.scheduler.requests)
            self._changed()
            return found

    def step(self) -> list[RequestOutput]:
        tiering = self.tiering
        with self.lock:
            outputs, self._pending = self._pending, []
            for request in tiering.ready() if tiering is not None else ():
                self.scheduler.add(request)
            plan = self._schedule()
            if not plan.empty:
                if tiering is not None:
                    tiering.move()  # evicted blocks out, loaded blocks in, before the pass
                started = time.perf_counter()
                output = self.runner.run(plan)
                if tiering is not None:
                    tiering.note_pass(plan, time.perf_counter() - started)
                outputs += self._update(plan, output)
                if tiering is not None:
                    tiering.move()  # blocks computed by the pass, when they are written through
                if self.adapters is not None and self.adapters.retiring:
                    self.adapters.sweep(self._live_adapters(), time.monotonic())
                self._changed()
                return outputs
        if tiering is not None and tiering.parked and not outputs:
            tiering.wait(PARKED_WAIT_S)  # nothing to run until a load ends
        return outputs

    # -- LoRA adapters: loaded and unloaded between steps -----------------------------------------

    def load_adapter(self, adapter: Adapter) -> None:
        """Serves `adapter` (read and checked by the caller); ValueError for a name in use."""
        if self.adapters is None:
            raise ValueError("this worker serves no LoRA adapters (lora is not configured)")
        with self.lock:
            self.adapters.add(adapter)
            self._changed()

    def unload_adapter(self, name: str) -> None:
        """Refuses new requests through `name` from now on; those running finish first."""
        if self.adapters is None:
            raise UnknownAdapter(name)
        with self.lock:
            self.adapters.remove(name, time.monotonic())
            self.adapters.sweep(self._live_adapters(), time.monotonic())
            self._changed()

    def _live_adapters(self) -> set[str]:
        held = [*self.scheduler.requests.values(), *self._reserved.values()]
        return {r.params.adapter for r in held} | (self.tiering.adapters() if self.tiering is not None else set())

    def _changed(self) -> None:
        """Publishes the load as it is now and wakes whoever waits for a change (under the lock)."""
        s, blocks = self.scheduler, self.scheduler.blocks
        self.occupancy = Occupancy(
            running=len(s.running), waiting=len(s.waiting),
            queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
            free_blocks=blocks.num_free_blocks, total_blocks=blocks.num_blocks, preemptions=s.stats.num_preemptions,
            prefix_hits=blocks.prefix_hits, prefix_queries=blocks.prefix_queries,
            tiers=self.tiering.counts() if self.tiering is not None else (),
            adapters=self.adapters.states() if self.adapters is not None else (), max_loras=self.max_adapters,
        )  # fmt: skip
        self.changes.bump()

    def _schedule(self) -> StepPlan:
        """The scheduler's plan, less the beam groups that cannot step whole, with drafts added."""
        plan = self.scheduler.schedule()
        if self.beams:
            plan = self.beams.settle(plan)
        if self.speculator is not None and not plan.empty:
            plan = self.speculator.draft(plan)
        return plan

    def _update(self, plan: StepPlan, output: StepOutput) -> list[RequestOutput]:
        """Applies a step's output: the scheduler appends each request's new tokens, which become
        its text delta (ending it at a stop string); the beam groups take their beams' logits."""
        before = {c.request.request_id: len(c.request.output_token_ids) for c in plan.chunks if c.samples}
        outputs = []
        for request in self.scheduler.update(self.beams.unsampled(plan), output.token_ids):
            new = request.output_token_ids[before[request.request_id] :]
            if not request.first_token_at and request.started_at:  # its prompt was prefilled here
                request.first_token_at = time.monotonic()
                self.first_tokens.append(FirstToken.of(request))
            outputs.append(self._output(request, new, output.logprobs.get(request.request_id)))
        outputs += [self._beam_output(result) for result in self.beams.advance(output.logits)]
        if self.speculator is not None:
            self.speculator.retain(self.scheduler.requests)  # finished requests' draft state goes now
        return outputs

    def take_first_tokens(self) -> list[FirstToken]:
        """Where each prompt prefilled here since the last call waited for its first token (the latest 4,096)."""
        taken = list(self.first_tokens)
        self.first_tokens.clear()
        return taken

    def _beam_output(self, result: BeamResult) -> RequestOutput:
        request = result.request
        beams = [BeamOutput(list(h.token_ids), "", h.score, h.finish_reason) for h in result.hypotheses]
        best = beams[0]
        out = RequestOutput(
            request_id=request.request_id,
            token_ids=best.token_ids,
            finished=True,
            finish_reason=best.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(best.token_ids),
            num_passes=len(best.token_ids),
            beams=beams,
        )
        return self._with_text(request, out)

    def _output(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        out = RequestOutput(
            request_id=request.request_id,
            token_ids=tokens,
            logprobs=list(logprobs) if logprobs is not None and request.params.logprobs is not None else (),
            prompt_logprobs=request.take_prompt_logprobs(),
            finished=request.finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_passes=request.num_passes,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            loaded_from=request.loaded_from if request.finished else (),
        )
        return self._with_text(request, out)

    def _with_text(self, request: Request, out: RequestOutput) -> RequestOutput:
        """The output's text, where this engine applies it; a stop string finishes the request here
        (the tokens a step kept past it are not output)."""
        if self.text is not None and self.text.apply(out):
            del request.output_token_ids[out.num_output_tokens :]
            if request.finished:
                request.finish_reason = out.finish_reason
            else:
                self.scheduler.finish(request.request_id, "stop")
        return out


def _request(request_id: str, token_ids: Sequence[int], params: SamplingParams, num_output: int) -> Request:
    """A request whose last `num_output` of `token_ids` are output it generated before it moved
    here; ValueError if that output already ends it."""
    if num_output and params.num_beams > 1:
        raise ValueError("a beam search request cannot continue from output generated elsewhere")
    if num_output >= params.max_tokens:
        raise ValueError(f"{num_output} tokens already generated reach max_tokens ({params.max_tokens})")
    cut = len(token_ids) - num_output
    return Request(request_id, list(token_ids[:cut]), params, output_token_ids=list(token_ids[cut:]))
