"""The router's view of the workers: one `Worker.Watch` stream to each worker the pool discovers,
feeding a `LoadIndex` that placement reads.

Lifecycle:

    start()        an event loop on one thread of its own (so a thousand workers need no thousand
                   threads), then the first discovery; it waits (bounded) for each worker's first
                   snapshot, so the router places nothing from an empty view
    membership     discovery again every `pool.refresh_s`, or at once on `refresh()`: new workers
                   get a stream; workers that left lose theirs and leave the index
    a stream       a snapshot on each change, a heartbeat otherwise; when it breaks or ends, the
                   worker leaves placement at once and the stream is opened again after `retry_s`
    staleness      nothing heard for `stale_after_s` (a stream that stalls without breaking):
                   the index passes the worker over; a sweep every `heartbeat_s` drops it
    stop()         cancels every stream and ends the loop

The view lags the worker by at most `min_interval_s` plus one message's trip (a change), and is
trusted for at most `stale_after_s` without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.grpc_server import message_options
from router.index import LoadIndex
from router.pool import WorkerPool


class WorkerView:
    def __init__(
        self,
        pool: WorkerPool,
        heartbeat_s: float = 0.5,
        stale_after_s: float = 2.0,
        min_interval_s: float = 0.01,
        retry_s: float = 0.2,
    ) -> None:
        self.pool = pool
        self.index = LoadIndex(stale_after_s)
        self.heartbeat_s, self.min_interval_s, self.retry_s = heartbeat_s, min_interval_s, retry_s
        self.updates = 0  # messages received on every stream
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}  # name -> (address, its stream's task)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="router-view")
        self._main: asyncio.Future | None = None

    def start(self, wait_s: float = 5.0) -> None:
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self._loop)  # type: ignore[assignment]
        self.refresh(wait_s)

    def refresh(self, wait_s: float = 1.0) -> None:
        """Discovers again now and waits up to `wait_s` for each new worker's first snapshot."""
        self.pool.rediscover()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            asyncio.run_coroutine_threadsafe(self._sync(wait_s), self._loop).result(wait_s + 5)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- on the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_s, self.pool.refresh_s))
            self.index.sweep()
            await self._sync(0)

    async def _sync(self, wait_s: float) -> None:
        workers = await asyncio.to_thread(self.pool.workers)  # discovery may be a Ray call: off the loop
        gone = [n for n, (address, _) in self._tasks.items() if n not in workers or workers[n].address != address]
        for name in gone:
            self._tasks.pop(name)[1].cancel()
            self.index.remove(name)
        fresh = []
        for name, worker in workers.items():
            if name not in self._tasks:
                first = asyncio.get_running_loop().create_future()
                task = asyncio.create_task(self._watch(name, worker.address, first))
                self._tasks[name] = (worker.address, task)
                fresh.append(first)
        if fresh and wait_s:
            await asyncio.wait(fresh, timeout=wait_s)

    async def _watch(self, name: str, address: str, first: asyncio.Future) -> None:
        request = worker_pb2.WatchRequest(min_interval_seconds=self.min_interval_s, heartbeat_seconds=self.heartbeat_s)
        while True:
            async with _channel(address, self.pool.credentials) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).Watch(request, metadata=self.pool.metadata)
                try:
                    async for update in call:
                        self.updates += 1
                        if update.HasField("load"):
                            self.index.update(name, update.load)
                        else:
                            self.index.heard(name)
                        if not first.done():
                            first.set_result(None)
                except grpc.RpcError:
                    pass
                finally:
                    self.index.remove(name)  # out of placement the moment its stream ends
                    if not first.done():
                        first.set_result(None)  # nobody waits on a worker that cannot be reached
            self.pool.rediscover()
            await asyncio.sleep(self.retry_s)

    async def _close(self) -> None:
        if self._main is not None:
            self._main.cancel()
        tasks = [task for _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()


def _channel(address: str, credentials: grpc.ChannelCredentials | None, options: Sequence = ()) -> grpc.aio.Channel:
    options = [*message_options(), *options]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)
