"""Emulated workers for measuring the router alone: no model, real gRPC. One event loop hosts many
workers, each a `tandem.v1.Worker` server on its own port with its own name, load, `Watch` stream
and step time, so a thousand of them cost one process and a few threads.

A fake decode worker streams `max_tokens` tokens, one per `step_s` (the first after one step);
token `i` of a request is a pure function of its prompt and `i`, so a migrated or resumed request
continues exactly as it would have. Its load is its running streams; `Watch` pushes a snapshot on
each change (at most one per `min_interval_seconds`) and a heartbeat otherwise. A fake prefill
worker answers `Submit` with the first token after one step and ends after another (its KV
transfer); a fake decode worker with `remote_prefill` streams from that first token on.

    python -m tests.fake_workers --workers 256 --step-s 0.001     # prints {"name": "host:port"}
    python -m tests.fake_workers --router-over '{"decode-0": ...}' [--address 127.0.0.1:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import threading
from collections.abc import AsyncIterator, Sequence

import grpc
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

from cluster.engine.block_names import UNNAMED_MODEL, chain
from cluster.engine.kv_events import KVJournal
from cluster.grpc_server import kv_events_message, message_options

VOCAB = 1000


def fake_token(prompt: Sequence[int], index: int) -> int:
    """Token `index` of the output for `prompt`: the same wherever and whenever it is computed."""
    return (sum(prompt) * 31 + len(prompt) * 7 + index * 13) % (VOCAB - 10) + 10


class Died(Exception):
    """The fake worker died: every stream of it breaks with UNAVAILABLE."""


class FakeTokenizer:
    """Words to ids and back: token `t` is the word `t<t>`."""

    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, w)) % (VOCAB - 10) + 10 for w in text.split()]

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"t{i} " for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return f"t{token_id} ".encode()


class FakeCache:
    """A prefix cache of `capacity` blocks, least recently used evicted first, that tells a
    `KVJournal` what it stores and evicts, as a real worker's block manager does."""

    def __init__(self, capacity: int, block_size: int = 16) -> None:
        self.capacity, self.block_size = capacity, block_size
        self.journal = KVJournal()
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def lookup(self, tokens: Sequence[int]) -> int:
        """Leading tokens of `tokens` whose KV is cached (whole blocks, never the last token)."""
        cached = 0
        for block_hash in chain(tokens[:-1], self.block_size, UNNAMED_MODEL):
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            cached += self.block_size
        return cached

    def store(self, tokens: Sequence[int]) -> None:
        """Caches the full blocks of `tokens`, whose KV was computed."""
        for block_hash in chain(tokens, self.block_size, UNNAMED_MODEL):
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                continue
            self._blocks[block_hash] = None
            self.journal.stored(block_hash)
            if len(self._blocks) > self.capacity:
                self.journal.removed(self._blocks.popitem(last=False)[0])


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        name: str,
        role: str = "decode",
        step_s: float = 0.001,
        total_kv_blocks: int = 4096,
        cache_blocks: int = 0,
        prefill_s_per_token: float = 0.0,
    ) -> None:
        self.name, self.role, self.step_s = name, role, step_s
        self.total_kv_blocks = total_kv_blocks
        # With `cache_blocks`, a prefix cache whose events Watch pushes; a prompt then takes
        # `prefill_s_per_token` for each token it does not find cached.
        self.cache = FakeCache(cache_blocks) if cache_blocks else None
        self.prefill_s_per_token = prefill_s_per_token
        self.prompt_tokens = self.cached_tokens = 0  # prompts prefilled here, and the part found cached
        self.running = 0
        self.draining = False
        self.refuse_watch = False  # a worker that cannot be watched: every Watch call fails at once
        self.fail_after = -1  # >= 0: the worker dies (`die`) once a Submit has sent this many messages
        # With fail_after, its calls fail but its Watch streams keep beating: the router hears of the
        # death only from the failed call.
        self.watch_survives = False
        # The finish reason in a message of its own after the last token (as a decode worker sends
        # it when a request's grammar ends or a stop string completes across steps).
        self.finish_apart = False
        self.dead = False
        self.submitted = 0  # requests taken (by Submit or a step stream)
        self.step_streams = 0  # Steps calls opened
        self.cancelled = 0  # requests cancelled by a step stream's command
        self.resumed = 0  # of them, requests that came with output already generated (moved or resumed)
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self._listeners: set[asyncio.Event] = set()  # one per open Watch call
        self._epoch = 0  # bumped to break every open Watch call

    async def start(self, host: str = "127.0.0.1") -> str:
        self.server = grpc.aio.server(options=message_options())
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port(f"{host}:0")
        await self.server.start()
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    def load(self) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(
            worker_id=self.name, role=self.role, running_seqs=self.running, free_kv_blocks=self.total_kv_blocks,
            total_kv_blocks=self.total_kv_blocks, draining=self.draining,
        )  # fmt: skip

    def set_draining(self, draining: bool) -> None:
        self.draining = draining
        self._notify()

    def set_running(self, running: int) -> None:
        """Pretends to run `running` sequences (on the loop)."""
        self.running = running
        self._notify()

    def break_watches(self) -> None:
        """Ends every open `Watch` call with UNAVAILABLE, as a dying worker's would (on the loop)."""
        self._epoch += 1
        self._notify()

    def die(self) -> None:
        """As a killed worker (on the loop): every stream breaks, and it can no longer be watched."""
        self.dead = self.refuse_watch = True
        self.break_watches()

    def _maybe_die(self, sent: int) -> None:
        if sent == self.fail_after:
            if self.watch_survives:
                self.dead = True
            else:
                self.die()
        if self.dead:
            raise Died(f"{self.name} died")

    def _notify(self) -> None:
        for changed in self._listeners:
            changed.set()

    # -- tandem.v1.Worker --------------------------------------------------------------------------

    async def Submit(self, request: worker_pb2.WorkerRequest, context) -> AsyncIterator[worker_pb2.WorkerTokens]:  # type: ignore[no-untyped-def,override]
        try:
            async for message in self._messages(request):
                yield message
        except Died as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Steps(self, commands, context) -> AsyncIterator[worker_pb2.StepFrame]:  # type: ignore[no-untyped-def,override]
        """Every request of one router: each runs as Submit's would, its messages batched into one
        frame per wake of this stream; a death breaks the whole stream, as a dead worker's would."""
        pending: asyncio.Queue[worker_pb2.WorkerTokens | Died] = asyncio.Queue()
        running: dict[str, asyncio.Task] = {}

        async def run(request: worker_pb2.WorkerRequest) -> None:
            try:
                async for message in self._messages(request):
                    pending.put_nowait(message)
            except Died as e:
                pending.put_nowait(e)
            finally:
                running.pop(request.request_id, None)

        async def read() -> None:
            async for command in commands:
                if command.HasField("submit"):
                    rid = command.submit.request_id
                    running[rid] = asyncio.create_task(run(command.submit))
                elif (task := running.pop(command.cancel, None)) is not None:
                    self.cancelled += 1
                    task.cancel()

        self.step_streams += 1
        reader = asyncio.create_task(read())
        try:
            while True:
                messages = [await pending.get()]
                while not pending.empty():
                    messages.append(pending.get_nowait())
                died = next((i for i, m in enumerate(messages) if isinstance(m, Died)), None)
                if died is None:
                    yield worker_pb2.StepFrame(tokens=messages)
                    continue
                if died:
                    yield worker_pb2.StepFrame(tokens=messages[:died])  # what went out before the death
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(messages[died]))
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()

    async def _messages(self, request: worker_pb2.WorkerRequest) -> AsyncIterator[worker_pb2.WorkerTokens]:
        """A request's messages, as Submit streams them; raises `Died` when the worker dies."""
        self.submitted += 1
        self.resumed += bool(request.output_token_ids)
        self.running += 1
        self._notify()
        try:
            prompt, done = list(request.prompt_token_ids), len(request.output_token_ids)
            context_tokens = [*prompt, *request.output_token_ids]
            if self.role == "prefill":
                cached = await self._prefill(context_tokens)
                await asyncio.sleep(self.step_s)
                self._maybe_die(0)
                yield worker_pb2.WorkerTokens(
                    request_id=request.request_id, token_ids=[fake_token(prompt, done)], num_cached_tokens=cached
                )
                await asyncio.sleep(self.step_s)  # the KV transfer: the call ends once it landed
                return
            max_tokens = request.sampling.max_tokens or 16
            cached = 0
            if request.remote_prefill:
                await asyncio.sleep(2 * self.step_s)  # the prefill worker's step and the KV transfer
                if self.cache is not None:
                    self.cache.store(context_tokens)
            else:
                cached = await self._prefill(context_tokens)
            output = list(request.output_token_ids)
            for index in range(done, max_tokens):
                await asyncio.sleep(self.step_s)
                self._maybe_die(index - done)
                token = fake_token(prompt, index)
                output.append(token)
                last = index == max_tokens - 1
                if last and self.cache is not None:
                    self.cache.store([*prompt, *output[:-1]])  # the last token's KV is never computed
                    self._notify()
                finish = api_pb2.FINISH_REASON_LENGTH if last and not self.finish_apart else None
                yield worker_pb2.WorkerTokens(
                    request_id=request.request_id, token_ids=[token], text=f"t{token} ",
                    num_prompt_tokens=len(prompt), num_cached_tokens=cached, finish_reason=finish,
                )  # fmt: skip
            if self.finish_apart:
                self._maybe_die(max_tokens - done)
                yield worker_pb2.WorkerTokens(request_id=request.request_id, finish_reason=api_pb2.FINISH_REASON_LENGTH)
            self._maybe_die(max_tokens - done + self.finish_apart)  # after every message
        finally:
            self.running -= 1
            self._notify()

    async def _prefill(self, tokens: list[int]) -> int:
        """Prefills `tokens` here: their uncached part costs `prefill_s_per_token` each. Returns
        the tokens found cached."""
        cached = 0 if self.cache is None else self.cache.lookup(tokens)
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        if self.prefill_s_per_token:
            await asyncio.sleep((len(tokens) - cached) * self.prefill_s_per_token)
        if self.cache is not None:
            self.cache.store(tokens)
            self._notify()
        return cached

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResult:  # type: ignore[no-untyped-def,override]
        return worker_pb2.AbortResult(found=False)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context) -> worker_pb2.WorkerLoad:  # type: ignore[no-untyped-def,override]
        return self.load()

    async def Drain(self, request: worker_pb2.DrainRequest, context) -> worker_pb2.DrainResult:  # type: ignore[no-untyped-def,override]
        self.set_draining(True)
        return worker_pb2.DrainResult(remaining_seqs=self.running)

    async def Watch(self, request: worker_pb2.WatchRequest, context) -> AsyncIterator[worker_pb2.WorkerUpdate]:  # type: ignore[no-untyped-def,override]
        if self.refuse_watch:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} takes no watchers")
        interval = max(request.min_interval_seconds or 0.01, 0.001)
        heartbeat = max(request.heartbeat_seconds or 0.5, interval)
        changed, epoch = asyncio.Event(), self._epoch
        self._listeners.add(changed)
        journal = self.cache.journal if self.cache is not None and request.kv_events else None
        last, sequence, cursor = None, 0, None
        try:
            while self._epoch == epoch:
                current = self.load()
                sequence += 1
                update = worker_pb2.WorkerUpdate(load=current if current != last else None, sequence=sequence)
                batch = None if journal is None else journal.since(cursor)
                if batch is not None:
                    update.kv.CopyFrom(kv_events_message(batch))
                    cursor = batch.last
                yield update
                last = current
                await asyncio.sleep(interval)  # the rate limit
                unchanged = journal is None or journal.sequence == cursor
                if self.load() == last and unchanged and self._epoch == epoch:
                    changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), heartbeat - interval)
        finally:
            self._listeners.discard(changed)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}'s watch stream broke")


