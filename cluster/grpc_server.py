"""One way to start a gRPC server for every Tandem role: explicit message limits, the standard
`grpc.health.v1` health service, server reflection, and a bound port reported back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tandem.v1 import api_pb2, worker_pb2

from cluster.engine.changes import AdapterState, Changes
from cluster.engine.kv_events import KVBatch, KVJournal
from cluster.engine.request import SamplingParams, UnknownAdapter, params_from_proto

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20


def message_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


@dataclass
class Server:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    executor: futures.ThreadPoolExecutor | None = None  # the calls' threads, which grpc's stop leaves running

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)

    def stop(self, grace: float | None = None) -> None:
        self.set_serving(False)
        self.server.stop(grace)
        if self.executor is not None:  # calls under way finish; the idle threads end
            self.executor.shutdown(wait=False)


def start_server(
    add_services: Callable[[grpc.Server], Sequence[str]],
    address: str = "127.0.0.1:0",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int = 64,
    extra_options: Sequence[tuple[str, int]] = (),
    interceptors: Sequence[grpc.ServerInterceptor | None] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> Server:
    """Starts a server; `add_services(server)` registers the role's services and returns their full names.
    `interceptors` (None entries skipped) see every call first: authentication. With `credentials`
    the port speaks TLS only."""
    executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grpc-call")
    server = grpc.server(
        executor,
        options=[*message_options(max_message_bytes), *extra_options],
        interceptors=[i for i in interceptors if i is not None],
    )
    names = list(add_services(server))
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind a gRPC server to {address}")
    server.start()
    result = Server(server, port, checker, executor)
    result.set_serving(True)
    return result


class Refused(Exception):
    """A worker will not take a request: the status the caller gets, and why."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def check_submit(
    worker: str, draining: bool, sampling: api_pb2.SamplingParams, waiting: int, limit: int
) -> SamplingParams:
    """A worker's checks before it takes a request: not draining (UNAVAILABLE), sampling parameters
    that hold (INVALID_ARGUMENT), room in its queue (RESOURCE_EXHAUSTED). Raises `Refused`."""
    if draining:
        raise Refused(grpc.StatusCode.UNAVAILABLE, f"{worker} is draining")
    try:
        params = params_from_proto(sampling)
    except ValueError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}") from None
    if waiting >= limit:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{worker} has {waiting} requests waiting")
    return params


async def admit_submit(
    context: grpc.aio.ServicerContext,
    worker: str,
    draining: bool,
    sampling: api_pb2.SamplingParams,
    waiting: int,
    limit: int,
) -> SamplingParams:
    """`check_submit` for a `Worker.Submit`: a refusal ends the call with its status."""
    try:
        return check_submit(worker, draining, sampling, waiting, limit)
    except Refused as e:
        await context.abort(e.code, e.details)
        raise  # context.abort raises; this line is for the type checker


def refusal_code(e: Exception) -> grpc.StatusCode:
    """The status of a request an engine refused: NOT_FOUND for an adapter it does not serve, else
    INVALID_ARGUMENT (a request that can never run there)."""
    return grpc.StatusCode.NOT_FOUND if isinstance(e, UnknownAdapter) else grpc.StatusCode.INVALID_ARGUMENT


def adapters_message(adapters: Sequence[AdapterState]) -> list[worker_pb2.LoadedAdapter]:
    """A worker's LoRA adapters as its load reports them."""
    return [
        worker_pb2.LoadedAdapter(name=a.name, digest=a.digest, resident=a.resident, retiring=a.retiring)
        for a in adapters
    ]


def kv_events_message(batch: KVBatch) -> worker_pb2.KVEvents:
    """A journal's batch as `WorkerUpdate.kv` carries it."""
    return worker_pb2.KVEvents(
        first=batch.first,
        last=batch.last,
        stored=batch.stored,
        removed=batch.removed,
        snapshot=batch.snapshot,
        root=batch.root,
        tiers=[worker_pb2.TierBlocks(tier=t.tier, stored=t.stored, removed=t.removed) for t in batch.tiers],
    )


async def watch_loads(
    load: Callable[[], worker_pb2.WorkerLoad],
    request: worker_pb2.WatchRequest,
    stopped: threading.Event,
    changes: Changes,
    journal: KVJournal | None = None,
) -> AsyncIterator[worker_pb2.WorkerUpdate]:
    """A worker's `Worker.Watch`, on its event loop: the load at once, again whenever it changes (at
    most one snapshot per `min_interval_seconds`), and a heartbeat after `heartbeat_seconds` without
    a message. It looks at the load only when the engine's `changes` moved, or a heartbeat is due.
    With `kv_events` asked for and a `journal`, each message also carries the prefix cache's events
    since the last (a snapshot first). It ends with the call (cancelled) or when the worker stops
    (`stopped` set, then `changes` bumped)."""
    interval = max(request.min_interval_seconds or 0.01, 0.001)
    heartbeat = max(request.heartbeat_seconds or 0.5, interval)
    events = journal if request.kv_events else None
    last, sent_at, sequence, cursor, seen = None, 0.0, 0, None, -1
    while not stopped.is_set():
        now = time.monotonic()
        due = now - sent_at >= heartbeat
        if changes.version != seen or due:
            seen = changes.version
            current = load()
            batch = None if events is None else events.since(cursor)
            if current != last or batch is not None:
                sequence += 1
                update = worker_pb2.WorkerUpdate(load=current, sequence=sequence)
                if batch is not None:
                    update.kv.CopyFrom(kv_events_message(batch))
                    cursor = batch.last
                yield update
                last, sent_at = current, now
            elif due:
                sequence += 1
                yield worker_pb2.WorkerUpdate(sequence=sequence)
                sent_at = now
        await asyncio.sleep(interval)  # at most one snapshot per interval; then asleep until a change or a heartbeat
        await changes.changed(seen, min(1.0, max(0.0, heartbeat - (time.monotonic() - sent_at))))
