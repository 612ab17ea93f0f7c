"""The prefill worker's engine: prompts in, first tokens out, KV caches shipped to decode workers.

Lifecycle of a request:

    add_request(id, prompt, params, sender)   WAITING   queued for a forward pass
    step()                                    RUNNING   its prompt (and the output of a request moved
                                                        here) runs, in chunks if it is long; on
                                                        the last chunk the transfer header goes out
                                                        before the pass, each group of layers as soon
                                                        as the pass finishes them, and the commit
                                                        with the sampled first token after it
                                              LEASED    its blocks stay in the cache until the decode
                                                        worker acknowledges, or `lease_s` passes
    release                                             blocks freed into the prefix cache

`step()` is the same three calls as on a decode worker (schedule, execute, update) plus shipping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cluster.config import CacheConfig, LoraConfig, SchedulerConfig, TransferConfig
from cluster.engine.adapters import Adapters, resolve
from cluster.engine.changes import AdapterState, Changes, TierCounts
from cluster.engine.model_runner import ModelRunner
from cluster.engine.request import Request, SamplingParams, ScheduledChunk, TokenLogprob, UnknownAdapter
from cluster.engine.sampler import Sampler, SampleRow
from cluster.engine.structured import Grammars
from cluster.kv.tiering import PARKED_WAIT_S, Tiering, named_pool
from cluster.kv.transport import KVSender, SendStream
from cluster.kv.wire import DTYPE_NAMES, KVHeader, adapter_fingerprint, make_chunk
from cluster.model.causal_lm import CausalLM
from cluster.model.lora import Adapter
from prefill_worker.scheduler import PrefillScheduler


@dataclass
class PrefillOutput:
    request_id: str
    first_token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache (its tiers' included)
    transfer: SendStream
    prompt_logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)  # when asked for
    loaded_from: tuple[str, ...] = ()  # the tier of each prompt block loaded from the KV tiers


@dataclass(frozen=True)
class PrefillStats:
    waiting: int
    prefilling: int
    leased: int
    queued_tokens: int
    computed_tokens: int
    cached_tokens: int
    prefix_hit_rate: float  # share of full prompt blocks found in the prefix cache
    free_blocks: int
    total_blocks: int
    tiers: tuple[TierCounts, ...] = ()  # the KV tiers', when `cache.tiers` names any
    adapters: tuple[AdapterState, ...] = ()  # with LoRA
    max_loras: int = 0  # adapters its slots hold at once


@dataclass
class _Job:
    request: Request
    sender: KVSender
    capability: bytes = b""
    skip: int = 0  # leading tokens whose KV the decode worker holds: not shipped
    stream: SendStream | None = None
    lease_deadline: float = 0.0


class PrefillEngine:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        num_blocks: int,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        grammars: Grammars | None = None,
        secret: str = "",  # the cluster's: it seals the KV tiers' entries
        lora: LoraConfig | None = None,  # LoRA adapters' slots; None serves the base model only
    ) -> None:
        self.model = model
        self.adapters = Adapters.build(model, lora) if lora is not None else None
        self.grammars = grammars  # structured output; None refuses constrained requests
        self.transfer = transfer
        self.eos_token_ids = tuple(eos_token_ids)
        self.clock = clock
        self.num_blocks = num_blocks
        pool = named_pool(model, model.arch, cache, num_blocks)
        self.fingerprint, blocks = pool.fingerprint, pool.blocks
        self.kv_journal = pool.journal  # what the prefix cache holds, for the routers' watch streams
        self.scheduler = PrefillScheduler(scheduler, blocks, lora.max_loras if lora is not None else 0)
        self.runner = ModelRunner(
            model, num_blocks, cache.block_size, Sampler(model.arch.vocab_size, seed), kv_dtype=cache.kv_dtype,
            adapters=self.adapters,
        )  # fmt: skip
        self.tiering = Tiering.build(cache.tiers, secret, blocks, self.runner)  # None without KV tiers
        layerwise = transfer.layerwise
        self.layerwise = layerwise if layerwise is not None else self.runner.device.type == "cuda"
        self._jobs: dict[str, _Job] = {}
        # Called (on the transfer's own thread) as each transfer ends: its request id and stream.
        self.on_transfer_end: Callable[[str, SendStream], None] | None = None
        self.changes = Changes()  # bumped after every change of what it holds; its loop and Watch wait on it
        self._stats = self._snapshot()

    def close(self) -> None:
        """Stops the threads the engine started (its KV tiers', its masks'), once its loop has ended."""
        if self.tiering is not None:
            self.tiering.close()
        if self.grammars is not None:
            self.grammars.close()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self.scheduler.held) or bool(self.tiering and self.tiering.parked)

    @property
    def has_work(self) -> bool:
        """Whether a step has anything to do: prompts to compute, or prompts whose KV is loading."""
        return self.scheduler.has_work or bool(self.tiering and self.tiering.parked)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.config

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        sender: KVSender,
        capability: bytes = b"",
        output_token_ids: Sequence[int] = (),
        decode_cached_tokens: int = 0,
    ) -> None:
        """Queues a prompt whose KV goes to the decode worker behind `sender` (with the router's
        `capability` for the transfer), after it the output a request moved here already generated
        (its KV travels too, and the token sampled here is output index `len(output_token_ids)`);
        `decode_cached_tokens` leading tokens, whole blocks the decode worker's cache holds, are not
        shipped. Raises ValueError if it can never run."""
        if request_id in self._jobs:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model.arch.vocab_size
        if any(not 0 <= t < vocab for t in (*prompt, *output_token_ids)):
            raise ValueError(f"prompt and output token ids must be in [0, {vocab})")
        if len(output_token_ids) >= params.max_tokens:
            raise ValueError(f"{len(output_token_ids)} tokens already generated reach max_tokens ({params.max_tokens})")
        block = self.scheduler.blocks.block_size
        total = len(prompt) + len(output_token_ids)
        if decode_cached_tokens % block or not 0 <= decode_cached_tokens < total:
            raise ValueError(f"decode_cached_tokens={decode_cached_tokens}: whole {block}-token blocks below {total}")
        request = Request(request_id, list(prompt), params, output_token_ids=list(output_token_ids))
        resolve(self.adapters, request)
        if params.structured is not None:  # the first token is sampled under the constraint
            if self.grammars is None:
                raise ValueError("structured output is not available on this worker (no tokenizer)")
            request.matcher = self.grammars.matcher(params.structured, request.output_token_ids)
        if self.tiering is None or not self.tiering.park(request):  # parked: its KV loads first
            self.scheduler.add(request)
        self._jobs[request_id] = _Job(request, sender, capability, skip=decode_cached_tokens)
        self._changed()

    def abort(self, request_id: str) -> bool:
        job = self._jobs.pop(request_id, None)
        if job is None:
            return False
        if job.stream is not None:
            job.stream.abort()
        found = self.scheduler.abort(request_id) or (
            self.tiering is not None and self.tiering.abort(request_id) is not None
        )
        self._changed()
        return found

    def abort_all(self) -> list[str]:
        """Aborts every request here (a failed pass lost them all); their ids."""
        request_ids = list(self._jobs)
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def step(self) -> list[PrefillOutput]:
        self.poll_leases()
        tiering = self.tiering
        for request in tiering.ready() if tiering is not None else ():
            self.scheduler.add(request)
        plan = self.scheduler.schedule()
        if plan.empty:
            if tiering is not None and tiering.parked:
                tiering.wait(PARKED_WAIT_S)  # nothing to run until a load ends
            return []
        if tiering is not None:
            tiering.move()  # evicted blocks out, loaded blocks in, before the pass
        finishing = [c for c in plan.chunks if c.samples]
        for c in finishing:
            self._jobs[c.request.request_id].stream = self._open(c.request)
        ship = self._shipper(finishing)
        masks = None
        if self.grammars is not None and (work := [(i, c.request.matcher, ()) for i, c in enumerate(finishing)
                                                   if c.request.matcher is not None]):  # fmt: skip
            masks = self.grammars.masks(work)  # beside the pass
        rows = [self._row(c.request) for c in finishing]
        started = time.perf_counter()
        result = self.runner.execute(plan, rows, ship if self.layerwise else None, masks)
        if tiering is not None:
            tiering.note_pass(plan, time.perf_counter() - started)
        if not self.layerwise:
            for layer in range(self.model.arch.num_layers):
                ship(layer)
        outputs = []
        now = self.clock()
        for i, request in enumerate(self.scheduler.update(plan)):
            job = self._jobs[request.request_id]
            assert job.stream is not None
            top = result.top_logprobs[i] if result.top_logprobs is not None else []
            logprob = (
                result.logprobs[i] if result.logprobs is not None and request.params.logprobs is not None else None
            )
            job.stream.commit(result.token_ids[i], logprob, tuple(top))
            job.lease_deadline = now + self.transfer.lease_s
            logprob = result.logprobs[i] if result.logprobs is not None else None
            top = result.top_logprobs[i] if result.top_logprobs is not None else []
            outputs.append(
                PrefillOutput(
                    request.request_id, result.token_ids[i], logprob, top,
                    request.num_prompt_tokens, request.num_cached_tokens, job.stream,
                    request.take_prompt_logprobs(), request.loaded_from,
                )
            )  # fmt: skip
        if tiering is not None:
            tiering.move()  # blocks computed by the pass, when they are written through
        if self.adapters is not None and self.adapters.retiring:
            self.adapters.sweep((job.request.params.adapter for job in self._jobs.values()), self.clock())
        self._changed()
        return outputs

    def load_adapter(self, adapter: Adapter) -> None:
        """Serves `adapter` (read and checked by the caller); ValueError for a name in use."""
        if self.adapters is None:
            raise ValueError("this worker serves no LoRA adapters (lora is not configured)")
        self.adapters.add(adapter)
        self._changed()

    def unload_adapter(self, name: str) -> None:
        """Refuses new requests through `name` from now on; those in flight finish first."""
        if self.adapters is None:
            raise UnknownAdapter(name)
        self.adapters.remove(name, self.clock())
        self.adapters.sweep((job.request.params.adapter for job in self._jobs.values()), self.clock())
        self._changed()

    def poll_leases(self) -> int:
        """Releases the blocks of transfers that finished (acknowledged or failed) or outlived their lease."""
        now, released = self.clock(), 0
        for request_id in list(self.scheduler.held):
            job = self._jobs[request_id]
            assert job.stream is not None
            if not job.stream.finished and now < job.lease_deadline:
                continue
            if not job.stream.finished:
                job.stream.abort()  # the decode worker vanished: stop waiting for it
            self.scheduler.release(request_id)
            del self._jobs[request_id]
            released += 1
        if released:
            self._changed()
        return released

    def stats(self) -> PrefillStats:
        """The load as of the last change: one consistent moment, read from any thread without the
        lock its changes are made under."""
        return self._stats

    def _changed(self) -> None:
        """Publishes the load as it is now and wakes whoever waits for a change."""
        self._stats = self._snapshot()
        self.changes.bump()

    def _snapshot(self) -> PrefillStats:
        s, blocks = self.scheduler, self.scheduler.blocks
        return PrefillStats(
            waiting=len(s.waiting),
            prefilling=len(s.prefilling),
            leased=len(s.held),
            queued_tokens=s.queued_tokens,
            computed_tokens=s.computed_tokens,
            cached_tokens=s.cached_tokens,
            prefix_hit_rate=blocks.prefix_hits / blocks.prefix_queries if blocks.prefix_queries else 0.0,
            tiers=self.tiering.counts() if self.tiering is not None else (),
            adapters=self.adapters.states() if self.adapters is not None else (),
            max_loras=self.adapters.max_loras if self.adapters is not None else 0,
            free_blocks=blocks.num_free_blocks,
            total_blocks=blocks.num_blocks,
        )

    # -- internals ---------------------------------------------------------------------------------

    def _open(self, request: Request) -> SendStream:
        arch = self.model.arch
        header = KVHeader(
            request_id=request.request_id,
            fingerprint=adapter_fingerprint(self.fingerprint, request.adapter),
            dtype=DTYPE_NAMES[self.runner.kv_cache[0][0].dtype],  # the cache's rows travel as they are
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            block_size=self.scheduler.blocks.block_size,
            token_ids=tuple(request.all_token_ids),
            sampling=request.params,
            capability=self._jobs[request.request_id].capability,
            num_output_tokens=len(request.output_token_ids),
            first_position=self._jobs[request.request_id].skip,
        )
        stream = self._jobs[request.request_id].sender.open(header)
        if self.on_transfer_end is not None:
            on_end = self.on_transfer_end
            stream.when_finished(lambda s: on_end(request.request_id, s))
        return stream

    def _shipper(self, finishing: list[ScheduledChunk]) -> Callable[[int], None]:
        """The per-layer hook: once the last layer of a chunk group is done, gathers each finishing
        prompt's keys and values for those layers out of the paged cache and sends them."""
        per_chunk = self.transfer.layers_per_chunk
        num_layers = self.model.arch.num_layers
        device = self.runner.device
        tables = [torch.tensor(c.block_table, dtype=torch.long, device=device) for c in finishing]

        def ship(layer: int) -> None:
            if (layer + 1) % per_chunk and layer != num_layers - 1:
                return
            first = layer - (layer % per_chunk)
            for c, table in zip(finishing, tables, strict=True):
                n, skip = c.request.num_tokens, self._jobs[c.request.request_id].skip
                keys, values = [], []
                for i in range(first, layer + 1):
                    k_cache, v_cache = self.runner.kv_cache[i]
                    keys.append(k_cache[table].flatten(0, 1)[skip:n])  # [n - skip, kv_heads, hd]
                    values.append(v_cache[table].flatten(0, 1)[skip:n])
                stream = self._jobs[c.request.request_id].stream
                assert stream is not None
                stream.send(make_chunk(first, torch.stack(keys), torch.stack(values)))

        return ship

    def _row(self, request: Request) -> SampleRow:
        params = request.params
        suppressed: tuple[int, ...] = ()
        if len(request.output_token_ids) < params.min_tokens:
            suppressed = (*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids))
        return SampleRow(params, request.prompt_token_ids, request.output_token_ids, suppressed)
