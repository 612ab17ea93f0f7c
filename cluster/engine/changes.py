"""What an engine's loop and its watchers wait on instead of polling: a counter the engine bumps
whenever what it holds changes (a request added, admitted, aborted, a reservation made or released,
a step taken), and the load snapshot it publishes with each bump.

The engine publishes under its own lock, so a snapshot is one consistent moment; readers take the
latest without the lock, so a load read never waits for a step (and a wedged step cannot hide
itself from the load a watcher reports)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


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

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


class Changes:
    """A change counter: `bump` after a change, `wait(seen)` until the count differs from `seen`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.version = 0

    def bump(self) -> None:
        with self._cond:
            self.version += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """The count once it differs from `seen`, or after `timeout` seconds, whichever is first."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen, timeout)
            return self.version
