"""What a worker's prefix cache holds, told as events, so that routers place requests where the KV
already is instead of guessing.

A `KVJournal` records each full block the cache registers (`stored`, by its name: the one
`BlockManager` keys blocks by, which `cluster.engine.block_names.chain` computes from token ids and
the model's root alone) and each one it evicts (`removed`). Every event has a sequence number. A
reader (a router's watch stream) keeps a cursor and asks for what happened since (`since`): a
compact batch, each block's last event only. The journal keeps the last `max_events` events; a
reader that fell further behind gets a snapshot instead, every block held now, and goes on from
there.

    journal.stored(name) / journal.removed(name)   the block manager, on the engine's thread
    journal.stored(name, tier) / ...removed        the KV tiers' writer thread: "host", "disk", "shared"
    batch = journal.since(cursor)                  a watch stream, on its own thread; None: nothing new
    cursor = batch.last                            the next call goes on from here

Routers compute a prompt's names themselves, from the model's root that each snapshot carries.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from cluster.engine.block_names import UNNAMED_MODEL

POOL = ""  # the tier name of the paged pool itself


@dataclass(frozen=True)
class TierBlocks:
    """One KV tier's blocks in a batch: "host" and "disk" are the worker's own, "shared" every
    worker's (Redis evicts without telling, so a reader takes those as likely, not certain)."""

    tier: str
    stored: list[bytes]
    removed: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class KVBatch:
    """Events `first`..`last` (sequence numbers, inclusive), each block's net change in that span;
    or, with `snapshot`, every block held as of `last` (`removed` empty)."""

    first: int
    last: int
    stored: list[bytes]
    removed: list[bytes]
    snapshot: bool = False
    root: bytes = b""  # with `snapshot`: the model root the names descend from
    tiers: tuple[TierBlocks, ...] = ()  # the KV tiers' blocks, as `stored` and `removed` are the pool's


class KVJournal:
    def __init__(self, root: bytes = UNNAMED_MODEL, max_events: int = 65536) -> None:
        self.root = root  # the model's root (`block_names.model_root`), told to readers in snapshots
        self.max_events = max_events
        self.sequence = 0  # the last event's number
        self._held: dict[str, set[bytes]] = {POOL: set()}  # tier ("" for the pool) -> names
        # (name, stored, tier), oldest first
        self._log: collections.deque[tuple[bytes, bool, str]] = collections.deque()
        self._lock = threading.Lock()

    def stored(self, name: bytes, tier: str = POOL) -> None:
        self._record(name, True, tier)

    def removed(self, name: bytes, tier: str = POOL) -> None:
        self._record(name, False, tier)

    def snapshot(self) -> KVBatch:
        with self._lock:
            return self._snapshot()

    def since(self, cursor: int | None) -> KVBatch | None:
        """The events after `cursor` (None: a reader that has nothing yet gets a snapshot), or None
        when there are none."""
        with self._lock:
            if cursor == self.sequence:
                return None
            oldest = self.sequence - len(self._log) + 1
            if cursor is None or cursor + 1 < oldest or cursor > self.sequence:
                return self._snapshot()
            net: dict[tuple[str, bytes], bool] = {}
            for i in range(cursor + 1 - oldest, len(self._log)):
                name, stored, tier = self._log[i]
                net[tier, name] = stored
        changes: dict[str, tuple[list[bytes], list[bytes]]] = {}
        for (tier, name), stored in net.items():
            changes.setdefault(tier, ([], []))[0 if stored else 1].append(name)
        stored, removed = changes.pop(POOL, ([], []))
        tiers = tuple(TierBlocks(tier, *lists) for tier, lists in changes.items())
        return KVBatch(cursor + 1, self.sequence, stored, removed, tiers=tiers)

    def tiers(self) -> list[str]:
        """The tiers (the pool, "", first) that have held anything."""
        with self._lock:
            return list(self._held)

    def held(self, tier: str = POOL) -> set[bytes]:
        """Every block the pool (or `tier`) holds now."""
        with self._lock:
            return set(self._held.get(tier, ()))

    def _snapshot(self) -> KVBatch:
        tiers = tuple(TierBlocks(tier, list(names)) for tier, names in self._held.items() if tier != POOL)
        return KVBatch(self.sequence, self.sequence, list(self._held[POOL]), [], True, self.root, tiers)

    def _record(self, name: bytes, stored: bool, tier: str) -> None:
        with self._lock:
            self.sequence += 1
            held = self._held.get(tier)
            if held is None:
                held = self._held[tier] = set()
            (held.add if stored else held.discard)(name)
            self._log.append((name, stored, tier))
            if len(self._log) > self.max_events:
                self._log.popleft()


def replay(journal: KVJournal, batch: KVBatch) -> None:
    """Applies another journal's batch to `journal`, which then holds what that one holds."""
    changes = {POOL: (batch.stored, batch.removed), **{t.tier: (t.stored, t.removed) for t in batch.tiers}}
    if batch.snapshot:
        journal.root = batch.root
        for tier in {*changes, *journal.tiers()}:
            stored = changes.get(tier, ([], []))[0]
            for name in journal.held(tier) - set(stored):
                journal.removed(name, tier)
            held = journal.held(tier)
            for name in stored:
                if name not in held:
                    journal.stored(name, tier)
        return
    for tier, (stored, removed) in changes.items():
        for name in removed:
            journal.removed(name, tier)
        for name in stored:
            journal.stored(name, tier)
