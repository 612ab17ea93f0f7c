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
    batch = journal.since(cursor)                  a watch stream, on its own thread; None: nothing new
    cursor = batch.last                            the next call goes on from here

Routers compute a prompt's names themselves, from the model's root that each snapshot carries.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from cluster.engine.block_names import UNNAMED_MODEL


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


class KVJournal:
    def __init__(self, root: bytes = UNNAMED_MODEL, max_events: int = 65536) -> None:
        self.root = root  # the model's root (`block_names.model_root`), told to readers in snapshots
        self.max_events = max_events
        self.sequence = 0  # the last event's number
        self._held: set[bytes] = set()
        self._log: collections.deque[tuple[bytes, bool]] = collections.deque()  # (name, stored), oldest first
        self._lock = threading.Lock()

    def stored(self, name: bytes) -> None:
        self._record(name, True)

    def removed(self, name: bytes) -> None:
        self._record(name, False)

    def snapshot(self) -> KVBatch:
        with self._lock:
            return KVBatch(self.sequence, self.sequence, list(self._held), [], True, self.root)

    def since(self, cursor: int | None) -> KVBatch | None:
        """The events after `cursor` (None: a reader that has nothing yet gets a snapshot), or None
        when there are none."""
        with self._lock:
            if cursor == self.sequence:
                return None
            oldest = self.sequence - len(self._log) + 1
            if cursor is None or cursor + 1 < oldest or cursor > self.sequence:
                return KVBatch(self.sequence, self.sequence, list(self._held), [], True, self.root)
            net: dict[bytes, bool] = {}
            for i in range(cursor + 1 - oldest, len(self._log)):
                name, stored = self._log[i]
                net[name] = stored
        stored = [h for h, s in net.items() if s]
        return KVBatch(cursor + 1, self.sequence, stored, [h for h, s in net.items() if not s])

    def held(self) -> set[bytes]:
        """Every block held now."""
        with self._lock:
            return set(self._held)

    def _record(self, name: bytes, stored: bool) -> None:
        with self._lock:
            self.sequence += 1
            (self._held.add if stored else self._held.discard)(name)
            self._log.append((name, stored))
            if len(self._log) > self.max_events:
                self._log.popleft()


def replay(journal: KVJournal, batch: KVBatch) -> None:
    """Applies another journal's batch to `journal`, which then holds what that one holds."""
    if batch.snapshot:
        journal.root = batch.root
        for name in journal.held() - set(batch.stored):
            journal.removed(name)
        held = journal.held()
        for name in batch.stored:
            if name not in held:
                journal.stored(name)
        return
    for name in batch.removed:
        journal.removed(name)
    for name in batch.stored:
        journal.stored(name)
