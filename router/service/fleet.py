"""A router among its replicas: it registers in the cluster's registry under role "router",
reports its own counters there about once a second, and answers `Admin.GetStatus` with every
live router's report. The registry forgets a router whose last report is five seconds old
(`cluster.pools.ray_cluster.REPORT_TTL_S`): one that died without leaving.

Lifecycle of a router's membership (`Fleet`, on the router's event loop):

    join      register (name, "router", address), send a first report, then one every `every_s`
    routers   the live routers: this one from its counters as they are now, the others from their
              latest reports, each with its age
    leave     stop reporting (a report under way finishes first), then unregister

A router made without a registry has no `Fleet`: its status lists itself only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
from collections.abc import Callable, Iterable
from typing import Protocol

from tandem.v1 import worker_pb2

log = logging.getLogger("tandem.router.fleet")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class RouterRegistry(Protocol):
    """The cluster's registry, as a router sees it (`cluster.pools.ray_cluster.RayCluster`)."""

    def register_router(self, name: str, address: str) -> None: ...

    def unregister_router(self, name: str) -> None: ...

    def report_router(self, name: str, report: bytes) -> None: ...

    def router_reports(self) -> list[tuple[float, bytes]]: ...


def router_name() -> str:
    """This process's router name: unique among replicas on one host, and across hosts."""
    return f"router-{socket.gethostname()}-{os.getpid()}"


def advertised(bind: str, port: int) -> str:
    """The address to show for a router bound to `bind` ("host:port"): a wildcard host is shown
    as the machine's host name, which says where the router runs (a pod's name on Kubernetes)."""
    host = bind.rsplit(":", 1)[0]
    return f"{socket.gethostname() if host in WILDCARD_HOSTS else host}:{port}"


def fleet(own: worker_pb2.RouterStatus, reports: Iterable[tuple[float, bytes]]) -> list[worker_pb2.RouterStatus]:
    """Every live router by name: `own` as given, the others from their (age, report) pairs."""
    routers = {own.name: own}
    for age, raw in reports:
        router = worker_pb2.RouterStatus.FromString(raw)
        if router.name != own.name:
            router.age_seconds = age
            routers[router.name] = router
    return [routers[name] for name in sorted(routers)]


def totals(routers: Iterable[worker_pb2.RouterStatus]) -> tuple[int, dict[str, int]]:
    """Requests in flight and placement decisions, summed over `routers`."""
    in_flight, decisions = 0, collections.Counter[str]()
    for router in routers:
        in_flight += router.requests_in_flight
        decisions.update(dict(router.decisions))
    return in_flight, dict(decisions)


class Fleet:
    """One router's membership. `snapshot()` is called on the router's loop, where its counters
    change; the registry's calls block, so they run on threads."""

    def __init__(
        self,
        registry: RouterRegistry,
        name: str,
        address: str,
        snapshot: Callable[[], worker_pb2.RouterStatus],
        every_s: float = 1.0,
    ) -> None:
        self.registry, self.name, self.address = registry, name, address
        self.snapshot = snapshot
        self.every_s = every_s
        self._leaving = asyncio.Event()
        self._task: asyncio.Task | None = None  # type: ignore[type-arg]

    async def join(self) -> None:
        await asyncio.to_thread(self.registry.register_router, self.name, self.address)
        await self._report()
        self._task = asyncio.create_task(self._reporting())

    async def routers(self, own: worker_pb2.RouterStatus) -> list[worker_pb2.RouterStatus]:
        try:
            reports = await asyncio.to_thread(self.registry.router_reports)
        except Exception:  # the registry is out of reach: only this router is known to be alive
            log.warning("cannot read the routers' reports; showing this router alone", exc_info=True)
            reports = []
        return fleet(own, reports)

    async def leave(self) -> None:
        """Stops reporting and unregisters. A report still under way finishes first, so none
        arrives after the unregistration to bring this router back for a while."""
        self._leaving.set()
        if self._task is not None:
            await self._task
        try:
            await asyncio.to_thread(self.registry.unregister_router, self.name)
        except Exception:  # the registry is gone already; it forgets this router with it
            log.warning("could not unregister %s", self.name, exc_info=True)

    async def _reporting(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._leaving.wait(), self.every_s)
                return
            except TimeoutError:
                pass
            try:
                await self._report()
            except Exception:  # one lost report: the next, a second later, replaces it
                log.warning("status report to the registry failed", exc_info=True)

    async def _report(self) -> None:
        report = self.snapshot().SerializeToString()
        await asyncio.to_thread(self.registry.report_router, self.name, report)
