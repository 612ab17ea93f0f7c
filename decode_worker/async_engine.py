"""An asyncio front for the decode engine: one async iterator per request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from cluster.engine.request import SamplingParams
from decode_worker.engine import Engine
from decode_worker.text import RequestOutput


class AsyncEngine:
    """One async iterator per request over an `Engine` stepped in a worker thread.

    A lock keeps the engine to one thread at a time: adds happen between steps, and aborts are
    applied before the next step. Leaving the iterator early (a cancelled client) aborts the
    request and frees its blocks. If a step fails, every open iterator raises the error.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._pending_aborts: list[str] = []
        self._loop_task: asyncio.Task[None] | None = None

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        async with self._lock:
            self.engine.add_request(request_id, prompt_token_ids, params)
            self._queues[request_id] = queue
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._pending_aborts.append(request_id)
                self._wake.set()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending_aborts or self.engine.has_unfinished:
                async with self._lock:
                    for rid in self._pending_aborts:
                        self.engine.abort(rid)
                    self._pending_aborts.clear()
                    try:
                        outputs = await asyncio.to_thread(self.engine.step)
                    except Exception as e:  # a failed step fails every open request, loudly
                        for rid, queue in list(self._queues.items()):
                            self.engine.abort(rid)
                            queue.put_nowait(e)
                        continue
                for out in outputs:
                    if (queue := self._queues.get(out.request_id)) is not None:
                        queue.put_nowait(out)
