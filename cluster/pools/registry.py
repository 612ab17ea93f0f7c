"""The cluster's registry, without Ray: the gRPC address of every worker and router, and each
router's latest status report. `cluster.pools.ray_cluster` runs it as the `controller` actor.

Lifecycle of a router in it:

    register    (name, "router", address) when it joins
    report      a serialized `RouterStatus` about once a second, stamped on arrival by the
                registry's own clock (no two machines' clocks are compared)
    forgotten   when it unregisters, or once its last report is `REPORT_TTL_S` old (it died)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.v1 import worker_pb2

ROUTER = "router"
REPORT_TTL_S = 5.0  # a router silent this long is gone: five missed reports, not one slow one


class Registry:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._members: dict[str, tuple[str, str]] = {}  # name -> (role, address)
        self._reports: dict[str, tuple[float, bytes]] = {}  # router -> (received, report)

    def register(self, name: str, role: str, address: str) -> None:
        self._members[name] = (role, address)

    def unregister(self, name: str) -> None:
        self._members.pop(name, None)
        self._reports.pop(name, None)

    def workers(self) -> dict[str, tuple[str, str]]:
        """The prefill and decode workers: name -> (role, address); no router."""
        return {name: member for name, member in self._members.items() if member[0] != ROUTER}

    def report(self, name: str, report: bytes) -> None:
        self._reports[name] = (self.clock(), report)

    def router_reports(self) -> list[tuple[float, bytes]]:
        """(age in seconds, report) of each router heard from within `REPORT_TTL_S`; a router
        silent for longer is forgotten, its registration with it."""
        now = self.clock()
        for name, (received, _) in list(self._reports.items()):
            if now - received > REPORT_TTL_S:
                self.unregister(name)
        return [(now - received, report) for received, report in self._reports.values()]


def fleet_latency(reports: Iterable[bytes]) -> tuple[float | None, float | None]:
    """The highest TTFT and TPOT p90 among routers' status reports (None where none has one):
    a pool serves every router, so the slowest router's requests set its latency signal."""
    ttfts, tpots = [], []
    for raw in reports:
        router = worker_pb2.RouterStatus.FromString(raw)
        if router.HasField("ttft_p90_seconds"):
            ttfts.append(router.ttft_p90_seconds)
        if router.HasField("tpot_p90_seconds"):
            tpots.append(router.tpot_p90_seconds)
    return max(ttfts, default=None), max(tpots, default=None)
