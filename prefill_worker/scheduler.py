"""Prefill scheduling: waiting prompts batched into forward passes up to a token budget. Pure Python.

    plan = scheduler.schedule()     # prompts, or chunks of long ones, up to max_num_batched_tokens
    done = scheduler.update(plan)   # counts computed tokens; prompts whose last chunk ran are done
    scheduler.release(request_id)   # once the KV transfer is acknowledged or its lease expired

A request moved here after a failure comes with the output it already generated: its KV is
computed like the prompt's (what a request's computed tokens catch up with is all its tokens).
A prompt holds its blocks from admission until `release`: while its KV travels to a decode worker
it must stay in the cache. Released blocks keep their prefix hashes (`BlockManager`), so a later
prompt sharing a prefix computes only its suffix; they are evicted least recently used once fresh
blocks run out. Prompts wait (in arrival order) while the cache is full; nothing is dropped.
"""

from __future__ import annotations

from collections import deque

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, ScheduledChunk, Status, StepPlan, adapters_fit


class PrefillScheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_adapters: int = 0) -> None:
        self.config = config
        self.blocks = blocks
        self.max_adapters = max_adapters  # distinct LoRA adapters one pass may run (the worker's slots)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not yet fully computed
        self.held: dict[str, Request] = {}  # prompt computed, blocks kept until `release`
        self.computed_tokens = 0  # prompt tokens run through the model
        self.cached_tokens = 0  # prompt tokens served by the prefix cache

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling)

    @property
    def queued_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in (*self.waiting, *self.prefilling))

    def add(self, request: Request) -> None:
        rid = request.request_id
        if any(rid == r.request_id for r in self.waiting) or rid in self.blocks or rid in self.held:
            raise ValueError(f"request id {rid!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        usable = (self.blocks.num_blocks - self.blocks.watermark_blocks) * self.blocks.block_size
        if request.num_tokens > usable:
            raise ValueError(f"prompt ({request.num_tokens} tokens) exceeds this worker's KV cache ({usable})")
        request.status = Status.WAITING
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        chunks = []
        for request in self.prefilling:
            if budget == 0:
                break
            chunks.append(self._chunk(request, budget))
            budget -= chunks[-1].num_new
        while self.waiting and budget > 0 and len(self.prefilling) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.blocks.can_allocate(request.all_token_ids, request.reuses_cache, request.scope):
                break
            if not adapters_fit(self.prefilling, request, self.max_adapters):
                break  # its adapter waits for a slot: the batch's adapters fill them
            scope, loaded, request.loaded = request.scope, request.loaded, None
            cached = self.blocks.allocate(
                request.request_id, request.all_token_ids, request.reuses_cache, scope, loaded
            )
            request.loaded_from = self.blocks.last_filled
            request.num_computed_tokens = request.num_cached_tokens = cached
            self.cached_tokens += cached
            request.status = Status.RUNNING
            self.waiting.popleft()
            self.prefilling.append(request)
            chunks.append(self._chunk(request, budget))
            budget -= chunks[-1].num_new
        return StepPlan(tuple(chunks))

    def update(self, plan: StepPlan) -> list[Request]:
        """Counts the plan's computed tokens; returns the requests whose prompt is now complete."""
        done = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.status is not Status.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = end = chunk.start + chunk.num_new
            self.computed_tokens += chunk.num_new
            self.blocks.mark_computed(request.request_id, request.token_ids(0, end))
            if chunk.samples:
                self.prefilling.remove(request)
                self.held[request.request_id] = request
                done.append(request)
        return done

    def release(self, request_id: str) -> None:
        """Frees a completed prompt's blocks (they stay in the prefix cache until evicted)."""
        if self.held.pop(request_id, None) is not None:
            self.blocks.free(request_id)

    def abort(self, request_id: str) -> bool:
        for request in (*self.waiting, *self.prefilling):
            if request.request_id == request_id:
                (self.waiting if request.status is Status.WAITING else self.prefilling).remove(request)
                request.status, request.finish_reason = Status.FINISHED, "abort"
                self.blocks.free(request_id)
                return True
        if request_id in self.held:
            self.release(request_id)
            return True
        return False

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        n = min(request.num_tokens - start, budget)
        table = tuple(self.blocks.block_table(request.request_id))
        return ScheduledChunk(request, start, n, table, samples=start + n == request.num_tokens)
