"""The router's view of the workers: one `Worker.Watch` stream to each worker the pool discovers,
feeding a `LoadIndex` that placement reads.

Lifecycle:

    start()        on an event loop thread (the router's, or one of its own: a thousand workers
                   need no thousand threads), the first discovery; it waits (bounded) for each worker's first
                   snapshot, so the router places nothing from an empty view
    membership     discovery again every `pool.refresh_s`, or at once on `refresh()`: new workers
                   get a stream; workers that left lose theirs and leave the index
    a stream       a snapshot on each change, a heartbeat otherwise; when it breaks or ends, the
                   worker leaves placement at once and the stream is opened again after `retry_s`
    KV events      with a `PrefixIndex` (KV-aware routing), each stream also carries the worker's
                   cache events, a snapshot first; a gap in them opens the stream again at once
                   (`resyncs`), and a worker that leaves placement leaves the index too
    staleness      nothing heard for `stale_after_s` (a stream that stalls without breaking):
                   the index passes the worker over; a sweep every `heartbeat_s` drops it
    stop()         cancels every stream and closes every channel

Each watched worker has one channel, which the router's calls to it share.

The view lags the worker by at most `min_interval_s` plus one message's trip (a change), and is
trusted for at most `stale_after_s` without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.aio_server import LoopThread
from cluster.grpc_server import message_options
from router.placement.discovery import WorkerDiscovery
from router.placement.index import LoadIndex
from router.placement.prefix_index import PrefixIndex


@dataclass
class _Member:
    address: str
    channel: grpc.aio.Channel
    task: asyncio.Task  # its Watch stream


class WorkerView:
    def __init__(
        self,
        pool: WorkerDiscovery,
        heartbeat_s: float = 0.5,
        stale_after_s: float = 2.0,
        min_interval_s: float = 0.01,
        retry_s: float = 0.2,
        loop: LoopThread | None = None,
        prefix: PrefixIndex | None = None,
    ) -> None:
        self.pool = pool
        self.index = LoadIndex(stale_after_s)
        self.index.prefix = prefix  # KV-aware routing: the streams also carry each cache's events
        self.heartbeat_s, self.min_interval_s, self.retry_s = heartbeat_s, min_interval_s, retry_s
        self.updates = 0  # messages received on every stream
        self.resyncs = 0  # streams opened again after a gap in a worker's KV events
        self._members: dict[str, _Member] = {}
        self._own_loop = loop is None
        self.loop = loop or LoopThread("router-view")
        self._main: asyncio.Future | None = None

    def start(self, wait_s: float = 5.0) -> None:
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self.loop.loop)  # type: ignore[assignment]
        self.refresh(wait_s)

    def refresh(self, wait_s: float = 1.0) -> None:
        """Discovers again now and waits up to `wait_s` for each new worker's first snapshot."""
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            self.loop.run(self.refresh_async(wait_s), wait_s + 5)

    async def refresh_async(self, wait_s: float = 1.0) -> None:
        self.pool.rediscover()
        await self._sync(wait_s)

    def channel(self, name: str) -> tuple[str, grpc.aio.Channel] | None:
        """The address of a watched worker and the channel to it (on the loop), or None."""
        member = self._members.get(name)
        return None if member is None else (member.address, member.channel)

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.run(self._close(), 5)
        if self._own_loop:
            self.loop.stop()

    # -- on the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_s, self.pool.refresh_s))
            self.index.sweep()
            await self._sync(0)

    async def _sync(self, wait_s: float) -> None:
        workers = await asyncio.to_thread(self.pool.workers)  # discovery may be a Ray call: off the loop
        gone = [n for n, m in self._members.items() if n not in workers or workers[n].address != m.address]
        for name in gone:
            await self._forget(name)
        fresh = []
        for name, worker in workers.items():
            if name not in self._members:
                first = asyncio.get_running_loop().create_future()
                channel = _channel(worker.address, self.pool.credentials)
                task = asyncio.create_task(self._watch(name, channel, first))
                self._members[name] = _Member(worker.address, channel, task)
                fresh.append(first)
        if fresh and wait_s:
            await asyncio.wait(fresh, timeout=wait_s)

    async def _watch(self, name: str, channel: grpc.aio.Channel, first: asyncio.Future) -> None:
        request = worker_pb2.WatchRequest(
            min_interval_seconds=self.min_interval_s, heartbeat_seconds=self.heartbeat_s,
            kv_events=self.index.prefix is not None,
        )  # fmt: skip
        while True:
            call = worker_pb2_grpc.WorkerStub(channel).Watch(request, metadata=self.pool.metadata)
            gap = False
            try:
                async for update in call:
                    self.updates += 1
                    if update.HasField("load"):
                        self.index.update(name, update.load)
                    else:
                        self.index.heard(name)
                    if update.HasField("kv") and not self.index.apply_kv(name, update.kv):
                        gap = True  # events were missed: a new stream starts with a snapshot
                        self.resyncs += 1
                        call.cancel()
                        break
                    if not first.done():
                        first.set_result(None)
            except grpc.RpcError:
                pass
            finally:
                if not gap:
                    self.index.remove(name)  # out of placement the moment its stream ends
                if not first.done():
                    first.set_result(None)  # nobody waits on a worker that cannot be reached
            if gap:
                continue
            self.pool.rediscover()
            await asyncio.sleep(self.retry_s)

    async def _forget(self, name: str) -> None:
        member = self._members.pop(name)
        member.task.cancel()
        self.index.remove(name)
        await member.channel.close()

    async def _close(self) -> None:
        if self._main is not None:
            self._main.cancel()
        for name in list(self._members):
            await self._forget(name)


def _channel(address: str, credentials: grpc.ChannelCredentials | None, options: Sequence = ()) -> grpc.aio.Channel:
    options = [*message_options(), *options]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)
