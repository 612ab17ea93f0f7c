"""Iteration-level scheduling (continuous batching). Pure Python, no torch.

Each step:

    plan = scheduler.schedule()                           # which tokens of which requests run, with block tables
    output = runner.run(plan)                             # the model runs the plan, picks the next tokens
    changed = scheduler.update(plan, output.token_ids)    # counts computed tokens, appends samples, finishes

With speculative decoding, `speculate(plan, drafts)` adds proposed tokens to decode chunks before
the pass, and `update` appends every token the verification kept, then trims the blocks that
held rejected ones. A structured-output request's matcher advances over the tokens `update` (or
`admit`) appends, unless they end the request.

`schedule()` first gives every running request its next tokens (one for a decoding request, a chunk
for one still catching up with its prompt), oldest first, then admits waiting requests in arrival
order while blocks, `max_num_seqs` and the `max_num_batched_tokens` budget allow. No request's
chunk is longer than `long_prefill_chunk`, so a long prompt never stalls running decodes for long.
When a running request cannot get a block, the most recently admitted request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed. Nothing is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, ScheduledChunk, Status, StepPlan, adapters_fit


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        max_adapters: int = 0,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.max_adapters = max_adapters  # distinct LoRA adapters one pass may run (the worker's slots)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._arrivals = 0
        self._chunks_alone_last = False  # the last step ran prompt chunks apart from the decode rows

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check(self, request: Request) -> None:
        """Raises ValueError if `request` could never run here (or its id is taken)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        limit = self.max_model_len
        if limit is not None and request.num_prompt_tokens + request.params.max_tokens > limit:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.params.max_tokens}) "
                f"exceeds the context window ({limit})"
            )
        total = (request.num_prompt_tokens + request.params.max_tokens) * request.params.num_beams
        usable = (self.blocks.num_blocks - self.blocks.watermark_blocks) * self.blocks.block_size
        if total > usable:
            raise ValueError(f"prompt + max_tokens ({total} tokens) exceeds this worker's KV cache ({usable} tokens)")

    def add(self, request: Request) -> None:
        self.check(request)
        request.arrival = self._arrivals
        self._arrivals += 1
        request.status = Status.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def admit(self, request: Request, first_token: int) -> None:
        """Admits a request whose KV (its prompt, and any output it had before it moved here) arrived
        by transfer into blocks it already holds (`blocks.allocate` at reservation), with the
        token the prefill worker sampled."""
        self.check(request)
        request.arrival = self._arrivals
        self._arrivals += 1
        request.status = Status.RUNNING
        request.num_computed_tokens = request.num_tokens
        self.requests[request.request_id] = request
        self.running.append(request)
        self.blocks.mark_computed(request.request_id, request.all_token_ids)
        request.output_token_ids.append(first_token)
        request.num_passes = 1  # the prefill worker's pass gave the first token
        request.first_token_at = time.monotonic()  # here already: a preemption's recompute is not a first pass
        reason = self._stop_reason(request, first_token)
        if reason is not None:
            self._finish(request, reason)
        elif request.matcher is not None:
            request.matcher.consume([first_token])

    def abort(self, request_id: str) -> Request | None:
        """Finishes a request at once and frees its blocks; unknown or finished ids return None."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, "abort")
        return request

    def finish(self, request_id: str, reason: str) -> None:
        """Finishes a running request for a reason found outside (a stop string)."""
        if (request := self.requests.get(request_id)) is not None:
            self._finish(request, reason)

    def schedule(self) -> StepPlan:
        """The next step's plan. With `prefill_apart`, a step that would run prompt chunks beside decode
        rows runs the chunks alone, and the step after it every decode row (with or without chunks):
        a chunk's first token is not held up by the decode rows' share of its pass, and the decode
        rows run at least every other step."""
        apart = self.config.prefill_apart and not self._chunks_alone_last and self._prompts_beside_decodes()
        plan = self._schedule(skip_decode_rows=apart)
        if apart and not plan.chunks and not plan.preempted:  # no chunk could start: decode as usual
            apart, plan = False, self._schedule(skip_decode_rows=False)
        self._chunks_alone_last = apart
        self.stats.num_steps += 1
        return plan

    def _prompts_beside_decodes(self) -> bool:
        running = [r for r in self.running if r.status is Status.RUNNING]
        decoding = [_decode_row(r) for r in running]
        return any(decoding) and (bool(self.waiting) or not all(decoding))

    def _schedule(self, skip_decode_rows: bool) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        chunk_limit = self.config.long_prefill_chunk
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        copies: list[tuple[int, int]] = []
        for request in list(self.running):
            if request.status is not Status.RUNNING or budget == 0 or (skip_decode_rows and _decode_row(request)):
                continue
            start = request.num_computed_tokens
            n = min(request.num_tokens - start, budget, chunk_limit)
            while not self.blocks.can_append(request.request_id, start + n, write_from=start):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                continue
            if (copy := self.blocks.append(request.request_id, start + n, write_from=start)) is not None:
                copies.append(copy)
            chunks.append(self._chunk(request, n))
            budget -= n
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            tokens = request.all_token_ids
            if not self.blocks.can_allocate(tokens, request.reuses_cache, request.scope):
                break
            if not adapters_fit(self.running, request, self.max_adapters):
                break  # its adapter waits for a slot: the batch's adapters fill them
            scope, loaded, request.loaded = request.scope, request.loaded, None
            cached = self.blocks.allocate(request.request_id, tokens, request.reuses_cache, scope, loaded)
            request.loaded_from = request.loaded_from or self.blocks.last_filled  # its first admission's
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached
            request.num_computed_tokens = cached
            request.status = Status.RUNNING
            request.started_at = request.started_at or time.monotonic()
            self.waiting.popleft()
            self.running.append(request)
            n = min(request.num_tokens - cached, budget, chunk_limit)
            chunks.append(self._chunk(request, n))
            budget -= n
        return StepPlan(tuple(chunks), tuple(preempted), tuple(copies))

    # -- beam search: a request's running beams are sequences that share blocks ---------------------

    def fork(self, parent: Request, child_id: str, token: int) -> Request:
        """A running sequence that continues `parent` with `token`, sharing its blocks; it takes
        the parent's place in the running order. `parent`'s KV must be computed through its last token."""
        child = Request(
            child_id, parent.prompt_token_ids, parent.params, parent.arrival, [*parent.output_token_ids, token],
            num_computed_tokens=parent.num_tokens, num_cached_tokens=parent.num_cached_tokens,
            status=Status.RUNNING, group=parent.group,
        )  # fmt: skip
        self.blocks.fork(parent.request_id, child_id)
        self.requests[child_id] = child
        self.running.insert(self.running.index(parent), child)
        return child

    def remove(self, request_id: str) -> None:
        """Drops a request without finishing it (a beam replaced by its continuations): frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self.blocks.free(request_id)
        request.status = Status.FINISHED

    def requeue(self, request: Request) -> None:
        """Puts a request back at the front of the queue (a beam search restarting after preemption)."""
        self.check(request)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        self.requests[request.request_id] = request
        self.waiting.appendleft(request)

    def room(self, request: Request) -> int:
        """Draft tokens `request` could still keep: its output may gain 1 + room more tokens."""
        room = request.params.max_tokens - len(request.output_token_ids) - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - request.num_tokens - 1)
        return max(room, 0)

    def speculate(self, plan: StepPlan, drafts: Mapping[str, Sequence[int]]) -> StepPlan:
        """`plan` with proposed tokens added to its decode chunks, as far as free blocks, the token
        budget and each request's remaining tokens allow. Never preempts: a draft that does not fit
        is shortened or dropped."""
        budget = self.config.max_num_batched_tokens - plan.num_tokens
        chunks = []
        for chunk in plan.chunks:
            request = chunk.request
            draft = drafts.get(request.request_id, ())
            if draft and chunk.samples and chunk.num_new == 1:
                k = max(0, min(len(draft), self.room(request), budget))
                while k and not self.blocks.can_append(request.request_id, request.num_tokens + k):
                    k -= 1
                if k:
                    self.blocks.append(request.request_id, request.num_tokens + k)
                    table = tuple(self.blocks.block_table(request.request_id))
                    chunk = replace(chunk, num_new=1 + k, block_table=table, draft=tuple(draft[:k]))
                    budget -= k
            chunks.append(chunk)
        return StepPlan(tuple(chunks), plan.preempted, plan.copies)

    def update(self, plan: StepPlan, sampled: Mapping[str, Sequence[int]]) -> list[Request]:
        """Applies a step's output: each sampling request's new tokens (one, or with speculation
        the accepted draft tokens and one more), which its matcher, if any, advances over unless
        they end it. Returns the requests that gained a token or finished."""
        changed = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.status is not Status.RUNNING:
                continue  # aborted while the step ran
            end = chunk.start + chunk.num_new - len(chunk.draft)
            reason, kept = None, 0
            if chunk.samples:
                tokens = sampled[request.request_id]
                request.num_passes += 1
                request.num_draft_tokens += len(chunk.draft)
                request.num_accepted_tokens += len(tokens) - 1
                for token in tokens:
                    request.output_token_ids.append(token)
                    kept += 1
                    if (reason := self._stop_reason(request, token)) is not None:
                        break
                if reason is None and request.matcher is not None:
                    request.matcher.consume(tokens)
                changed.append(request)
            # Every kept token but the last was a draft token whose KV this pass computed.
            request.num_computed_tokens = end = end + max(kept - 1, 0)
            if end // self.blocks.block_size > chunk.start // self.blocks.block_size:  # a block filled up
                self.blocks.mark_computed(request.request_id, request.token_ids(0, end))
            if reason is not None:
                self._finish(request, reason)
            elif chunk.draft:
                self.blocks.trim(request.request_id, request.num_tokens)  # blocks of rejected drafts
        return changed

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        table = tuple(self.blocks.block_table(request.request_id))
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, n, table, samples=start + n == request.num_tokens)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            return "stop"
        if num_out >= params.max_tokens:
            return "length"
        if self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: str) -> None:
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        else:
            return
        self.blocks.free(request.request_id)
        request.status = Status.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1


def _decode_row(request: Request) -> bool:
    """Whether `request`'s next pass is one decode row: its last output token, the only one not computed."""
    return bool(request.output_token_ids) and request.num_tokens - request.num_computed_tokens == 1
