"""KV cache tiers under a worker's paged pool: the blocks it evicts (or, per config, every block as it
is computed) live on in host memory, on local disk and in a store every worker of the model reaches,
and a prompt that misses the pool loads its longest run from them instead of computing it again.

    tiers = Tiers(stores, secret, layout)   stores in order: host, disk, shared (any may be absent)
    tiers.offer(name, payload)              the engine's thread: queued for the writer thread and
                                            never waited on; a full queue drops the block (counted)
    future = tiers.fetch(names)             the engine's thread: a Future of the payloads of the
                                            longest leading run of `names` the tiers hold, read and
                                            verified on the loader thread
    tiers.close()                           the threads stop; what is queued is dropped

An entry that leaves the process is sealed (`seal`): HMAC-SHA256 under the cluster's secret over
the block's name, the KV layout and its bytes. One whose seal does not verify (corrupted, written
without the secret, or for another layout) is a miss, counted and never served. A store that fails
(`StoreDown`) is off for `retry_after_s`, with a log line and a count, then tried again: meanwhile
requests compute what it would have given them.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.engine.changes import TierCounts
from cluster.kv.stores import Store, StoreDown

log = logging.getLogger(__name__)
_DOWN = object()  # what a call to a store that failed returns
MAGIC = b"TKV\x01"  # the sealed entry's format, version 1
_MAC_BYTES = 32


def _mac(secret: bytes, name: bytes, layout: bytes, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(secret, MAGIC, "sha256")
    for part in (len(layout).to_bytes(4, "little"), layout, name, payload):
        mac.update(part)
    return mac.digest()


def seal(secret: bytes, name: bytes, layout: bytes, payload: bytes) -> bytes:
    """The entry a store keeps for block `name`: format, MAC, then the KV bytes."""
    return MAGIC + _mac(secret, name, layout, payload) + payload


def unseal(secret: bytes, name: bytes, layout: bytes, blob: bytes) -> bytes | None:
    """The KV bytes of a sealed entry, or None unless it is intact and was sealed under `secret` for
    block `name` and this `layout`."""
    head = len(MAGIC) + _MAC_BYTES
    if len(blob) < head or not blob.startswith(MAGIC):
        return None
    payload = memoryview(blob)[head:]
    if not hmac.compare_digest(blob[len(MAGIC) : head], _mac(secret, name, layout, payload)):
        return None
    return bytes(payload)


class TierJournal(Protocol):
    """`cluster.engine.kv_events.KVJournal`'s tier events."""

    def stored(self, name: bytes, tier: str) -> None: ...
    def removed(self, name: bytes, tier: str) -> None: ...


@dataclass
class TierStats:
    """One tier's counts since start; `load_rate` (bytes/s) is what a load from it has cost."""

    hits: int = 0  # blocks loaded from it
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    writes: int = 0
    rejected: int = 0  # entries read back whose seal failed: misses
    failures: int = 0  # times it failed and was turned off
    off_until: float = 0.0  # monotonic time before which it is not asked

    @property
    def load_rate(self) -> float | None:
        return self.bytes_loaded / self.load_seconds if self.load_seconds > 0 else None


@dataclass
class _Run:
    payloads: list[bytes] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # the tier each payload came from


