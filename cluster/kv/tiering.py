"""Between an engine's paged pool and its KV tiers (`cluster.kv.tiers`): which blocks go down, and
which prompts wait for a load before they are scheduled.

    tiering = Tiering.build(config, secret, blocks, runner)   None when `cache.tiers` names no tier
    tiering.park(request) -> bool   on arrival, under the engine's lock: True when the tiers may hold
                                    more of its prompt than the pool does; it waits here while that
                                    run loads, on the tiers' loader thread, off the step path
    tiering.ready() -> [Request]    parked requests whose load ended, with `request.loaded` (None on
                                    a miss): the engine hands them to its scheduler
    tiering.move()                  before each step runs and after it: the blocks the pool let go
                                    (or computed) are copied out for the tiers, then the loaded
                                    ones copied in
    tiering.note_pass(plan, s)      after each pass: what computing a prompt's block costs here
    tiering.wait(timeout_s)         an engine with only parked requests waits for a load here

A tier is loaded from only while a block from it has cost less than computing one (each tier's
load time and the engine's prefill rate, both measured as they run); a tier that was slower is
still tried one load in `PROBE_EVERY`, so it is seen when it gets faster.
    tiering.close()
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.config import CacheConfig, TiersConfig
from cluster.engine.block_manager import BlockManager, Loaded
from cluster.engine.block_names import chain, model_root, request_root
from cluster.engine.changes import TierCounts
from cluster.engine.kv_events import KVJournal
from cluster.engine.request import Request, StepPlan
from cluster.kv.stores import DiskStore, HostStore, RedisStore, Store
from cluster.kv.tiers import Tiers
from cluster.kv.wire import model_fingerprint
from cluster.model.attention import KV_SCALE_BYTES, dequantize_rows, quantize_rows

GIB = 1 << 30
PROBE_EVERY = 32
PARKED_WAIT_S = 0.005  # an engine whose only requests wait on KV loads sleeps this long a turn


@dataclass(frozen=True)
class Pool:
    """An engine's block manager, named from its model's fingerprint, with the journal its watch
    streams read and, when `cache.tiers` names a tier, spilling to it."""

    fingerprint: bytes
    journal: KVJournal
    blocks: BlockManager


def named_pool(model: torch.nn.Module, arch: object, cache: CacheConfig, num_blocks: int) -> Pool:
    fingerprint = model_fingerprint(model, arch)  # once, at load
    root = model_root(fingerprint)  # every block's name descends from it
    journal = KVJournal(root)
    spill = cache.tiers.write if cache.tiers.enabled else None
    prefix = cache.enable_prefix_caching
    return Pool(
        fingerprint, journal, BlockManager(num_blocks, cache.block_size, cache.watermark, prefix, journal, root, spill)
    )


class BlockCopier(Protocol):
    """`cluster.engine.model_runner.ModelRunner`'s block copies."""

    def read_blocks(self, block_ids: list[int]) -> list[bytes]: ...
    def write_blocks(self, fills: list[tuple[int, bytes]]) -> None: ...
    def kv_layout(self) -> bytes: ...
    @property
    def kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class Int8Rows:
    """A block as the host tier keeps it with `int8`: each (token, head) row of its keys and values
    as int8 values and their float32 scale (`quantize_rows`, the int8 KV cache's own rows)."""

    def __init__(self, dtype: torch.dtype, head_dim: int) -> None:
        self.dtype, self.head_dim = dtype, head_dim

    def encode(self, payload: bytes) -> bytes:
        rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).view(-1, self.head_dim)
        return quantize_rows(rows).numpy().tobytes()

    def decode(self, blob: bytes) -> bytes:
        rows = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(-1, self.head_dim + KV_SCALE_BYTES)
        return dequantize_rows(rows, self.dtype).view(torch.uint8).numpy().tobytes()


def open_stores(config: TiersConfig, secret: str, kv: torch.Tensor) -> list[Store]:
    """The stores `config` names; `kv` is a layer's key cache (its element type and head size)."""
    stores: list[Store] = []
    if config.host is not None:
        int8 = config.host.int8 and kv.dtype != torch.uint8  # an int8 pool's blocks are int8 rows already
        stores.append(HostStore(int(config.host.gib * GIB), Int8Rows(kv.dtype, kv.shape[-1]) if int8 else None))
    if config.disk is not None:
        stores.append(DiskStore(config.disk.path, int(config.disk.gib * GIB)))
    if config.shared is not None:
        s = config.shared
        stores.append(RedisStore(s.url, secret or None, s.timeout_s, s.ttl_s, s.tls_ca))
    return stores


