"""The shell both gRPC workers extend: the server's lifecycle, the `tandem.v1.Worker` RPCs that do not
depend on the role (Abort, GetLoad, Watch, Drain), and the model load both workers' `from_config` share.

Lifecycle of a worker:

    __init__   the engine, the worker's id, its collective groups, telemetry, the cluster's auth (the
               secret and TLS) and the wedged-engine canary; nothing runs yet
    start      binds the gRPC server (`tandem.v1.Worker`, the role's other services, health and
               reflection) behind the cluster secret and TLS, on `grpc.aio` and an event loop of its
               own (`front`): the streams (Submit, Watch, Steps) are served there, a call that waits
               on the engine on the server's threads; serves metrics, then runs `_on_start()`
               (the role's background parts), the engine loop thread (`_run`) and the canary; returns
               the bound address
    Drain      from then on Submit answers UNAVAILABLE and health NOT_SERVING; it answers what remains
    stop       ends the engine loop and every Watch stream, stops the canary, runs `_before_server_stop()`
               (the decode worker's KV intake answers transfers in flight UNAVAILABLE), stops the server,
               runs `_after_server_stop()` (the prefill worker's KV senders close), closes the collective
               groups and flushes telemetry

A role writes Submit and the rest of what differs: `load()` (its load snapshot), `remaining()` (what
Drain reports), `_cancel` (what Abort does), `_busy()` (the canary's "holds work") and `_run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Generic, Protocol, TypeVar

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.aio_server import AioServer, LoopThread, start_aio_server
from cluster.auth import cluster_secret
from cluster.config import AuthConfig, ModelConfig, SchedulerConfig, TelemetryConfig
from cluster.engine.changes import Changes
from cluster.engine.kv_events import KVJournal
from cluster.engine.request import UnknownAdapter
from cluster.grpc_server import watch_loads
from cluster.kv.collective import CollectiveGroups
from cluster.model.causal_lm import CausalLM
from cluster.model.gguf import model_folder
from cluster.model.loader import load_model
from cluster.model.lora import Adapter, AdapterError
from cluster.model.tokenizer import Tokenizer
from cluster.telemetry import Telemetry
from cluster.tls import server_credentials
from cluster.watchdog import Watchdog


class WorkerEngine(Protocol):
    """What the shell reads of a role's engine: its batching limits and its prefix cache's journal."""

    @property
    def scheduler_config(self) -> SchedulerConfig: ...

    @property
    def kv_journal(self) -> KVJournal: ...

    @property
    def changes(self) -> Changes: ...

    def load_adapter(self, adapter: Adapter) -> None: ...

    def unload_adapter(self, name: str) -> None: ...


RUNTIME_LOADING_OFF = "loading adapters while serving is off on this worker (lora.runtime_loading)"
E = TypeVar("E", bound=WorkerEngine)
T = TypeVar("T")


class WorkerShell(worker_pb2_grpc.WorkerServicer, Generic[E], ABC):
    server_options: ClassVar[Sequence[tuple[str, int]]] = ()  # the role's extra gRPC channel arguments

    def __init__(
        self,
        engine: E,
        worker_id: str,
        groups: CollectiveGroups | None = None,
        telemetry: Telemetry | None = None,
        auth: AuthConfig | None = None,
        wedged_after_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.groups = groups
        self.telemetry = telemetry or Telemetry(TelemetryConfig(), f"tandem-{worker_id}")
        self.auth = auth or AuthConfig()  # the cluster secret and mutual TLS, when configured
        self.watchdog = Watchdog(self._busy, self._on_wedge, wedged_after_s)
        self.server: AioServer | None = None
        self.front: LoopThread | None = None  # the event loop the server's streams run on, once started
        self.executor: ThreadPoolExecutor | None = None  # the server's calls that wait on the engine
        # What the host does when this worker cannot go on (a decode worker whose engine core died):
        # nothing here; a Ray actor exits its process, so Ray starts it again.
        self.on_fatal: Callable[[], None] = lambda: None
        # Reads and checks a LoRA adapter loaded while serving: `reader(name, path)`; None refuses them.
        self.adapter_reader: Callable[[str, str], Adapter] | None = None
        self._lock = threading.Lock()  # the role's request tables, and what its engine loop shares
        self._stop = threading.Event()
        self._draining = False
        self._loop = threading.Thread(target=self._run, daemon=True, name=f"{worker_id}-engine")

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, address: str = "127.0.0.1:0") -> str:
        def add(server: grpc.aio.Server) -> list[str]:
            worker_pb2_grpc.add_WorkerServicer_to_server(self, server)
            return ["tandem.v1.Worker", *self._add_services(server)]

        config = self.engine.scheduler_config
        # Calls that wait on the engine (Abort, Drain, a KV push, a Submit's start) hold a thread
        # each while they wait: room for every sequence the worker may hold, and more for loads.
        self.executor = ThreadPoolExecutor(config.max_num_seqs + config.max_waiting + 64, f"{self.worker_id}-call")
        secret, credentials = cluster_secret(self.auth), server_credentials(self.auth, internal=True)
        self.front = LoopThread(f"{self.worker_id}-front")
        self.server = self.front.run(
            start_aio_server(add, address, secret, credentials, self.server_options, self.executor)
        )
        self.telemetry.metrics.serve(0, address.rsplit(":", 1)[0])
        self._on_start()
        self._loop.start()
        self.watchdog.start()
        return self.server.address

    def stop(self) -> None:
        self._stop.set()
        self.engine.changes.bump()  # wakes the engine loop and every Watch
        self.watchdog.stop()
        self._before_server_stop()
        front, server, self.front = self.front, self.server, None  # a second stop finds nothing to stop
        if front is not None:
            if server is not None:
                front.run(server.stop(None))
            front.stop()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        self._after_server_stop()
        if self.groups is not None:
            self.groups.close()
        self.telemetry.shutdown()

    def in_front(self, call: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """`call(*args)` on the server's threads, awaited from the front's loop: what a stream calls
        that may wait on the engine."""
        return asyncio.get_running_loop().run_in_executor(self.executor, call, *args)

    # -- the Worker RPCs both roles answer alike ---------------------------------------------------

    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResult:
        return worker_pb2.AbortResult(found=self._cancel(request.request_id))

    def GetLoad(self, request: worker_pb2.GetLoadRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerLoad:
        return self.load()

    async def Watch(
        self, request: worker_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerUpdate]:
        async for update in watch_loads(self.load, request, self._stop, self.engine.changes, self.engine.kv_journal):
            yield update

    def LoadAdapter(
        self, request: worker_pb2.LoadAdapterRequest, context: grpc.ServicerContext
    ) -> worker_pb2.AdapterResult:
        """Reads and checks the adapter here (a call's thread), then hands it to the engine between steps."""
        if self.adapter_reader is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, RUNTIME_LOADING_OFF)
        try:
            self.engine.load_adapter(self.adapter_reader(request.name, request.path))  # type: ignore[misc]
        except AdapterError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return worker_pb2.AdapterResult(workers=[self.worker_id])

    def UnloadAdapter(
        self, request: worker_pb2.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> worker_pb2.AdapterResult:
        if self.adapter_reader is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, RUNTIME_LOADING_OFF)
        try:
            self.engine.unload_adapter(request.name)
        except UnknownAdapter as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return worker_pb2.AdapterResult(workers=[self.worker_id])

    def Drain(self, request: worker_pb2.DrainRequest, context: grpc.ServicerContext) -> worker_pb2.DrainResult:
        self._draining = True
        self.engine.changes.bump()  # the load says so
        self._set_serving(False)
        return worker_pb2.DrainResult(remaining_seqs=self.remaining())

    # -- what each role writes ---------------------------------------------------------------------

    @abstractmethod
    def load(self) -> worker_pb2.WorkerLoad:
        """This worker's load snapshot (and its gauges set to it)."""

    @abstractmethod
    def remaining(self) -> int:
        """The sequences and transfers still on this worker, as Drain reports them."""

    @abstractmethod
    def _cancel(self, rid: str) -> bool:
        """Aborts `rid` wherever it is here; whether it was found."""

    @abstractmethod
    def _busy(self) -> bool:
        """Whether the engine holds work (a wedge is work held without a step)."""

    @abstractmethod
    def _run(self) -> None:
        """The engine loop, until `_stop` is set; calls `watchdog.progress()` on each turn."""

    def _add_services(self, server: grpc.aio.Server) -> list[str]:
        """Registers the role's services beside `tandem.v1.Worker`; returns their full names."""
        return []

    def _on_start(self) -> None:
        """The role's background parts, started once the server is bound."""

    def _before_server_stop(self) -> None:
        """What the role ends while its RPCs can still answer."""

    def _after_server_stop(self) -> None:
        """What the role ends once the server has stopped."""

    # -- internals ---------------------------------------------------------------------------------

    def _core_died(self) -> None:
        """The engine core process is gone (its requests have failed): this worker serves nothing more."""
        self._draining = True
        self.engine.changes.bump()  # the load says so
        self._set_serving(False)
        self.on_fatal()

    def _on_wedge(self, wedged: bool) -> None:
        self.engine.changes.bump()  # the load says so
        self._set_serving(not wedged and not self._draining)

    def _cancel_soon(self, rid: str, *args: object) -> None:
        """`_cancel(rid, *args)` on the server's threads, not waited for: the front's event loop never
        waits on the engine. Nothing once the worker stops (its engine goes with it)."""
        if self.executor is not None:
            with contextlib.suppress(RuntimeError):  # the executor has shut down
                self.executor.submit(self._cancel, rid, *args)

    def _set_serving(self, serving: bool) -> None:
        """Health's answer from now on (from any thread, without waiting for it)."""
        if self.front is not None and self.server is not None:
            self.front.soon(self.server.set_serving(serving))


def load_model_and_tokenizer(m: ModelConfig) -> tuple[CausalLM, Tokenizer]:
    """The configured model and its tokenizer, as both workers load them. A `.gguf` file becomes its
    imported folder here, once, and both read that folder."""
    folder = model_folder(m.path)
    quant = (m.weight_dtype, m.weight_group_size, m.quantize_lm_head)
    model = load_model(folder, m.dtype, m.device, *quant, m.prepack_weights, m.huge_pages)
    return model, Tokenizer(folder)
