"""The Ray cluster's liveness, as a router or `tandem serve` sees it.

`Lifeline` calls a probe (`cluster.pools.ray_cluster.RayCluster.probe`: one call to Ray's GCS,
answered or refused within a second) every `interval_s`. When the probe has failed without a
break for `lost_after_s`, the cluster is lost: `on_lost(reason)` runs once, and the lifeline
stays lost (a Ray whose GCS came back has lost its actors' state with it; the router does not
pretend otherwise). The router then turns NOT_SERVING and refuses every request with UNAVAILABLE
and the reason; `tandem serve`, `tandem router` and `tandem control` stop and exit non-zero.

Lifecycle: created -> `start()` (a daemon thread checks) -> lost (once) -> `stop()`.

`ClusterUnavailable` is Tandem's error for a Ray cluster, or one of its actors, out of reach: the
Ray module raises it in place of Ray's own exceptions, so what a client or an operator reads is
Tandem's message, not Ray's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ClusterUnavailable(RuntimeError):
    """The Ray cluster, or an actor of it that Tandem needs, cannot be reached."""


class Lifeline:
    def __init__(
        self,
        probe: Callable[[], None],  # returns when the cluster answers; raises ClusterUnavailable when not
        on_lost: Callable[[str], None],
        lost_after_s: float,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe, self.on_lost = probe, on_lost
        self.lost_after_s, self.interval_s, self.clock = lost_after_s, interval_s, clock
        self.reason: str | None = None  # set once the cluster is lost
        self._failing_since: float | None = None
        self._stop = threading.Event()

    @property
    def lost(self) -> bool:
        return self.reason is not None

    def check(self) -> bool:
        """Probes once; True once the cluster is lost."""
        if self.lost:
            return True
        try:
            self.probe()
        except ClusterUnavailable as e:
            now = self.clock()
            if self._failing_since is None:
                self._failing_since = now
            if now - self._failing_since >= self.lost_after_s:
                self.reason = f"{e} (for {now - self._failing_since:.0f} s)"
                self.on_lost(self.reason)
            return self.lost
        self._failing_since = None
        return False

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                if self.check():
                    return

        threading.Thread(target=loop, daemon=True, name="ray-lifeline").start()

    def stop(self) -> None:
        self._stop.set()
