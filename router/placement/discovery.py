"""The workers the router can reach: discovered by name, refreshed every `refresh_s` or on demand.
Their channels and loads live in `router.placement.view` (one channel and one Watch stream per worker)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class Worker:
    name: str
    address: str


class WorkerDiscovery:
    """The workers the router can reach, refreshed from `discover()` (name -> "host:port"), with
    what every call to them carries: the cluster secret's metadata and the channel credentials."""

    def __init__(
        self,
        discover: Callable[[], dict[str, str]],
        refresh_s: float = 1.0,
        metadata: Sequence[tuple[str, str]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.credentials = credentials  # mutual TLS to the workers, when configured
        self.discover = discover
        self.metadata = list(metadata)  # the cluster secret on every call to a worker
        self.refresh_s = refresh_s
        self.clock = clock
        self._workers: dict[str, Worker] = {}
        self._checked: float | None = None  # when discovery last ran; None: never, or asked again
        self._lock = threading.Lock()

    def workers(self) -> dict[str, Worker]:
        with self._lock:
            if self._checked is None or self.clock() - self._checked >= self.refresh_s:
                self._workers = {name: Worker(name, address) for name, address in self.discover().items()}
                self._checked = self.clock()
            return dict(self._workers)

    def rediscover(self) -> None:
        """Asks `discover()` again on the next use, not after `refresh_s`."""
        with self._lock:
            self._checked = None

    def close(self) -> None:
        with self._lock:
            self._workers.clear()