class Tiers:
    def __init__(
        self,
        stores: Sequence[Store],
        secret: bytes,
        layout: bytes,
        queue_blocks: int = 4096,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        journal: TierJournal | None = None,
    ) -> None:
        kinds = [s.kind for s in stores]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"one store per tier: {kinds}")
        self.stores = list(stores)
        self.secret, self.layout = secret, layout
        self.retry_after_s, self.clock = retry_after_s, clock
        self.stats = {s.kind: TierStats() for s in stores}
        self.dropped = 0  # offers refused because the writer was behind
        self.journal = journal  # told of each block a tier stores and evicts (the KV events' tiers)
        for store in stores if journal is not None else ():
            for name in store.names():  # a restarted worker's disk tier
                journal.stored(name, store.kind)
        self._writes: queue.Queue[tuple[bytes, bytes] | threading.Event] = queue.Queue(queue_blocks)
        self._lock = threading.Lock()  # guards the stats
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-loader")
        self._writer.start()

    # -- the engine's side ----------------------------------------------------------------------------

    def offer(self, name: bytes, payload: bytes) -> bool:
        """Queues block `name`'s KV bytes for every tier; False (dropped) when the writer is behind."""
        try:
            self._writes.put_nowait((name, payload))
            return True
        except queue.Full:
            with self._lock:
                self.dropped += 1
            return False

    def may_hold(self, name: bytes, kinds: Collection[str]) -> bool:
        """Whether a load of a run starting at block `name` from tiers of `kinds` may find anything: a
        local tier holds it, or a shared tier is on (only a round trip could tell). Asked on the
        engine's thread."""
        return any(s.kind in kinds and (s.kind == "shared" or s.holds(name)) for s in self._available())

    def fetch(self, names: Sequence[bytes], kinds: Collection[str] | None = None) -> Future[_Run]:
        """The payloads (and the tier of each) of the longest leading run of `names` the tiers hold
        (only those of `kinds`, when given)."""
        return self._loader.submit(self._fetch, list(names), kinds)

    def counts(self) -> tuple[TierCounts, ...]:
        """Each tier's counts now, as engines publish them with their load."""
        now = self.clock()
        with self._lock:
            return tuple(
                TierCounts(
                    kind, s.hits, s.bytes_loaded, s.load_seconds, s.writes, s.rejected, s.failures, s.off_until <= now
                )
                for kind, s in self.stats.items()
            )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every block offered so far is written (tests, shutdown); False on timeout."""
        done = threading.Event()
        self._writes.put(done, timeout=timeout_s)  # the writer sets it when it gets there
        return done.wait(timeout_s)

    def close(self) -> None:
        """Stops both threads; what is still queued is dropped."""
        self._closed = True
        with contextlib.suppress(queue.Full):  # a full queue wakes the writer anyway
            self._writes.put_nowait(threading.Event())
        self._loader.shutdown(wait=False, cancel_futures=True)

    # -- the threads ----------------------------------------------------------------------------------

    _closed = False

    def _write_loop(self) -> None:
        while not self._closed:
            item = self._writes.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            name, payload = item
            sealed = None
            for store in self._available():
                if store.sealed and sealed is None:
                    sealed = seal(self.secret, name, self.layout, payload)
                if self._put(store, name, sealed if store.sealed else payload):
                    with self._lock:
                        self.stats[store.kind].writes += 1

    def _fetch(self, names: list[bytes], kinds: Collection[str] | None) -> _Run:
        run = _Run()
        stores = [s for s in self._available() if kinds is None or s.kind in kinds]
        local = [s for s in stores if s.kind != "shared"]
        for store in local:
            store.pin(names)
        try:
            for name in names:
                if not self._take(run, local, name):
                    break
            shared = next((s for s in stores if s.kind == "shared"), None)
            if shared is not None and len(run.payloads) < len(names):
                self._take_shared(run, shared, names[len(run.payloads) :])
        finally:
            for store in local:
                store.unpin(names)
        return run

    def _take(self, run: _Run, stores: list[Store], name: bytes) -> bool:
        """Appends block `name` from the first local store that holds it intact."""
        for store in stores:
            start = self.clock()
            blobs = self._guard(store, store.get_many, [name])
            payload = None if blobs is _DOWN else self._open(store, name, blobs[0])
            if payload is not None:
                self._loaded(store, [payload], self.clock() - start)
                run.payloads.append(payload)
                run.sources.append(store.kind)
                return True
        return False

    def _take_shared(self, run: _Run, shared: Store, names: list[bytes]) -> None:
        """Appends the leading run of `names` the shared store holds, asked for in one round trip, and
        keeps each in the host tier too (the next turn finds it there)."""
        start = self.clock()
        blobs = self._guard(shared, shared.get_many, names)
        elapsed, taken = self.clock() - start, []
        host = next((s for s in self.stores if s.kind == "host"), None)
        for name, blob in zip(names, [] if blobs is _DOWN else blobs, strict=False):
            payload = self._open(shared, name, blob)
            if payload is None:
                break
            taken.append(payload)
            if host is not None:
                self._put(host, name, payload)
        if taken:
            self._loaded(shared, taken, elapsed)
        run.payloads += taken
        run.sources += [shared.kind] * len(taken)

    def _put(self, store: Store, name: bytes, blob: bytes) -> bool:
        """Puts an entry in `store`, telling the journal what it now holds; False if it failed."""
        evicted = self._guard(store, store.put, name, blob)
        if evicted is _DOWN:
            return False
        if self.journal is not None:
            self.journal.stored(name, store.kind)
            for old in evicted:
                self.journal.removed(old, store.kind)
        return True

    def _open(self, store: Store, name: bytes, blob: bytes | None) -> bytes | None:
        if blob is None:
            return None
        payload = unseal(self.secret, name, self.layout, blob) if store.sealed else blob
        if payload is None:
            with self._lock:
                self.stats[store.kind].rejected += 1
        return payload

    def _loaded(self, store: Store, payloads: list[bytes], seconds: float) -> None:
        with self._lock:
            stats = self.stats[store.kind]
            stats.hits += len(payloads)
            stats.bytes_loaded += sum(map(len, payloads))
            stats.load_seconds += seconds

    def _available(self) -> list[Store]:
        now = self.clock()
        with self._lock:
            return [s for s in self.stores if self.stats[s.kind].off_until <= now]

    def _guard(self, store: Store, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` on `store`; `_DOWN` when the store failed, which turns its tier off for
        `retry_after_s`."""
        try:
            return call(*args)
        except StoreDown as e:
            with self._lock:
                stats = self.stats[store.kind]
                stats.failures += 1
                stats.off_until = self.clock() + self.retry_after_s
            log.warning("KV tier %s is off for %.0f s: %s", store.kind, self.retry_after_s, e)
            return _DOWN
