"""The Ray cluster's liveness, as a router or `tandem serve` sees it.

Nothing on a request's path needs Ray: routers place from the loads the workers push and reach them
over gRPC. Ray is needed to scale, to read the pools, to restart a worker. So a GCS that stops
answering degrades a router rather than stopping it, and how far depends on whether the GCS comes
back with its tables (`ray_ha`: Redis keeps them):

    ok         the GCS answers
    degraded   it has not answered for `degraded_after_s`: serving goes on from the workers' own
               streams; what needs Ray is refused with UNAVAILABLE and the reason
    draining   (without ray_ha) `drain_s` before the raylets give up on the GCS: no new request is
               admitted, so those in flight finish while their workers live
    lost       (without ray_ha) the raylets have given up (`gives_up_after_s`, Ray's
               gcs_rpc_server_reconnect_timeout_s) and exited with their workers: every call is refused;
               `tandem serve`, `router` and `control` exit non-zero. A Ray whose GCS came back without
               its tables has lost its actors' state with it: lost is final.

A GCS that answers again turns degraded or draining back to ok. With ray_ha nothing is final: the
router stays degraded until the GCS answers (on Kubernetes, KubeRay restarts the head pod).

`Lifeline` calls a probe (`cluster.pools.ray_cluster.RayCluster.probe`: one call to Ray's GCS,
answered or refused within a second) every `interval_s`, and `on_change(state, reason)` on each
change, from its daemon thread. Lifecycle: created -> `start()` -> `stop()`.

`ClusterUnavailable` is Tandem's error for a Ray cluster, or one of its actors, out of reach: the
Ray module raises it in place of Ray's own exceptions, so what a client or an operator reads is
Tandem's message, not Ray's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

OK, DEGRADED, DRAINING, LOST = "ok", "degraded", "draining", "lost"
# The health service a router reports Ray's GCS under: SERVING while it answers (the router's own
# health, service "", stays SERVING while it is degraded).
RAY_HEALTH = "tandem.ray"


class ClusterUnavailable(RuntimeError):
    """The Ray cluster, or an actor of it that Tandem needs, cannot be reached."""


class Lifeline:
    def __init__(
        self,
        probe: Callable[[], None],  # returns when the cluster answers; raises ClusterUnavailable when not
        on_change: Callable[[str, str], None],  # (state, reason); the reason is "" for ok
        degraded_after_s: float,
        gives_up_after_s: float | None,  # None: the GCS comes back with its tables (ray_ha)
        drain_s: float = 0.0,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe, self.on_change = probe, on_change
        self.degraded_after_s, self.gives_up_after_s, self.drain_s = degraded_after_s, gives_up_after_s, drain_s
        self.interval_s, self.clock = interval_s, clock
        self.state, self.reason = OK, ""
        self._failing_since: float | None = None
        self._stop = threading.Event()

    @property
    def lost(self) -> bool:
        return self.state == LOST

    def check(self) -> str:
        """Probes once; returns the state it leaves."""
        if self.lost:
            return LOST
        try:
            self.probe()
        except ClusterUnavailable as e:
            now = self.clock()
            if self._failing_since is None:
                self._failing_since = now
            self._failing(str(e), now - self._failing_since)
            return self.state
        self._failing_since = None
        self._become(OK, "")
        return self.state

    def _failing(self, error: str, silent_s: float) -> None:
        gives_up = self.gives_up_after_s
        if gives_up is not None and silent_s >= gives_up:
            self._become(LOST, f"{error} (for {silent_s:.0f} s): its raylets have exited with the workers")
        elif gives_up is not None and silent_s >= max(self.degraded_after_s, gives_up - self.drain_s):
            self._become(
                DRAINING,
                f"{error} (for {silent_s:.0f} s): its raylets exit with the workers at {gives_up:.0f} s "
                "(no ray_ha: the GCS does not come back); requests in flight finish, no new one is taken",
            )
        elif silent_s >= self.degraded_after_s and self.state == OK:
            after = (
                "it comes back with its tables (ray_ha)"
                if gives_up is None
                else f"its raylets give up at {gives_up:.0f} s"
            )
            self._become(DEGRADED, f"{error} (for {silent_s:.0f} s): serving goes on; {after}")

    def _become(self, state: str, reason: str) -> None:
        if state != self.state:
            self.state, self.reason = state, reason
            self.on_change(state, reason)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                if self.check() == LOST:
                    return

        threading.Thread(target=loop, daemon=True, name="ray-lifeline").start()

    def stop(self) -> None:
        self._stop.set()
