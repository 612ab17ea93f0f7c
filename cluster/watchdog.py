"""The canary behind a worker's health check: an engine that holds work but has not finished a
step for `wedged_after_s` is wedged. The worker then reports NOT_SERVING (and `wedged` in its
load, so the router sends it nothing) until a step completes again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(
        self,
        has_work: Callable[[], bool],
        on_change: Callable[[bool], None],  # called with True when wedged, False when it recovers
        wedged_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.has_work = has_work
        self.on_change = on_change
        self.wedged_after_s = wedged_after_s
        self.clock = clock
        self.wedged = False
        self._progress_at = clock()
        self._stop = threading.Event()

    def progress(self) -> None:
        """The engine finished a step (or had nothing to do)."""
        self._progress_at = self.clock()
        if self.wedged:
            self.wedged = False
            self.on_change(False)

    def check(self) -> bool:
        stuck = self.has_work() and self.clock() - self._progress_at > self.wedged_after_s
        if stuck and not self.wedged:
            self.wedged = True
            self.on_change(True)
        return self.wedged

    def start(self, interval_s: float | None = None) -> None:
        interval = interval_s if interval_s is not None else min(1.0, self.wedged_after_s / 4)

        def loop() -> None:
            while not self._stop.wait(interval):
                self.check()

        threading.Thread(target=loop, daemon=True, name="engine-watchdog").start()

    def stop(self) -> None:
        self._stop.set()