class FakeFleet:
    """Many fake workers on one event loop in a thread of their own (for tests in one process)."""

    def __init__(self) -> None:
        self.workers: dict[str, FakeWorker] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fake-workers")
        self._thread.start()

    def add(self, name: str, role: str = "decode", step_s: float = 0.001, **kwargs) -> FakeWorker:  # type: ignore[no-untyped-def]
        worker = self.call(_make(name, role, step_s, kwargs))
        self.workers[name] = worker
        return worker

    def remove(self, name: str) -> None:
        self.call(self.workers.pop(name).stop())

    def call(self, coroutine):  # type: ignore[no-untyped-def]
        """Runs `coroutine` on the fleet's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def on_loop(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        self.loop.call_soon_threadsafe(fn, *args)

    def addresses(self) -> dict[str, str]:
        return {name: w.address for name, w in self.workers.items()}

    def close(self) -> None:
        for name in list(self.workers):
            self.remove(name)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def _make(name: str, role: str, step_s: float, kwargs: dict) -> FakeWorker:
    worker = FakeWorker(name, role, step_s, **kwargs)
    await worker.start()
    return worker


async def _serve(args: argparse.Namespace) -> None:
    cache = {"cache_blocks": args.cache_blocks, "prefill_s_per_token": args.prefill_s_per_token}
    workers = [FakeWorker(f"decode-{i}", "decode", args.step_s, **cache) for i in range(args.workers)]
    workers += [FakeWorker(f"prefill-{i}", "prefill", args.step_s, **cache) for i in range(args.prefill_workers)]
    addresses = {w.name: await w.start() for w in workers}
    print(json.dumps(addresses), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    for w in workers:
        await w.stop()


def serve_router(addresses: dict[str, str], address: str, max_queued_requests: int = 4096) -> None:
    """A router process over fake workers: prints its address, serves until stdin closes."""
    from cluster.config import TelemetryConfig
    from cluster.telemetry import Telemetry
    from router.placement.discovery import WorkerDiscovery
    from router.service.server import Router
    from router.service.settings import RouterSettings
    from router.service.validate import Limits

    settings = RouterSettings(
        model_name="fake", architecture="fake", limits=Limits(4096, VOCAB), block_size=16, eos_token_ids=(),
        has_chat_template=False, dtype="none", max_queued_requests=max_queued_requests,
    )  # fmt: skip
    router = Router(
        settings, FakeTokenizer(), WorkerDiscovery(lambda: addresses), Telemetry(TelemetryConfig(), "router")
    )
    print(router.start(address), flush=True)
    sys.stdin.read()
    router.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16, help="fake decode workers")
    parser.add_argument("--prefill-workers", type=int, default=0, help="fake prefill workers")
    parser.add_argument("--step-s", type=float, default=0.001, help="each worker's time per token")
    parser.add_argument("--cache-blocks", type=int, default=0, help="each worker's prefix cache, in blocks (0: none)")
    parser.add_argument("--prefill-s-per-token", type=float, default=0.0, help="prefill time per uncached token")
    parser.add_argument("--router-over", help="run a router instead, over these workers (JSON name -> address)")
    parser.add_argument("--address", default="127.0.0.1:0", help="the router's address (a shared port: SO_REUSEPORT)")
    args = parser.parse_args(argv)
    if args.router_over:
        serve_router(json.loads(args.router_over), args.address)
    else:
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
