"""Which KV blocks the workers' tiers hold, as their cache events tell it (`KVEvents.tiers`): each
worker's own tiers ("host", "disk") and the shared one every worker loads from ("shared", told by
whichever worker wrote the block; Redis evicts without telling, so those are likely, not certain).
The prefix index (`router.placement.prefix_index`) feeds it and asks it how far past its pool a
worker could load a prompt.

    apply(worker, tiers, snapshot)   a batch's tier blocks; a snapshot replaces the worker's own
    drop(worker)                     its stream broke or it left: its own tiers' entries go
    reach(names, pool, weight)       per worker, the prompt's blocks it holds in its pool plus
                                     those after them it could load, each weighted by what
                                     loading it saves; and what any worker could load from the
                                     shared tier alone

Memory is bounded: at most `max_blocks` names per worker's tier and in the shared tier, the oldest
forgotten first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

SHARED = "shared"


class Tier(Protocol):
    """`cluster.engine.kv_events.TierBlocks`, or the `TierBlocks` message that carries one."""

    @property
    def tier(self) -> str: ...
    @property
    def stored(self) -> Sequence[bytes]: ...
    @property
    def removed(self) -> Sequence[bytes]: ...


class TierIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._own: dict[str, dict[str, collections.OrderedDict[bytes, None]]] = {}  # worker -> tier -> names
        self._holders: dict[bytes, set[str]] = {}  # name -> workers holding it in a tier of their own
        self._shared: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def apply(self, worker: str, tiers: Iterable[Tier], snapshot: bool) -> None:
        if snapshot:
            self.drop(worker)
        for t in tiers:
            if t.tier == SHARED:
                self._apply_shared(t)
                continue
            names = self._own.setdefault(worker, {}).setdefault(t.tier, collections.OrderedDict())
            for name in t.removed:
                if name in names:
                    del names[name]
                    self._unhold(name, worker, t.tier)
            for name in t.stored:
                names[name] = None
                names.move_to_end(name)
                self._holders.setdefault(name, set()).add(worker)
            while len(names) > self.max_blocks:
                self._unhold(names.popitem(last=False)[0], worker, t.tier)

    def drop(self, worker: str) -> None:
        for tier, names in self._own.pop(worker, {}).items():
            for name in names:
                self._unhold(name, worker, tier)

    def reach(
        self, names: Sequence[bytes], pool: dict[str, int], weight: Callable[[str, str], float]
    ) -> tuple[dict[str, float], int]:
        """({worker: the pool blocks `pool` says it holds, plus each block after them it could load
        from its own tiers or the shared one, weighted by `weight(worker, tier)`}, the leading blocks
        the shared tier holds, which any worker could load)."""
        shared_run = 0
        while shared_run < len(names) and names[shared_run] in self._shared:
            shared_run += 1
        candidates = set(pool) | (self._holders.get(names[0], set()) if names else set())
        reach = {}
        for worker in candidates:
            held = pool.get(worker, 0)
            value, own = float(held), self._own.get(worker, {})
            for name in names[held:]:
                tier = next((t for t, entries in own.items() if name in entries), None)
                if tier is None and name in self._shared:
                    tier = SHARED
                if tier is None:
                    break
                value += weight(worker, tier)
            reach[worker] = value
        return reach, shared_run

    def _apply_shared(self, t: Tier) -> None:
        for name in t.removed:
            self._shared.pop(name, None)
        for name in t.stored:
            self._shared[name] = None
            self._shared.move_to_end(name)
        while len(self._shared) > self.max_blocks:
            self._shared.popitem(last=False)

    def _unhold(self, name: bytes, worker: str, tier: str) -> None:
        """`worker`'s `tier` no longer holds `name`: unless another of its tiers does, it is no holder."""
        if any(name in entries for t, entries in self._own.get(worker, {}).items() if t != tier):
            return
        holders = self._holders.get(name)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[name]
