"""What a worker's prefix cache holds, told as events, so that routers place requests where the KV
already is instead of guessing.

A `KVJournal` records each full block the cache registers (`stored`, by its chained hash: the one
`BlockManager` keys blocks by, which `block_hashes` computes from token ids alone) and each one it
evicts (`removed`). Every event has a sequence number. A reader (a router's watch stream) keeps a
cursor and asks for what happened since (`since`): a compact batch, each block's last event only.
The journal keeps the last `max_events` events; a reader that fell further behind gets a snapshot
instead, every block held now, and goes on from there.

    journal.stored(h) / journal.removed(h)     the block manager, on the engine's thread
    batch = journal.since(cursor)              a watch stream, on its own thread; None: nothing new
    cursor = batch.last                        the next call goes on from here

The hashes are Python's `hash` of (previous hash, the block's token ids), which is the same in
every process of the same Python version: routers compute a prompt's hashes themselves.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block of `tokens`, as the block manager keys its cache."""
    hashes, prev = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[start : start + block_size])))
        hashes.append(prev)
    return hashes


@dataclass(frozen=True)
class KVBatch:
    """Events `first`..`last` (sequence numbers, inclusive), each block's net change in that span;
    or, with `snapshot`, every block held as of `last` (`removed` empty)."""

    first: int
    last: int
    stored: list[int]
    removed: list[int]
    snapshot: bool = False


class KVJournal:
    def __init__(self, max_events: int = 65536) -> None:
        self.max_events = max_events
        self.sequence = 0  # the last event's number
        self._held: set[int] = set()
        self._log: collections.deque[tuple[int, bool]] = collections.deque()  # (hash, stored), oldest first
        self._lock = threading.Lock()

    def stored(self, block_hash: int) -> None:
        self._record(block_hash, True)

    def removed(self, block_hash: int) -> None:
        self._record(block_hash, False)

    def snapshot(self) -> KVBatch:
        with self._lock:
            return KVBatch(self.sequence, self.sequence, list(self._held), [], snapshot=True)

    def since(self, cursor: int | None) -> KVBatch | None:
        """The events after `cursor` (None: a reader that has nothing yet gets a snapshot), or None
        when there are none."""
        with self._lock:
            if cursor == self.sequence:
                return None
            oldest = self.sequence - len(self._log) + 1
            if cursor is None or cursor + 1 < oldest or cursor > self.sequence:
                return KVBatch(self.sequence, self.sequence, list(self._held), [], snapshot=True)
            net: dict[int, bool] = {}
            for i in range(cursor + 1 - oldest, len(self._log)):
                block_hash, stored = self._log[i]
                net[block_hash] = stored
        stored = [h for h, s in net.items() if s]
        return KVBatch(cursor + 1, self.sequence, stored, [h for h, s in net.items() if not s])

    def held(self) -> set[int]:
        """Every block held now."""
        with self._lock:
            return set(self._held)

    def _record(self, block_hash: int, stored: bool) -> None:
        with self._lock:
            self.sequence += 1
            (self._held.add if stored else self._held.discard)(block_hash)
            self._log.append((block_hash, stored))
            if len(self._log) > self.max_events:
                self._log.popleft()


def replay(journal: KVJournal, batch: KVBatch) -> None:
    """Applies another journal's batch to `journal`, which then holds what that one holds."""
    if batch.snapshot:
        for block_hash in journal.held() - set(batch.stored):
            journal.removed(block_hash)
        held = journal.held()
        for block_hash in batch.stored:
            if block_hash not in held:
                journal.stored(block_hash)
        return
    for block_hash in batch.removed:
        journal.removed(block_hash)
    for block_hash in batch.stored:
        journal.stored(block_hash)
