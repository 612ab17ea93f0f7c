"""Which workers hold which KV blocks, as their own cache events tell it: a router's map from a
block's name (`cluster.engine.block_names`) to the workers whose prefix cache holds that block.

Lifecycle of a worker's entries:

    apply(worker, batch)   a snapshot replaces them; events (stored, removed) change them, in
                           order: a batch that does not follow the last one (a gap) is refused,
                           and the caller resynchronises (a new watch stream starts with a snapshot)
    drop(worker)           its stream broke or it left: its entries go at once
    roots(scope)           the roots of a request's names, one per model the workers reported
    match(names)           per worker, how many of the prompt's leading blocks it holds

Memory is bounded: at most `max_blocks` distinct blocks, the least recently stored or matched
forgotten first (about 200 bytes a block: the name, a bit mask of holders, the LRU order and each
holder's own set). A lookup costs O(the prompt's blocks). Each worker's snapshot names its model's
root; workers of one model share it, so a prompt is named once.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Protocol

from cluster.engine.block_names import BASE, Scope, request_root
from router.placement.tier_index import Tier, TierIndex


class Batch(Protocol):
    """`cluster.engine.kv_events.KVBatch`, or the `KVEvents` message that carries one."""

    @property
    def first(self) -> int: ...
    @property
    def last(self) -> int: ...
    @property
    def stored(self) -> Sequence[bytes]: ...
    @property
    def removed(self) -> Sequence[bytes]: ...
    @property
    def snapshot(self) -> bool: ...
    @property
    def root(self) -> bytes: ...
    @property
    def tiers(self) -> Iterable[Tier]: ...


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self.evicted = 0  # blocks forgotten to stay within max_blocks
        self._holders: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # name -> holders, LRU first
        self._blocks: dict[str, set[bytes]] = {}  # worker -> the names it holds
        self._roots: dict[str, bytes] = {}  # worker -> its model's root, from its last snapshot
        self._bit: dict[str, int] = {}  # worker -> its bit in the masks
        self._names: dict[int, str] = {}  # bit -> worker
        self._cursor: dict[str, int] = {}  # worker -> the last event applied
        self.tiers = TierIndex(max_blocks)  # what the workers' KV tiers hold

    def __len__(self) -> int:
        """Distinct blocks held by any worker."""
        return len(self._holders)

    def apply(self, worker: str, batch: Batch) -> bool:
        """Applies one batch of `worker`'s events; False (nothing applied) on a gap."""
        if batch.snapshot:
            self.drop(worker)
            self._roots[worker] = batch.root
        elif self._cursor.get(worker) != batch.first - 1:
            return False
        else:
            for name in batch.removed:
                self._remove(worker, name)
        for name in batch.stored:
            self._add(worker, name)
        self.tiers.apply(worker, batch.tiers, batch.snapshot)
        self._cursor[worker] = batch.last
        return True

    def drop(self, worker: str) -> None:
        bit = self._bit.pop(worker, None)
        self._cursor.pop(worker, None)
        self._roots.pop(worker, None)
        self.tiers.drop(worker)
        if bit is None:
            return
        del self._names[bit]
        for name in self._blocks.pop(worker):
            mask = self._holders[name] & ~(1 << bit)
            if mask:
                self._holders[name] = mask
            else:
                del self._holders[name]

    def roots(self, scope: Scope = BASE) -> set[bytes]:
        """The roots a request in `scope` (its adapter, its `cache_salt`) has under each model the workers
        reported: one when they serve one model. `block_names.chain` names a prompt's blocks from each."""
        return {request_root(root, scope) for root in self._roots.values()}

    def match(self, names: Sequence[bytes]) -> dict[str, int]:
        """For each worker holding the prompt's first block, how many leading blocks it holds."""
        matched: dict[str, int] = {}
        alive, n = -1, 0  # the workers holding every block so far (a mask), and how many blocks
        for name in names:
            mask = self._holders.get(name, 0) & alive
            if not mask:
                break
            self._holders.move_to_end(name)
            if n and mask != alive:
                matched.update((self._names[bit], n) for bit in _bits(alive & ~mask))
            alive, n = mask, n + 1
        if n:
            matched.update((self._names[bit], n) for bit in _bits(alive))
        return matched

    def blocks_of(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    # -- internals ---------------------------------------------------------------------------------

    def _add(self, worker: str, name: bytes) -> None:
        bit = self._bit.get(worker)
        if bit is None:
            bit = next(b for b in range(len(self._names) + 1) if b not in self._names)
            self._bit[worker], self._names[bit] = bit, worker
            self._blocks[worker] = set()
        self._holders[name] = self._holders.get(name, 0) | (1 << bit)
        self._holders.move_to_end(name)
        self._blocks[worker].add(name)
        while len(self._holders) > self.max_blocks:
            old, mask = self._holders.popitem(last=False)
            for b in _bits(mask):
                self._blocks[self._names[b]].discard(old)
            self.evicted += 1

    def _remove(self, worker: str, name: bytes) -> None:
        bit = self._bit.get(worker)
        if bit is None or name not in self._blocks[worker]:
            return
        self._blocks[worker].discard(name)
        mask = self._holders[name] & ~(1 << bit)
        if mask:
            self._holders[name] = mask
        else:
            del self._holders[name]


def _bits(mask: int) -> list[int]:
    bits = []
    while mask:
        low = mask & -mask
        bits.append(low.bit_length() - 1)
        mask ^= low
    return bits
