"""The decode engine in one process: `add_request`, `abort`, `step()`, and an asyncio front.

    engine.add_request(id, prompt_token_ids, params)
    while engine.has_unfinished:
        for out in engine.step():   # schedule -> execute -> update -> detokenise
            ...

`step()` is three calls: the scheduler plans, the runner executes, the scheduler applies the
samples. The engine adds what a client sees: text deltas, stop strings, logprobs, and
`RequestOutput`s. Aborting a request frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from cluster.block_manager import BlockManager
from cluster.config import CacheConfig, SchedulerConfig
from cluster.model import CausalLM
from cluster.model_runner import ModelRunner, num_kv_blocks
from cluster.request import Request, SamplingParams
from cluster.sampler import Sampler, SampleRow
from decode_worker.compiled import CompiledDecode
from decode_worker.detokenizer import Decoder, IncrementalDetokenizer
from decode_worker.scheduler import Scheduler


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new this step
    text: str  # new this step
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class _Stream:
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None


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
    ) -> None:
        self.num_blocks = num_kv_blocks(model, cache)
        blocks = BlockManager(self.num_blocks, cache.block_size, cache.watermark, cache.enable_prefix_caching)
        max_len = min(max_model_len or model.arch.max_position_embeddings, model.arch.max_position_embeddings)
        self.scheduler = Scheduler(scheduler, blocks, eos_token_ids, max_len)
        sampler = Sampler(model.arch.vocab_size, seed)
        compiled = (
            CompiledDecode(model, compile_buckets, cache.block_size, self.num_blocks) if compile_buckets else None
        )
        self.runner = ModelRunner(model, self.num_blocks, cache.block_size, sampler, compiled)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs = scheduler.max_num_seqs
        self._streams: dict[str, _Stream] = {}
        # Steps and KV-transfer reservations arrive on different threads; the scheduler and block
        # manager see one at a time.
        self.lock = threading.Lock()
        self._reserved: set[str] = set()  # request ids holding blocks for a KV transfer in flight
        self._pending: list[RequestOutput] = []  # first tokens of admitted transfers, out with the next step

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    @property
    def kv_cache(self):  # type: ignore[no-untyped-def]
        return self.runner.kv_cache

    # -- KV transfer: reserve -> (the transport writes the cache) -> admit | release ---------------

    def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> tuple[list[int], int]:
        """Blocks for a prompt whose KV will arrive by transfer: (block table, leading tokens already
        in this worker's prefix cache). Raises KeyError for an id in use, ValueError for a request
        that can never run here, MemoryError when it does not fit now."""
        request = Request(request_id, list(prompt_token_ids), params)
        with self.lock:
            if request_id in self._reserved or request_id in self.scheduler.requests:
                raise KeyError(f"request id {request_id!r} is already in use on this worker")
            self.scheduler.check(request)
            blocks = self.scheduler.blocks
            if len(self.scheduler.running) + len(self._reserved) >= self.max_num_seqs:
                raise MemoryError(f"the running batch is full ({self.max_num_seqs} sequences)")
            if not blocks.can_allocate(request.prompt_token_ids):
                raise MemoryError(
                    f"{blocks.num_free_blocks} free KV blocks are not enough for {len(prompt_token_ids)} tokens"
                )
            cached = blocks.allocate(request_id, request.prompt_token_ids)
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
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        first_token: int,
        logprob: tuple[float, list[tuple[int, float]]] | None = None,
    ) -> None:
        """Puts a reserved sequence whose KV has fully landed into the running batch."""
        request = Request(request_id, list(prompt_token_ids), params)
        with self.lock:
            if request_id not in self._reserved:
                raise KeyError(f"no reservation for request {request_id!r}")
            self._reserved.discard(request_id)
            self.scheduler.admit(request, first_token)
            stream = self._open_stream(request)
            if stream.generator is not None and not params.greedy:
                self.runner.sampler.skip(stream.generator)
            self._pending.append(self._output(request, first_token, logprob))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Queues a request; raises ValueError (nothing queued) if it can never run here."""
        request = Request(request_id, list(prompt_token_ids), params)
        with self.lock:
            if request_id in self._reserved:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.scheduler.add(request)
            self._open_stream(request)

    def _open_stream(self, request: Request) -> _Stream:
        params = request.params
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop)
        stream = self._streams[request.request_id] = _Stream(request, detok, generator)
        return stream

    def abort(self, request_id: str) -> bool:
        with self.lock:
            self._streams.pop(request_id, None)
            self._pending = [out for out in self._pending if out.request_id != request_id]
            return self.scheduler.abort(request_id) is not None

    def step(self) -> list[RequestOutput]:
        with self.lock:
            outputs, self._pending = self._pending, []
            return outputs + self._step()

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        rows = [self._row(c.request) for c in plan.chunks if c.samples]
        result = self.runner.execute(plan, rows)
        sampling = [c.request.request_id for c in plan.chunks if c.samples]
        sampled = dict(zip(sampling, result.token_ids, strict=True))
        logprobs = {}
        if result.logprobs is not None:
            for i, rid in enumerate(sampling):
                logprobs[rid] = (result.logprobs[i], result.top_logprobs[i])  # type: ignore[index]
        outputs = []
        for request in self.scheduler.update(plan, sampled):
            outputs.append(self._output(request, sampled[request.request_id], logprobs.get(request.request_id)))
        return outputs

    def _row(self, request: Request) -> SampleRow:
        params = request.params
        suppressed: tuple[int, ...] = ()
        if len(request.output_token_ids) < params.min_tokens:
            suppressed = (*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids))
        generator = self._streams[request.request_id].generator
        return SampleRow(params, request.prompt_token_ids, request.output_token_ids, generator, suppressed)

    def _output(self, request: Request, token: int, logprob) -> RequestOutput:  # type: ignore[no-untyped-def]
        stream = self._streams[request.request_id]
        text = stream.detokenizer.add(token)
        if stream.detokenizer.stopped and not request.finished:
            self.scheduler.finish(request.request_id, "stop")
        if request.finished:
            text += stream.detokenizer.flush()
            del self._streams[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            token_ids=[token],
            text=text,
            logprobs=[(logprob[0], logprob[1])] if logprob is not None and request.params.logprobs is not None else [],
            finished=request.finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
        )


class AsyncEngine:
    """One async iterator per request over an `Engine` stepped in a worker thread.

    A lock keeps the engine to one thread at a time: adds happen between steps, and aborts are
    applied before the next step. Leaving the iterator early (a cancelled client) aborts the
    request and frees its blocks. If a step fails, every open iterator raises the error.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._pending_aborts: list[str] = []
        self._loop_task: asyncio.Task[None] | None = None

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        async with self._lock:
            self.engine.add_request(request_id, prompt_token_ids, params)
            self._queues[request_id] = queue
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._pending_aborts.append(request_id)
                self._wake.set()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending_aborts or self.engine.has_unfinished:
                async with self._lock:
                    for rid in self._pending_aborts:
                        self.engine.abort(rid)
                    self._pending_aborts.clear()
                    try:
                        outputs = await asyncio.to_thread(self.engine.step)
                    except Exception as e:  # a failed step fails every open request, loudly
                        for rid, queue in list(self._queues.items()):
                            self.engine.abort(rid)
                            queue.put_nowait(e)
                        continue
                for out in outputs:
                    if (queue := self._queues.get(out.request_id)) is not None:
                        queue.put_nowait(out)
