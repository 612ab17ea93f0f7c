"""What an engine's loop and its watchers wait on instead of polling: a counter the engine bumps
whenever what it holds changes (a request added, admitted, aborted, a reservation made or released,
a step taken), and the load snapshot it publishes with each bump.

The engine publishes under its own lock, so a snapshot is one consistent moment; readers take the
latest without the lock, so a load read never waits for a step (and a wedged step cannot hide
itself from the load a watcher reports)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TierCounts:
    """One KV tier's counts since the engine started (`cluster.kv.tiers.TierStats`, as published)."""

    tier: str  # "host", "disk" or "shared"
    hits: int  # blocks loaded from it
    bytes_loaded: int
    load_seconds: float
    writes: int
    rejected: int  # entries whose seal failed: misses
    failures: int  # times the store failed and the tier went off
    up: bool  # on now (not off after a failure)
    cost: float | None = None  # a block loaded from it costs this share of computing one (None: not measured)


@dataclass(frozen=True)
class AdapterState:
    """A LoRA adapter an engine serves, as its load reports it."""

    name: str
    digest: bytes
    resident: bool  # in one of the model's slots now
    retiring: bool = False  # unloaded: finishing what is in flight, taking nothing new


@dataclass(frozen=True)
class Occupancy:
    """A decode engine's load at one moment."""

    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0  # prompt tokens of waiting requests not computed yet
    free_blocks: int = 0
    total_blocks: int = 0
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    tiers: tuple[TierCounts, ...] = ()  # the KV tiers', when `cache.tiers` names any
    adapters: tuple[AdapterState, ...] = ()  # with LoRA
    max_loras: int = 0  # adapters its slots hold at once

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


class Changes:
    """A change counter: `bump` after a change, `wait(seen)` (or, on an event loop, `changed(seen)`)
    until the count differs from `seen`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.version = 0

    def bump(self) -> None:
        with self._cond:
            self.version += 1
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                loop.call_soon_threadsafe(_wake, waiter)

    async def changed(self, seen: int, timeout: float) -> int:
        """`wait` for a coroutine: the loop runs on while it waits, and no thread is held."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self.version != seen:
                return self.version
            self._waiters.append((loop, waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            with self._cond, contextlib.suppress(ValueError):
                self._waiters.remove((loop, waiter))
        return self.version

    def wait(self, seen: int, timeout: float) -> int:
        """The count once it differs from `seen`, or after `timeout` seconds, whichever is first."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen, timeout)
            return self.version


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
