"""The workers the router can reach: discovered by name, one channel each, their loads on demand."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster import tls
from cluster.grpc_server import message_options


@dataclass
class _Worker:
    name: str
    address: str
    channel: grpc.Channel
    stub: worker_pb2_grpc.WorkerStub


class WorkerPool:
    """The workers the router can reach, refreshed from `discover()` (name -> "host:port")."""

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
        self._workers: dict[str, _Worker] = {}
        self._checked: float | None = None  # when discovery last ran; None: never, or asked again
        self._lock = threading.Lock()

    def workers(self) -> dict[str, _Worker]:
        with self._lock:
            if self._checked is None or self.clock() - self._checked >= self.refresh_s:
                self._refresh()
            return dict(self._workers)

    def loads(self, timeout_s: float = 2.0) -> dict[str, worker_pb2.WorkerLoad]:
        """Each reachable worker's load; unreachable ones are left out."""
        workers = self.workers()
        calls = {
            name: w.stub.GetLoad.future(worker_pb2.GetLoadRequest(), timeout=timeout_s, metadata=self.metadata)
            for name, w in workers.items()
        }
        loads = {}
        for name, call in calls.items():
            try:
                loads[name] = call.result()
            except grpc.RpcError:
                self.rediscover()  # on the next request
        return loads

    def rediscover(self) -> None:
        """Asks `discover()` again on the next use, not after `refresh_s`."""
        with self._lock:
            self._checked = None

    def close(self) -> None:
        with self._lock:
            for w in self._workers.values():
                w.channel.close()
            self._workers.clear()

    def _refresh(self) -> None:
        found = self.discover()
        for name in list(self._workers):
            if found.get(name) != self._workers[name].address:
                self._workers.pop(name).channel.close()
        for name, address in found.items():
            if name not in self._workers:
                channel = tls.channel(address, self.credentials, message_options())
                self._workers[name] = _Worker(name, address, channel, worker_pb2_grpc.WorkerStub(channel))
        self._checked = self.clock()
