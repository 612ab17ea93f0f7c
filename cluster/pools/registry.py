"""The cluster's registry, without Ray: the gRPC address of every worker and router, and each
router's latest status report. `cluster.pools.ray_cluster` runs it as the `controller` actor.

Lifecycle of a router in it:

    register    (name, "router", address) when it joins
    report      a serialized `RouterStatus` about once a second, stamped on arrival by the
                registry's own clock (no two machines' clocks are compared)
    forgotten   when it unregisters, or once its last report is `REPORT_TTL_S` old (it died)

A worker registers when it starts and again every `REGISTER_EVERY_S`, so a registry that Ray started
again (its state lost with its process) is whole within that; a router's report registers it again.
A name that unregistered is not taken back at the same address: a late call from one that left (a
retired worker's last heartbeat) cannot bring it back, while a worker restarted at a new address can.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.v1 import worker_pb2

ROUTER = "router"
REPORT_TTL_S = 5.0  # a router silent this long is gone: five missed reports, not one slow one
REGISTER_EVERY_S = 2.0  # how often a worker registers again


class Registry:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._members: dict[str, tuple[str, str]] = {}  # name -> (role, address)
        self._reports: dict[str, tuple[float, bytes]] = {}  # router -> (received, report)
        self._left: dict[str, str] = {}  # name -> the address it unregistered from

    def register(self, name: str, role: str, address: str) -> None:
        if self._left.get(name) != address:
            self._members[name] = (role, address)

    def unregister(self, name: str) -> None:
        if (member := self._members.get(name)) is not None:
            self._left[name] = member[1]
        self._forget(name)

    def _forget(self, name: str) -> None:
        self._members.pop(name, None)
        self._reports.pop(name, None)

    def workers(self) -> dict[str, tuple[str, str]]:
        """The prefill and decode workers: name -> (role, address); no router."""
        return {name: member for name, member in self._members.items() if member[0] != ROUTER}

    def report(self, name: str, report: bytes) -> None:
        if name not in self._members:  # forgotten while silent, or a registry started again
            self.register(name, ROUTER, worker_pb2.RouterStatus.FromString(report).address)
        if name in self._members:
            self._reports[name] = (self.clock(), report)

    def router_reports(self) -> list[tuple[float, bytes]]:
        """(age in seconds, report) of each router heard from within `REPORT_TTL_S`; a router
        silent for longer is forgotten, its registration with it."""
        now = self.clock()
        for name, (received, _) in list(self._reports.items()):
            if now - received > REPORT_TTL_S:
                self._forget(name)  # not `unregister`: a router that only went silent may report again
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
