"""The workers' loads as their `Worker.Watch` streams push them, kept in the orders placement reads:
choosing workers costs no RPC, and its cost barely grows with the number of workers.

Lifecycle of a worker here:

    update(name, load)   a snapshot: the worker is placeable (unless draining or wedged)
    heard(name)          a heartbeat: the last snapshot still holds
    remove(name)         its stream broke, or discovery lost it: out of placement at once
    suspect(name)        a call to it failed: set aside until it is heard from again (its Watch
                         stream may not have broken yet, and a migrating request must not go back)
    stale                nothing heard for `stale_after_s`: `choose` passes it over and sets it
                         aside; its next heartbeat or snapshot puts it back (an idle worker's load
                         does not change, so a heartbeat alone must be enough)

Decode workers are kept sorted by (running + waiting, -free blocks, name) and prefill workers by
(queued prompt tokens, name), each updated by one bisection when a snapshot arrives; the prefill
ring is rebuilt only when the set of placeable prefill workers changes. `choose` makes the same
choices as `router.placement.placement.choose` over the same loads (a test holds it to that).
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from collections.abc import Callable, Sequence

from tandem.v1 import worker_pb2

from cluster.engine.block_names import Scope, chain
from router.placement.placement import Choice, NoCapacity, NoneInView, Ring, best_holder, cheapest_decode
from router.placement.prefix_index import PrefixIndex
from router.placement.tier_index import SHARED

UNMEASURED_TIER_WEIGHT = 0.5  # a tier block's worth against computing it, before the worker has measured


class LoadIndex:
    def __init__(self, stale_after_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.ring_builds = 0  # how often the prefill ring was built (membership changes, not requests)
        self.prefix: PrefixIndex | None = None  # KV-aware routing: the blocks each worker's cache holds
        self._loads: dict[str, worker_pb2.WorkerLoad] = {}
        self._seen: dict[str, float] = {}  # when anything was last heard from each worker
        self._keys: dict[str, tuple] = {}  # each placeable worker's key in its order
        self._decode: list[tuple[int, int, str]] = []
        self._prefill: list[tuple[int, str]] = []
        self._ring: Ring | None = None
        self._lock = threading.Lock()

    def update(self, name: str, load: worker_pb2.WorkerLoad) -> None:
        with self._lock:
            was_prefill = self._unindex(name)
            self._loads[name], self._seen[name] = load, self.clock()
            if was_prefill != self._index(name, load):
                self._ring = None  # the placeable prefill workers changed

    def heard(self, name: str) -> None:
        with self._lock:
            load = self._loads.get(name)
            if load is None:
                return
            self._seen[name] = self.clock()
            if name not in self._keys and self._index(name, load):  # set aside while it was late
                self._ring = None

    def apply_kv(self, name: str, batch: worker_pb2.KVEvents) -> bool:
        """One batch of a worker's cache events into the prefix index; False on a gap."""
        if self.prefix is None:
            return True
        with self._lock:
            return self.prefix.apply(name, batch)

    def remove(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def suspect(self, name: str) -> None:
        with self._lock:
            if name in self._loads:
                self._set_aside(name)

    def loads(self) -> dict[str, worker_pb2.WorkerLoad]:
        """The fresh snapshots, by worker."""
        with self._lock:
            now = self.clock()
            return {n: load for n, load in self._loads.items() if now - self._seen[n] <= self.stale_after_s}

    def sweep(self) -> list[str]:
        """Sets aside every placeable worker past the staleness bound; returns their names."""
        with self._lock:
            now = self.clock()
            stale = [n for n in self._keys if now - self._seen[n] > self.stale_after_s]
            for name in stale:
                self._set_aside(name)
            return stale

    def choose(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        block_size: int,
        local_prefill_max_tokens: int,
        queue_slack_tokens: int = 2048,
        cache_salt: str = "",
        adapter: str = "",
        adapter_spread: int | None = None,
    ) -> Choice:
        """Where a request runs. With `adapter`, only workers serving it are chosen, a decode worker
        holding it in a slot first, and no more than `adapter_spread` holding it (`_choose_decode`);
        `NoAdapter` when no decode worker serves it."""
        scope = Scope(cache_salt, self.adapter_digest(adapter)) if adapter else Scope(cache_salt)
        chains = self._chains(prompt, block_size, scope)
        with self._lock:
            now = self.clock()
            needed = -(-(len(prompt) + max_tokens) // block_size)
            decode = self._choose_decode(needed, now, adapter, adapter_spread)
            if adapter and not all(_serves(self._loads[n], adapter) for _, n in self._prefill):
                return self._adapter_prefill(decode, adapter, len(prompt), local_prefill_max_tokens)
            pool = {n: held for n, held in self._match(chains).items() if n in self._keys and not self._stale(n, now)}
            matches, shared_run = self._reach(chains, pool)  # with what each could load from the KV tiers
            if matches or shared_run:
                if matches:
                    decode = cheapest_decode(decode, needed, len(prompt) // block_size, self._loads, matches)
                held = pool.get(decode, 0)  # the KV a transfer need not ship: the decode worker's pool's
                reach = matches.get(decode, shared_run * self._weight(decode, SHARED))
                if len(prompt) - reach * block_size <= local_prefill_max_tokens:
                    return Choice(decode, None, "local:cached-prefix" if reach else "local:short-prompt", held)
                prefills = {n: self._loads[n] for n in matches if len(self._keys[n]) == 2}
                holder = best_holder(prefills, matches)
                if holder is not None and self._prefill:
                    shortest = self._prefill[0][1]
                    gap = self._loads[holder].queued_prompt_tokens - self._loads[shortest].queued_prompt_tokens
                    if gap <= queue_slack_tokens:
                        return Choice(decode, holder, "remote:cached-prefix", round(matches[holder]), held)
                    if not self._stale(shortest, now):
                        return Choice(decode, shortest, "remote:shortest-queue", pool.get(shortest, 0), held)
            elif len(prompt) <= local_prefill_max_tokens:
                return Choice(decode, None, "local:short-prompt")
            kept = pool.get(decode, 0)
            while self._prefill:
                shortest = self._prefill[0][1]
                if self._stale(shortest, now):
                    self._set_aside(shortest)
                    continue
                if self._ring is None:
                    self._ring = Ring(sorted(n for _, n in self._prefill))
                    self.ring_builds += 1
                owner = self._ring.owner(prompt[:block_size])
                if self._stale(owner, now):
                    self._set_aside(owner)
                    continue
                gap = self._loads[owner].queued_prompt_tokens - self._loads[shortest].queued_prompt_tokens
                if gap <= queue_slack_tokens:
                    return Choice(decode, owner, "remote:prefix-owner", 0, kept)
                return Choice(decode, shortest, "remote:shortest-queue", 0, kept)
            return Choice(decode, None, "local:no-prefill-worker")

    def choose_random(
        self, prompt: Sequence[int], max_tokens: int, block_size: int, local_prefill_max_tokens: int, rng: random.Random
    ) -> Choice:
        """A baseline to compare placement against (`router.prefix_routing: random`): any fresh
        decode worker with room now (else any that can hold the sequence), any fresh prefill worker."""
        with self._lock:
            now = self.clock()
            needed = -(-(len(prompt) + max_tokens) // block_size)
            seen = [n for _, _, n in self._decode if not self._stale(n, now)]
            if not seen:
                raise NoneInView(f"no decode worker has reported in the last {self.stale_after_s:g} s")
            fresh = [n for n in seen if self._loads[n].total_kv_blocks >= needed]
            if not fresh:
                raise NoCapacity(f"no decode worker can hold {needed} KV blocks")
            roomy = [n for n in fresh if self._loads[n].free_kv_blocks >= needed]
            decode = rng.choice(roomy or fresh)
            if len(prompt) <= local_prefill_max_tokens:
                return Choice(decode, None, "local:short-prompt")
            prefills = [n for _, n in self._prefill if not self._stale(n, now)]
            if not prefills:
                return Choice(decode, None, "local:no-prefill-worker")
            return Choice(decode, rng.choice(prefills), "remote:random")

    def _chains(self, prompt: Sequence[int], block_size: int, scope: Scope) -> list[list[bytes]]:
        """The prompt's block names under each root the workers reported, named outside the lock."""
        if self.prefix is None:
            return []
        with self._lock:
            roots = self.prefix.roots(scope)
        return [chain(prompt, block_size, root) for root in roots]

    # -- internals (under the lock) ----------------------------------------------------------------

    def _reach(self, chains: list[list[bytes]], pool: dict[str, int]) -> tuple[dict[str, float], int]:
        """Per placeable worker, its pool's leading blocks of the prompt plus those after them it could
        load from the KV tiers, each weighted by what loading saves there; and the leading blocks the
        shared tier holds, which any worker could load."""
        reach: dict[str, float] = dict(pool)
        shared_run = 0
        for names in chains:
            found, run = self.prefix.tiers.reach(names, pool, self._weight)  # type: ignore[union-attr]
            for worker, value in found.items():
                if worker in self._keys:
                    reach[worker] = max(value, reach.get(worker, 0.0))
            shared_run = max(shared_run, run)
        return reach, shared_run

    def _weight(self, worker: str, tier: str) -> float:
        """What a block `worker` loads from `tier` saves against computing it: 1 - its measured cost
        there, or `UNMEASURED_TIER_WEIGHT` before it has loaded any."""
        load = self._loads.get(worker)
        cost = load.tier_block_cost.get(tier) if load is not None else None
        return UNMEASURED_TIER_WEIGHT if cost is None else max(0.0, 1.0 - cost)

    def _match(self, chains: list[list[bytes]]) -> dict[str, int]:
        """Per worker, the most leading blocks of the prompt it holds under any root."""
        matches: dict[str, int] = {}
        for names in chains:
            for worker, held in self.prefix.match(names).items():  # type: ignore[union-attr]
                matches[worker] = max(held, matches.get(worker, 0))
        return matches

    def adapter_names(self) -> list[str]:
        """Every LoRA adapter a worker in view serves, sorted."""
        with self._lock:
            return sorted({a.name for load in self._loads.values() for a in load.adapters if not a.retiring})

    def adapter_digest(self, adapter: str) -> bytes:
        """The digest the workers report for `adapter` (its KV's scope); `NoAdapter` if none serves it."""
        with self._lock:
            for load in self._loads.values():
                for a in load.adapters:
                    if a.name == adapter and not a.retiring:
                        return a.digest
        raise NoAdapter(adapter)

    def _choose_decode(self, needed: int, now: float, adapter: str = "", spread: int | None = None) -> str:
        """The lightest decode worker with `needed` blocks free, else the lightest that can hold
        them at all: the first such in the decode order, so usually its first entry. With `adapter`,
        of the workers serving it, one holding it in a slot wins over one with a slot free, and that
        one over one that must write a slot over; the lighter wins within each. Once `spread` workers
        hold it, only they take its requests (waiting there for room)."""
        fallback, stale, fresh, best = None, [], 0, None
        held = spread is not None and sum(_affinity(self._loads[n], adapter) == 0 for _, _, n in self._decode) >= spread
        try:
            for _, _, name in self._decode:
                if self._stale(name, now):
                    stale.append(name)
                    continue
                fresh += 1
                load = self._loads[name]
                if adapter and (not _serves(load, adapter) or (held and _affinity(load, adapter) > 0)):
                    continue  # it does not serve the adapter, or the adapter is held as widely as allowed
                if load.free_kv_blocks >= needed and load.total_kv_blocks >= needed:
                    if not adapter:
                        return name
                    rank = _affinity(load, adapter)
                    if best is None or rank < best[0]:
                        best = (rank, name)
                    if rank == 0:
                        break
                elif fallback is None and load.total_kv_blocks >= needed:
                    fallback = name
        finally:
            for name in stale:
                self._set_aside(name)
        if best is not None:
            return best[1]
        if not fresh:
            raise NoneInView(f"no decode worker has reported in the last {self.stale_after_s:g} s")
        if adapter and fallback is None and not any(_serves(self._loads[n], adapter) for _, _, n in self._decode):
            raise NoAdapter(adapter)
        if fallback is None:
            raise NoCapacity(f"no decode worker can hold {needed} KV blocks")
        return fallback

    def _adapter_prefill(self, decode: str, adapter: str, prompt_len: int, local_max: int) -> Choice:
        """Where a request through an adapter only some prefill workers serve is prefilled: the one
        of them with the shortest queue, or the decode worker itself."""
        if prompt_len > local_max:
            for _, name in self._prefill:
                if _serves(self._loads[name], adapter):
                    return Choice(decode, name, "remote:shortest-queue")
        return Choice(decode, None, "local:adapter" if prompt_len > local_max else "local:short-prompt")

    def _stale(self, name: str, now: float) -> bool:
        return now - self._seen[name] > self.stale_after_s

    def _index(self, name: str, load: worker_pb2.WorkerLoad) -> bool:
        """Puts an unindexed worker in its role's order if it takes requests now; True for a
        prefill worker (the ring's members)."""
        key = _key(load, name)
        if key is None:
            return False
        bisect.insort(self._decode if len(key) == 3 else self._prefill, key)  # type: ignore[arg-type]
        self._keys[name] = key
        return len(key) == 2

    def _unindex(self, name: str) -> bool:
        """Takes a worker out of its order; True if it was a placeable prefill worker."""
        key = self._keys.pop(name, None)
        if key is None:
            return False
        order = self._decode if len(key) == 3 else self._prefill
        del order[bisect.bisect_left(order, key)]
        return len(key) == 2

    def _set_aside(self, name: str) -> None:
        """Out of placement until it is heard from again (its snapshot and prefix blocks kept)."""
        if self._unindex(name):
            self._ring = None

    def _drop(self, name: str) -> None:
        if self.prefix is not None:
            self.prefix.drop(name)  # a worker back from the dead starts again from a snapshot
        self._set_aside(name)
        self._loads.pop(name, None)
        self._seen.pop(name, None)


class NoAdapter(LookupError):
    """No worker in view serves the LoRA adapter a request names."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"no worker serves adapter {self.name!r}"


def _serves(load: worker_pb2.WorkerLoad, adapter: str) -> bool:
    return any(a.name == adapter and not a.retiring for a in load.adapters)


def _affinity(load: worker_pb2.WorkerLoad, adapter: str) -> int:
    """0: `adapter` sits in one of the worker's slots; 1: a slot is free; 2: one must be written over."""
    resident = [a.name for a in load.adapters if a.resident]
    return 0 if adapter in resident else 1 if len(resident) < load.max_loras else 2


def _key(load: worker_pb2.WorkerLoad, name: str) -> tuple | None:
    """A placeable worker's place in its role's order; None for one that takes nothing now."""
    if load.draining or load.wedged:
        return None
    if load.role == "decode":
        return (load.running_seqs + load.waiting_seqs, -load.free_kv_blocks, name)
    if load.role == "prefill":
        return (load.queued_prompt_tokens, name)
    return None
