"""The router: the public `tandem.v1.Tandem` service, and `tandem.v1.Admin` for `tandem status`.

It runs on `grpc.aio`: one event loop, on a thread of its own, serves every stream and makes every
worker call, so thousands of concurrent streams need no thread each; `start`, `drain` and `stop`
are plain calls for callers that are not async.

Lifecycle of a request:

    Generate      validate and tokenise (INVALID_ARGUMENT naming the field); take an admission
                  slot (RESOURCE_EXHAUSTED when `max_queued_requests` are in flight)
    place         from the loads the workers push (`router.placement.view`; no RPC per request), choose a
                  decode worker and a prefill worker or local prefill (`router.placement.index`); the
                  choice goes out as response metadata (`tandem-prefill`, `tandem-decode`) and
                  is counted in `Admin.GetStatus`
    relay         the decode worker's messages are the response stream, relayed as they came with
                  what the router adds appended (`router.service.dispatch`); the prefill call runs beside
                  it and its failure fails the request with its code
    end           client cancellation or deadline cancels both worker calls, which abort the
                  request and free its KV on each worker

Ray's state (`ray_changed`, from `cluster.lifeline`) decides what is refused (`router.service.ray_gate`)
and the health: SERVING unless draining or lost; its "tandem.ray" service SERVING while the GCS answers.
A call to the pool controllers that Ray cannot make (`ClusterUnavailable`) is UNAVAILABLE with its message.

A router started with `start` may `join` the cluster's registry (`router.service.fleet`): then it reports
its counters there and its `Admin.GetStatus` shows every live router, with the in-flight requests
and placement decisions summed over them; `stop` leaves.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

from cluster.aio_server import AioServer, LoopThread, start_aio_server
from cluster.auth import RequireKey, client_keys, secret_metadata
from cluster.config import ClusterConfig
from cluster.engine.structured import for_tokenizer
from cluster.grpc_server import Refused
from cluster.lifeline import DRAINING, LOST, OK, RAY_HEALTH, ClusterUnavailable
from cluster.model.arch import ModelArch
from cluster.model.gguf import model_folder
from cluster.model.tokenizer import Tokenizer
from cluster.slo import SLOWindow, Targets
from cluster.telemetry import Telemetry, extract
from cluster.tls import channel_credentials, server_credentials
from router.placement.discovery import WorkerDiscovery
from router.placement.prefix_index import PrefixIndex
from router.placement.view import WorkerView
from router.service import adapters
from router.service.dispatch import Abort, Dispatcher
from router.service.fleet import Fleet, RouterRegistry, advertised, router_name, totals
from router.service.ray_gate import RayGate
from router.service.settings import PoolAdmin, RouterSettings, settings_from_config
from router.service.stream import Malformed, Stream, account, parse
from router.service.validate import InvalidRequest, PromptTokenizer, validate


class Router(worker_pb2_grpc.AdminServicer):
    def __init__(
        self,
        settings: RouterSettings,
        tokenizer: PromptTokenizer,
        pool: WorkerDiscovery,
        telemetry: Telemetry,
        pools: PoolAdmin | None = None,
        interceptor: RequireKey | None = None,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.settings = settings
        self.credentials = credentials  # TLS on the public port, when configured
        self.interceptor = interceptor  # client API keys, when configured
        self.pools = pools
        self.telemetry = telemetry
        self.slo = SLOWindow(settings.slo.window_s)
        self.tokenizer = tokenizer
        # Structured-output constraints are compiled here to refuse bad ones (cached by hash).
        self.grammars = for_tokenizer(tokenizer, settings.limits.vocab_size, settings.eos_token_ids)
        self.pool = pool
        self.loop = LoopThread()
        prefix = PrefixIndex(settings.prefix_index_max_blocks) if settings.prefix_routing == "kv" else None
        self.view = WorkerView(
            pool, settings.watch_heartbeat_s, settings.watch_stale_after_s, loop=self.loop, prefix=prefix
        )
        self.dispatcher = Dispatcher(settings, self.view, telemetry, tokenizer)
        self._in_flight = 0  # touched on the loop only
        self._draining = False
        self.ray = RayGate()  # Ray's state as the lifeline last said it, and what it refuses
        self.server: AioServer | None = None
        self.name = router_name()
        self.address = ""  # as other routers' status shows it, once started
        self.fleet: Fleet | None = None

    def start(self, address: str = "127.0.0.1:0") -> str:
        self.view.start()

        def add(server: grpc.aio.Server) -> list[str]:
            server.add_generic_rpc_handlers((self._public_handlers(),))
            worker_pb2_grpc.add_AdminServicer_to_server(self, server)
            return ["tandem.v1.Tandem", "tandem.v1.Admin"]

        self.server = self.loop.run(start_aio_server(add, address, self.interceptor, self.credentials))
        self.address = advertised(address, self.server.port)
        self.telemetry.metrics.serve(self.settings.metrics_port)
        return self.server.address

    def join(self, registry: RouterRegistry) -> str:
        """Registers this started router among the cluster's routers and reports its status about
        once a second, so that every router's `GetStatus` lists it; `stop` leaves. Returns its name."""
        self.fleet = Fleet(registry, self.name, self.address, self._own_status)
        self.loop.run(self.fleet.join())
        return self.name

    @property
    def decisions(self):  # type: ignore[no-untyped-def]
        """Placement counts by decision ("prefill=remote:prefix-owner", ...)."""
        return self.dispatcher.decisions

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished."""
        return self._in_flight

    def drain(self, timeout_s: float) -> bool:
        """Graceful shutdown's first half: health turns NOT_SERVING at once, new requests get
        UNAVAILABLE, and requests in flight run to their end. True if they all ended in time."""
        self._draining = True
        if self.server is not None:
            self.loop.run(self.server.set_serving(False))
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._in_flight == 0

    def ray_changed(self, state: str, reason: str) -> None:
        """Ray's state (`cluster.lifeline`: ok, degraded, draining or lost) and why: health and what
        is refused follow it. Requests in flight run on in every state; once lost, they end as their
        workers do."""
        self.ray = RayGate(state, reason)
        self.telemetry.metrics.ray_state.state(state)
        if self.server is not None:
            serving = state not in (DRAINING, LOST) and not self._draining
            self.loop.run(self.server.set_serving(serving))
            self.loop.run(self.server.set_serving(state == OK, RAY_HEALTH))

    def stop(self) -> None:
        if self.fleet is not None and not self.ray.lost:  # a lost registry cannot be left
            self.loop.run(self.fleet.leave())
        if self.server is not None:
            self.loop.run(self.server.stop(None))
        self.loop.run(self._close_links())
        self.view.stop()
        self.loop.stop()
        self.pool.close()
        self.telemetry.shutdown()

    async def _close_links(self) -> None:
        self.dispatcher.links.close()

    # -- tandem.v1.Tandem --------------------------------------------------------------------------

    async def GetModelInfo(self, request: api_pb2.GetModelInfoRequest, context) -> api_pb2.ModelInfo:  # type: ignore[no-untyped-def]
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
        s = self.settings
        return api_pb2.ModelInfo(
            name=s.model_name,
            architecture=s.architecture,
            context_length=s.limits.context_length,
            vocab_size=s.limits.vocab_size,
            dtype=s.dtype,
            eos_token_ids=s.eos_token_ids,
            has_chat_template=s.has_chat_template,
            adapters=self.view.index.adapter_names(),
        )

    def _public_handlers(self) -> grpc.GenericRpcHandler:
        """`tandem.v1.Tandem` with requests parsed so that malformed bytes are INVALID_ARGUMENT
        (gRPC's own parsing failure would be INTERNAL); Generate's responses are bytes already."""
        return grpc.method_handlers_generic_handler(
            "tandem.v1.Tandem",
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.Generate, request_deserializer=parse(api_pb2.GenerateRequest),
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self.GetModelInfo, request_deserializer=parse(api_pb2.GetModelInfoRequest),
                    response_serializer=api_pb2.ModelInfo.SerializeToString,
                ),
            },
        )  # fmt: skip

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
        received = time.time()
        rid = request.request_id or uuid.uuid4().hex
        parent = extract(context.invocation_metadata())  # continues a client's traceparent
        root = self.telemetry.tracer.start_span(
            "router.generate", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"gen_ai.request.model": self.settings.model_name, "tandem.request_id": rid},
        )  # fmt: skip
        status, admitted, abort = "error", False, None
        try:
            with_model_defaults(request.sampling, self.settings.sampling_defaults)
            prompt, params = validate(request, self.settings.limits, self.tokenizer, self.grammars)
            if (refused := self.ray.refuses_requests()) is not None:
                status = "rejected"
                raise Abort(grpc.StatusCode.UNAVAILABLE, refused)
            if self._draining:
                status = "rejected"
                raise Abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down; retry elsewhere")
            if self._in_flight >= self.settings.max_queued_requests:
                status = "rejected"
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the router's admission queue is full; retry later")
            self._in_flight += 1
            admitted = True
            stream = Stream(rid, prompt, received, self._targets(request))
            if params.logprobs is not None or params.prompt_logprobs is not None:
                stream.token_bytes = self.tokenizer.token_bytes
            if request.HasField("resume"):  # a stream whose router died: a migration with its tokens
                stream.rid = request.resume.request_id
                stream.resumed(request.resume, self.tokenizer.decode)
                root.set_attribute("tandem.resumed_tokens", len(request.resume.token_ids))
            if request.return_prompt_text:
                stream.prompt_text = self.tokenizer.decode(prompt)
            try:
                async for raw in self.dispatcher.generate(stream, params, context, trace.set_span_in_context(root)):
                    yield raw
            finally:
                status = stream.status
            account(self.telemetry, self.slo, root, stream)
        except InvalidRequest as e:
            status, abort = "invalid", Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Abort as e:
            abort = e
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            if admitted:
                self._in_flight -= 1
            if status == "error" and context.cancelled():
                status = "cancelled"
            self.telemetry.metrics.requests.labels(status, self._mode(root)).inc()
            root.set_attribute("tandem.status", status)
            root.end()
        if abort is not None:
            await context.abort(abort.code, abort.details)

    # -- tandem.v1.Admin ---------------------------------------------------------------------------

    async def Scale(self, request: worker_pb2.ScaleRequest, context) -> worker_pb2.ScaleResult:  # type: ignore[no-untyped-def,override]
        if self.pools is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router has no pool controllers to scale")
        await self._refuse(context, self.ray.refuses_scaling())
        replan = request.HasField("planned") or request.clear_planned
        if replan and (request.HasField("replicas") or (request.HasField("planned") and request.clear_planned)):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a Scale request sets replicas, planned or clear_planned: one of them"
            )
        try:
            if replan:
                planned = request.planned if request.HasField("planned") else None
                pool = await asyncio.to_thread(self.pools.plan, request.pool, planned)  # type: ignore[union-attr]
            else:
                replicas = request.replicas if request.HasField("replicas") else None
                pool = await asyncio.to_thread(self.pools.scale, request.pool, replicas)  # type: ignore[union-attr]
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ClusterUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return worker_pb2.ScaleResult(pool=pool)

    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest, context) -> worker_pb2.AdapterResult:  # type: ignore[no-untyped-def,override]
        return await self._adapters(context, adapters.load, request)

    async def UnloadAdapter(self, request: worker_pb2.UnloadAdapterRequest, context) -> worker_pb2.AdapterResult:  # type: ignore[no-untyped-def,override]
        return await self._adapters(context, adapters.unload, request.name)

    async def ListAdapters(self, request: worker_pb2.ListAdaptersRequest, context) -> worker_pb2.AdapterList:  # type: ignore[no-untyped-def,override]
        return adapters.placements(self.view.index.loads())

    async def _adapters(self, context, change, arg) -> worker_pb2.AdapterResult:  # type: ignore[no-untyped-def]
        """An adapter loaded on (or unloaded from) every worker in view, refused unless lora.runtime_loading."""
        await self._refuse(context, self.ray.refuses_calls())
        if not self.settings.adapters_at_runtime:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, adapters.RUNTIME_LOADING_OFF)
        workers = await asyncio.to_thread(self.pool.workers)
        stubs = {n: worker_pb2_grpc.WorkerStub(c[1]) for n in workers if (c := self.view.channel(n)) is not None}
        try:
            return worker_pb2.AdapterResult(workers=await change(stubs, arg, self.pool.metadata))
        except Refused as e:
            await context.abort(e.code, e.details)

    async def GetStatus(self, request: worker_pb2.GetStatusRequest, context) -> worker_pb2.ClusterStatus:  # type: ignore[no-untyped-def,override]
        await self._refuse(context, self.ray.refuses_calls())
        workers = await asyncio.to_thread(self.pool.workers)
        loads = await self._loads(sorted(workers))
        pools = []
        try:
            if self.pools is not None and self.ray.state == OK:  # without Ray's GCS, no pool rows: `ray` says why
                pools = await asyncio.to_thread(self.pools.pool_status)
        except ClusterUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        own = self._own_status()
        routers = await self.fleet.routers(own) if self.fleet is not None else [own]
        in_flight, decisions = totals(routers)
        status = worker_pb2.ClusterStatus(
            pools=pools,
            model=self.settings.model_name,
            workers=[
                worker_pb2.WorkerStatus(name=n, address=w.address, healthy=n in loads, load=loads.get(n))
                for n, w in sorted(workers.items())
            ],
            decisions=decisions,
            requests_in_flight=in_flight,
            metrics_address=own.metrics_address,
            routers=routers,
            ray=self.ray.status(),
        )
        for field in ("slo_attainment", "ttft_p90_seconds", "tpot_p90_seconds"):
            if own.HasField(field):
                setattr(status, field, getattr(own, field))
        return status

    # -- internals ---------------------------------------------------------------------------------

    @staticmethod
    async def _refuse(context, why: str | None) -> None:  # type: ignore[no-untyped-def]
        """UNAVAILABLE with `why`, unless it is None (`RayGate`'s refusals)."""
        if why is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)

    def _own_status(self) -> worker_pb2.RouterStatus:
        """This router's counters as they are (called on the loop, where they change)."""
        ttft, tpot = self.slo.latency()
        return worker_pb2.RouterStatus(
            name=self.name,
            address=self.address,
            metrics_address=self.telemetry.metrics.address or "",
            requests_in_flight=self._in_flight,
            decisions=dict(self.decisions),
            slo_attainment=self.slo.attainment(),
            ttft_p90_seconds=ttft,
            tpot_p90_seconds=tpot,
        )

    async def _loads(self, names: list[str]) -> dict[str, worker_pb2.WorkerLoad]:
        """Each watched worker's load asked now (`GetLoad`, for `tandem status`); unreachable ones are left out."""
        asked = {n: c for n in names if (c := self.view.channel(n)) is not None}
        ask = worker_pb2.GetLoadRequest()
        calls = [
            worker_pb2_grpc.WorkerStub(channel).GetLoad(ask, timeout=2.0, metadata=self.pool.metadata)
            for _, channel in asked.values()
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        return {n: a for n, a in zip(asked, answers, strict=True) if isinstance(a, worker_pb2.WorkerLoad)}

    def _targets(self, request: api_pb2.GenerateRequest) -> Targets:
        budget = request.budget
        ttft = budget.ttft_seconds if budget.HasField("ttft_seconds") else self.settings.slo.ttft_s
        tpot = budget.tpot_seconds if budget.HasField("tpot_seconds") else self.settings.slo.tpot_s
        return Targets(ttft, tpot)

    @staticmethod
    def _mode(root: trace.Span) -> str:
        attributes = getattr(root, "attributes", None) or {}
        return str(attributes.get("tandem.prefill_mode", "none"))


def with_model_defaults(sampling: api_pb2.SamplingParams, defaults: dict[str, float | int]) -> None:
    """Fills each sampling field the request left unset with the model's default for it (its
    generation_config.json); beam search, which samples nothing, takes none."""
    if sampling.num_beams > 1:
        return
    for key, value in defaults.items():
        if not sampling.HasField(key):
            setattr(sampling, key, value)


def from_config(
    config: ClusterConfig, discover: Callable[[], dict[str, str]], pools: PoolAdmin | None = None
) -> Router:
    """A router for the config's model (its tokenizer and config.json; no weights), not started."""
    tokenizer = Tokenizer(config.model.path)
    settings = settings_from_config(config, ModelArch.from_folder(model_folder(config.model.path)), tokenizer)
    auth = config.auth
    pool = WorkerDiscovery(discover, metadata=secret_metadata(auth), credentials=channel_credentials(auth))
    telemetry = Telemetry(config.telemetry, "tandem-router")
    credentials = server_credentials(auth, internal=False)
    return Router(settings, tokenizer, pool, telemetry, pools, client_keys(auth), credentials)
