"""The router: the public `tandem.v1.Tandem` service, and `tandem.v1.Admin` for `tandem status`.

Lifecycle of a request:

    Generate      validate and tokenise (INVALID_ARGUMENT naming the field); take an admission
                  slot (RESOURCE_EXHAUSTED when `max_queued_requests` are in flight)
    place         from the loads the workers push (`router.view`; no RPC per request), choose a
                  decode worker and a prefill worker or local prefill (`router.index`); the
                  choice goes out as response metadata (`tandem-prefill`, `tandem-decode`) and
                  is counted in `Admin.GetStatus`
    relay         the decode worker's stream (tokens, text, finish) is the response stream; the
                  prefill call runs beside it and its failure fails the request with its code
    end           client cancellation or deadline cancels both worker calls, which abort the
                  request and free its KV on each worker
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

from cluster.auth import client_keys, mint_capability, secret_metadata
from cluster.config import ClusterConfig
from cluster.engine.request import SamplingParams, params_to_proto
from cluster.grpc_server import Server, start_server
from cluster.model.arch import ModelArch
from cluster.model.tokenizer import Tokenizer
from cluster.slo import SLOWindow, Targets
from cluster.telemetry import Telemetry, extract
from cluster.tls import channel_credentials, server_credentials
from router.placement import Choice, NoCapacity
from router.pool import WorkerPool
from router.relay import (
    Broken,
    Malformed,
    Stream,
    account,
    describe,
    parse,
    rest_of,
    trace_metadata,
    watch_prefill,
)
from router.settings import PoolAdmin, RouterSettings, settings_from_config
from router.validate import InvalidRequest, PromptTokenizer, validate
from router.view import WorkerView


class Router(api_pb2_grpc.TandemServicer, worker_pb2_grpc.AdminServicer):
    def __init__(
        self,
        settings: RouterSettings,
        tokenizer: PromptTokenizer,
        pool: WorkerPool,
        telemetry: Telemetry,
        pools: PoolAdmin | None = None,
        interceptor: grpc.ServerInterceptor | None = None,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.settings = settings
        self.credentials = credentials  # TLS on the public port, when configured
        self.interceptor = interceptor  # client API keys, when configured
        self.pools = pools
        self.telemetry = telemetry
        self.slo = SLOWindow(settings.slo.window_s)
        self.tokenizer = tokenizer
        self.pool = pool
        self.view = WorkerView(pool, settings.watch_heartbeat_s, settings.watch_stale_after_s)
        self.decisions: collections.Counter[str] = collections.Counter()
        self._slots = threading.BoundedSemaphore(settings.max_queued_requests)
        self._in_flight = 0
        self._draining = False
        self._lock = threading.Lock()
        self.server: Server | None = None

    def start(self, address: str = "127.0.0.1:0") -> str:
        self.view.start()

        def add(server: grpc.Server) -> list[str]:
            server.add_generic_rpc_handlers((self._public_handlers(),))
            worker_pb2_grpc.add_AdminServicer_to_server(self, server)
            return ["tandem.v1.Tandem", "tandem.v1.Admin"]

        self.server = start_server(
            add, address, interceptors=[self.interceptor], credentials=self.credentials,
            max_workers=self.settings.max_queued_requests + 64,  # a Generate holds a thread; room for admin
        )  # fmt: skip
        self.telemetry.metrics.serve(self.settings.metrics_port)
        return self.server.address

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished."""
        return self._in_flight

    def drain(self, timeout_s: float) -> bool:
        """Graceful shutdown's first half: health turns NOT_SERVING at once, new requests get
        UNAVAILABLE, and requests in flight run to their end. True if they all ended in time."""
        self._draining = True
        if self.server is not None:
            self.server.set_serving(False)
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._in_flight == 0

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(None)
        self.view.stop()
        self.pool.close()
        self.telemetry.shutdown()

    # -- tandem.v1.Tandem --------------------------------------------------------------------------

    def GetModelInfo(self, request: api_pb2.GetModelInfoRequest, context: grpc.ServicerContext) -> api_pb2.ModelInfo:
        s = self.settings
        return api_pb2.ModelInfo(
            name=s.model_name,
            architecture=s.architecture,
            context_length=s.limits.context_length,
            vocab_size=s.limits.vocab_size,
            dtype=s.dtype,
            eos_token_ids=s.eos_token_ids,
            has_chat_template=s.has_chat_template,
        )

    def _public_handlers(self) -> grpc.GenericRpcHandler:
        """`tandem.v1.Tandem` with requests parsed so that malformed bytes are INVALID_ARGUMENT
        (gRPC's own parsing failure would be INTERNAL)."""
        return grpc.method_handlers_generic_handler(
            "tandem.v1.Tandem",
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.Generate, request_deserializer=parse(api_pb2.GenerateRequest),
                    response_serializer=api_pb2.GenerateResponse.SerializeToString,
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self.GetModelInfo, request_deserializer=parse(api_pb2.GetModelInfoRequest),
                    response_serializer=api_pb2.ModelInfo.SerializeToString,
                ),
            },
        )  # fmt: skip

    def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.GenerateResponse]:
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
        received = time.time()
        rid = request.request_id or uuid.uuid4().hex
        parent = extract(context.invocation_metadata())  # continues a client's traceparent
        root = self.telemetry.tracer.start_span(
            "router.generate", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"gen_ai.request.model": self.settings.model_name, "tandem.request_id": rid},
        )  # fmt: skip
        status = "error"
        try:
            try:
                prompt, params = validate(request, self.settings.limits, self.tokenizer)
            except InvalidRequest as e:
                status = "invalid"
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if self._draining:
                status = "rejected"
                context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down; retry elsewhere")
            if not self._slots.acquire(blocking=False):
                status = "rejected"
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the router's admission queue is full; retry later")
            try:
                with self._lock:
                    self._in_flight += 1
                stream = Stream(rid, prompt, received, self._targets(request))
                if request.return_prompt_text:
                    stream.prompt_text = self.tokenizer.decode(prompt)
                yield from self._generate(stream, params, context, trace.set_span_in_context(root))
                status = stream.status
                account(self.telemetry, self.slo, root, stream)
            finally:
                with self._lock:
                    self._in_flight -= 1
                self._slots.release()
        finally:
            if status == "error" and not context.is_active():
                status = "cancelled"
            self.telemetry.metrics.requests.labels(status, self._mode(root)).inc()
            root.set_attribute("tandem.status", status)
            root.end()

    # -- tandem.v1.Admin ---------------------------------------------------------------------------

    def Scale(self, request: worker_pb2.ScaleRequest, context: grpc.ServicerContext) -> worker_pb2.ScaleResult:
        if self.pools is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router has no pool controllers to scale")
        replicas = request.replicas if request.HasField("replicas") else None
        try:
            return worker_pb2.ScaleResult(pool=self.pools.scale(request.pool, replicas))  # type: ignore[union-attr]
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def GetStatus(
        self, request: worker_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> worker_pb2.ClusterStatus:
        workers, loads = self.pool.workers(), self.pool.loads()
        ttft, tpot = self.slo.latency()
        status = worker_pb2.ClusterStatus(
            pools=self.pools.pool_status() if self.pools is not None else [],
            model=self.settings.model_name,
            workers=[
                worker_pb2.WorkerStatus(name=n, address=w.address, healthy=n in loads, load=loads.get(n))
                for n, w in sorted(workers.items())
            ],
            decisions=dict(self.decisions),
            requests_in_flight=self._in_flight,
            slo_attainment=self.slo.attainment(),
            metrics_address=self.telemetry.metrics.address or "",
        )
        if ttft is not None:
            status.ttft_p90_seconds = ttft
        if tpot is not None:
            status.tpot_p90_seconds = tpot
        return status

    # -- internals ---------------------------------------------------------------------------------

    def _generate(
        self,
        stream: Stream,
        params: SamplingParams,
        context: grpc.ServicerContext,
        trace_context: otel_context.Context,
    ) -> Iterator[api_pb2.GenerateResponse]:
        """Places the request and relays its stream. When a worker dies mid-request, the request
        migrates: a live worker gets the prompt and, as output already generated, the tokens
        already streamed; it prefills both again and the same client stream continues, no token
        lost or repeated (at most `migration_limit` times). The tokens keep their output indices,
        so a seeded request samples on as if it had never moved."""
        s = self.settings
        try:
            choice = self._place(stream.prompt, params, wait_s=0)
        except NoCapacity as e:
            stream.status = "rejected"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.decisions[f"prefill={choice.reason}"] += 1
        root = trace.get_current_span(trace_context)
        root.set_attribute("tandem.prefill_mode", choice.reason.split(":")[0])
        context.send_initial_metadata(
            (("tandem-request-id", stream.rid), ("tandem-prefill", describe(choice)), ("tandem-decode", choice.decode))
        )
        placed = time.time()
        self.telemetry.record("router.queue", trace_context, stream.received, placed, tandem__prefill=describe(choice))
        self.telemetry.metrics.queue.labels("router").observe(placed - stream.received)
        metadata = [*self.pool.metadata, *trace_metadata(trace_context)]
        worker_id = uuid.uuid4().hex[:16]  # never the client's id: two clients may send the same one
        for attempt in range(s.migration_limit + 1):
            generated = list(stream.generated)
            if attempt:
                if not context.is_active():
                    stream.status = "cancelled"
                    return
                try:
                    rest = rest_of(params, len(generated))
                    choice = self._place(stream.prompt + generated, rest, s.migration_wait_s)
                except NoCapacity as e:
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"no worker to continue the request on: {e}")
            tokens = (stream.prompt, generated)
            try:
                for msg in self._attempt(f"{worker_id}.{attempt}", tokens, params, choice, context, metadata, stream):
                    yield stream.response(msg)
                return
            except Broken as broken:
                if not context.is_active():
                    stream.status = "cancelled"
                    return
                if not broken.migratable or attempt == s.migration_limit:
                    context.abort(broken.code, broken.details)
                self.telemetry.metrics.migrations.labels(broken.where).inc()
                stream.migrated(self.tokenizer.decode)
                event = {"tandem.worker": broken.worker, "tandem.tokens_streamed": len(stream.generated)}
                root.add_event("migration", {**event, "tandem.error": broken.details})

    def _place(self, prompt: list[int], params: SamplingParams, wait_s: float) -> Choice:
        """Chooses workers from the view the workers push (no RPC here), waiting up to `wait_s` for
        one to come back (a restarting worker). Beam search needs the prompt's logits on the
        decode worker, so it is prefilled there."""
        s = self.settings
        deadline = time.monotonic() + wait_s
        local = s.local_prefill_max_tokens if params.num_beams == 1 else len(prompt)
        max_tokens = params.max_tokens * params.num_beams
        rediscovered = False
        while True:
            try:
                return self.view.index.choose(prompt, max_tokens, s.block_size, local)
            except NoCapacity:
                if not rediscovered:  # a worker added since the last discovery may fit
                    self.view.refresh()
                    rediscovered = True
                    continue
                if time.monotonic() >= deadline or not wait_s:
                    raise
                time.sleep(0.2)

    def _attempt(
        self,
        worker_rid: str,
        tokens: tuple[list[int], list[int]],
        params: SamplingParams,
        choice: Choice,
        context: grpc.ServicerContext,
        metadata: list[tuple[str, str]],
        stream: Stream,
    ) -> Iterator[worker_pb2.WorkerTokens]:
        """One try on one pair of workers for `tokens` (the prompt, and the output already
        generated): the decode worker's stream, with the prefill call beside it. Raises `Broken`
        when either fails; the caller decides whether to migrate."""
        remaining = context.time_remaining()  # the client's deadline, passed on to every worker call
        timeout = remaining if remaining is not None and remaining < 1e6 else None
        calls, prefill_result = self._submit(worker_rid, tokens, params, choice, timeout, metadata)
        decode_call = calls[0]

        def cancel_all() -> None:
            prefill_result["cancelled"] = True
            for call in calls:
                call.cancel()

        if not context.add_callback(cancel_all):  # the client is already gone
            cancel_all()
            return
        try:
            for msg in decode_call:
                if "cached" in prefill_result:
                    stream.cached_tokens = prefill_result["cached"]  # type: ignore[assignment]
                yield msg
        except grpc.RpcError as e:
            cancel_all()
            failed = prefill_result.get("error")
            if isinstance(failed, grpc.RpcError):
                raise Broken(failed.code(), failed.details() or "", "prefill", choice.prefill or "") from None
            raise Broken(e.code(), e.details() or "", "decode", choice.decode) from None

    def _submit(
        self,
        worker_rid: str,
        tokens: tuple[list[int], list[int]],
        params: SamplingParams,
        choice: Choice,
        timeout: float | None,
        metadata: list[tuple[str, str]],
    ) -> tuple[list[grpc.Future], dict[str, object]]:
        """Starts the decode worker's call (first in the list) and, for remote prefill, the prefill
        worker's beside it, watched on a thread that records its result."""
        s = self.settings
        workers = self.pool.workers()
        if choice.decode not in workers or (choice.prefill is not None and choice.prefill not in workers):
            raise Broken(grpc.StatusCode.UNAVAILABLE, "a chosen worker left", "decode", choice.decode)
        decode = workers[choice.decode]
        sampling = params_to_proto(params)
        prompt, output = tokens
        request = worker_pb2.WorkerRequest(
            request_id=worker_rid, prompt_token_ids=prompt, output_token_ids=output, sampling=sampling,
            remote_prefill=choice.prefill is not None,
        )  # fmt: skip
        decode_call = decode.stub.Submit(request, timeout=timeout, metadata=metadata)
        prefill_result: dict[str, object] = {}
        if choice.prefill is None:
            return [decode_call], prefill_result
        capability = b""
        if s.capability_secret is not None:
            num_tokens = len(prompt) + len(output)  # the KV that travels
            capability = mint_capability(s.capability_secret, worker_rid, num_tokens, s.block_size, s.capability_ttl_s)
        request = worker_pb2.WorkerRequest(
            request_id=worker_rid, prompt_token_ids=prompt, output_token_ids=output, sampling=sampling,
            decode_target=decode.address, capability=capability,
        )  # fmt: skip
        prefill_call = workers[choice.prefill].stub.Submit(request, timeout=timeout, metadata=metadata)
        watcher = threading.Thread(target=watch_prefill, args=(prefill_call, decode_call, prefill_result), daemon=True)
        watcher.start()
        return [decode_call, prefill_call], prefill_result

    def _targets(self, request: api_pb2.GenerateRequest) -> Targets:
        budget = request.budget
        ttft = budget.ttft_seconds if budget.HasField("ttft_seconds") else self.settings.slo.ttft_s
        tpot = budget.tpot_seconds if budget.HasField("tpot_seconds") else self.settings.slo.tpot_s
        return Targets(ttft, tpot)

    @staticmethod
    def _mode(root: trace.Span) -> str:
        attributes = getattr(root, "attributes", None) or {}
        return str(attributes.get("tandem.prefill_mode", "none"))


def from_config(
    config: ClusterConfig, discover: Callable[[], dict[str, str]], pools: PoolAdmin | None = None
) -> Router:
    """A router for the config's model (its tokenizer and config.json; no weights), not started."""
    tokenizer = Tokenizer(config.model.path)
    settings = settings_from_config(config, ModelArch.from_folder(config.model.path), tokenizer)
    auth = config.auth
    pool = WorkerPool(discover, metadata=secret_metadata(auth), credentials=channel_credentials(auth))
    telemetry = Telemetry(config.telemetry, "tandem-router")
    credentials = server_credentials(auth, internal=False)
    return Router(settings, tokenizer, pool, telemetry, pools, client_keys(auth), credentials)