class Tiering:
    def __init__(self, tiers: Tiers, blocks: BlockManager, runner: BlockCopier) -> None:
        self.tiers, self.blocks, self.runner = tiers, blocks, runner
        self.loaded_tokens = 0  # prompt tokens served from the tiers
        self.prefill_rate: float | None = None  # prompt tokens a second, as passes here compute them
        self.passed_over: dict[str, int] = {store.kind: 0 for store in tiers.stores}  # loads judged dearer
        self._fetches = 0
        self._parked: dict[str, tuple[Request, Future, int]] = {}  # id -> (request, its load, first block)
        self._woken = threading.Event()

    @classmethod
    def build(cls, config: TiersConfig, secret: str, blocks: BlockManager, runner: BlockCopier) -> Tiering | None:
        if not config.enabled:
            return None
        stores, layout = open_stores(config, secret, runner.kv_cache[0][0]), runner.kv_layout()
        tiers = Tiers(stores, secret.encode(), layout, retry_after_s=config.retry_after_s, journal=blocks.journal)
        return cls(tiers, blocks, runner)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def __contains__(self, request_id: str) -> bool:
        """Whether a request of this id waits here for its load."""
        return request_id in self._parked

    def park(self, request: Request) -> bool:
        if not request.reuses_cache:
            return False
        tokens = request.all_token_ids
        names = chain(tokens[:-1], self.blocks.block_size, request_root(self.blocks.root, request.scope))  # named once
        first = self.blocks.held_run(names)
        names = names[first:]
        kinds = self._worth_loading() if names else []
        if not kinds or not self.tiers.may_hold(names[0], kinds):
            return False
        load = self.tiers.fetch(names, kinds)
        load.add_done_callback(lambda _: self._woken.set())
        self._parked[request.request_id] = (request, load, first)
        return True

    def ready(self) -> list[Request]:
        done = []
        for request_id, (request, load, first) in list(self._parked.items()):
            if not load.done():
                continue
            del self._parked[request_id]
            request.loaded_at = time.monotonic()
            run = None if load.cancelled() or load.exception() is not None else load.result()
            if run is not None and run.payloads:
                request.loaded = Loaded(first, run.payloads, tuple(run.sources))
            done.append(request)
        return done

    def adapters(self) -> set[str]:
        """The LoRA adapters the parked requests run through."""
        return {request.params.adapter for request, _, _ in self._parked.values()}

    def abort(self, request_id: str) -> Request | None:
        """Takes a parked request out (its load, if still running, is left to end)."""
        entry = self._parked.pop(request_id, None)
        return None if entry is None else entry[0]

    def move(self) -> None:
        spills = self.blocks.take_spills()
        if spills:
            payloads = self.runner.read_blocks([block_id for block_id, _ in spills])
            for (_, name), payload in zip(spills, payloads, strict=True):
                self.tiers.offer(name, payload)
        fills = self.blocks.take_fills()
        if fills:
            self.runner.write_blocks(fills)
            self.loaded_tokens += len(fills) * self.blocks.block_size

    def note_pass(self, plan: StepPlan, seconds: float) -> None:
        """Folds a pass's prompt tokens a second into the prefill rate (a pass of decode rows alone
        tells nothing about it)."""
        tokens = sum(c.num_new for c in plan.chunks if c.num_new > 1)
        if tokens >= self.blocks.block_size and seconds > 0:
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else 0.8 * self.prefill_rate + 0.2 * rate

    def _worth_loading(self) -> list[str]:
        """The tiers a load may read: each whose block has cost less than computing one, or not yet
        measured, or due for a probe."""
        self._fetches += 1
        kinds = []
        for kind, stats in self.tiers.stats.items():
            cheaper = self.prefill_rate is None or stats.hits == 0
            cheaper = cheaper or stats.load_seconds / stats.hits < self.blocks.block_size / self.prefill_rate
            if cheaper or self._fetches % PROBE_EVERY == 0:
                kinds.append(kind)
            else:
                self.passed_over[kind] += 1
        return kinds

    def counts(self) -> tuple[TierCounts, ...]:
        """Each tier's counts, with what a block loaded from it has cost against computing one."""
        computing = None if self.prefill_rate is None else self.blocks.block_size / self.prefill_rate
        return tuple(
            dataclasses.replace(c, cost=c.load_seconds / c.hits / computing) if computing and c.hits else c
            for c in self.tiers.counts()
        )

    def wait(self, timeout_s: float) -> None:
        self._woken.wait(timeout_s)
        self._woken.clear()

    def close(self) -> None:
        self.tiers.close()
