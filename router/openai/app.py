"""The router's OpenAI-compatible HTTP face (FastAPI on uvicorn).

    POST /v1/completions   POST /v1/chat/completions   POST /v1/responses   (all with "stream": true as SSE)
    GET  /v1/models              GET  /health                   GET /metrics
    POST /v1/load_lora_adapter   POST /v1/unload_lora_adapter  (vLLM's; with lora.runtime_loading)

Every completion becomes `tandem.v1.Generate` calls on the router's own gRPC port (one per choice,
`n` of them), with the client's `Authorization` header passed along: validation, authentication,
placement, SLO accounting, tracing and cancellation are the gRPC path's, not a copy. A streamed
response starts only once its first tokens have arrived, so a refusal (bad input, overload) is an
HTTP error with OpenAI's JSON shape, never a 200 whose stream then fails.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

from cluster.lifeline import RAY_HEALTH
from router.openai.fields import FieldError
from router.openai.request import Plan, chat_plan, completion_plan
from router.openai.response import Reply, collect, stream
from router.openai.responses import chat_body, events, response

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

SERVING = health_pb2.HealthCheckResponse.SERVING


def _router_health(grpc_target: str, channel_credentials: Any) -> tuple[bool, bool]:
    """(the router serves, Ray's GCS answers) from the router's gRPC health."""
    with (
        grpc.insecure_channel(grpc_target)
        if channel_credentials is None
        else grpc.secure_channel(grpc_target, channel_credentials) as channel
    ):
        stub = health_pb2_grpc.HealthStub(channel)
        serving = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING
        try:  # a router without Ray (no lifeline) does not know the service: Ray is not its concern
            ray = stub.Check(health_pb2.HealthCheckRequest(service=RAY_HEALTH), timeout=2).status == SERVING
        except grpc.RpcError as e:
            ray = e.code() == grpc.StatusCode.NOT_FOUND
        return serving, ray


class HTTPError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def _from_rpc(e: grpc.RpcError) -> HTTPError:
    status, kind = STATUS.get(e.code(), (500, "server_error"))
    details = e.details() or e.code().name
    return HTTPError(status, kind, details, _param(details) if status == 400 else None)


def _param(details: str) -> str:
    """The body field a gRPC validation error names ("sampling.top_p: ..." is top_p)."""
    field = details.split(":")[0].removeprefix("sampling.").removeprefix("budget.").split(".")[0]
    return {"text": "prompt", "token_ids": "prompt", "chat": "messages"}.get(field, field)


def create_app(grpc_target: str, model: str, registry: Any = None, channel_credentials: Any = None) -> FastAPI:
    app = FastAPI(title="Tandem (OpenAI-compatible)", docs_url=None, redoc_url=None)
    state: dict[str, Any] = {}

    def stub() -> api_pb2_grpc.TandemStub:
        if "stub" not in state:
            channel = (
                grpc.aio.secure_channel(grpc_target, channel_credentials)
                if channel_credentials
                else grpc.aio.insecure_channel(grpc_target)
            )
            state["channel"], state["stub"] = channel, api_pb2_grpc.TandemStub(channel)
        return state["stub"]

    @app.exception_handler(HTTPError)
    async def _error(request: Request, e: HTTPError) -> JSONResponse:
        return e.response()

    @app.get("/health")
    async def health() -> Response:
        """ok; degraded (serving, but Ray's GCS is silent: scaling waits for it); unavailable (503)."""
        try:
            serving, ray = await asyncio.to_thread(_router_health, grpc_target, channel_credentials)
        except grpc.RpcError:
            serving, ray = False, False
        status = ("ok" if ray else "degraded") if serving else "unavailable"
        return JSONResponse({"status": status}, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if registry is None:
            return Response(status_code=404)
        return Response(prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    _model_routes(app, state, stub, model)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(stub(), request, await _json(request), model, completion_plan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(stub(), request, await _json(request), model, chat_plan)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _respond(stub(), request, await _json(request), model)

    return app


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPError(400, "invalid_request_error", "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "invalid_request_error", "the body must be a JSON object")
    return body


async def _complete(
    stub: api_pb2_grpc.TandemStub,
    http: Request,
    body: dict[str, Any],
    model: str,
    read: Callable[[dict[str, Any]], Plan],
) -> Response:
    plan, calls, firsts = await _start(stub, http, body, model, read)
    echoes = [_echo(plan, index // plan.n, first) for index, first in enumerate(firsts)]
    served = body.get("model") or model  # the adapter's name, when the body named one
    reply = Reply(("chatcmpl-" if plan.chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), served, plan, echoes)
    if plan.stream:
        return StreamingResponse(stream(calls, firsts, reply), media_type="text/event-stream")
    return JSONResponse(await _collected(calls, firsts, reply))


async def _respond(stub: api_pb2_grpc.TandemStub, http: Request, body: dict[str, Any], model: str) -> Response:
    """A Responses API body, run as the chat completion it stands for."""
    plan, calls, firsts = await _start(stub, http, body, model, lambda body: chat_plan(chat_body(body)))
    model = body.get("model") or model  # the adapter's name, when the body named one
    rid = "resp_" + uuid.uuid4().hex
    if plan.stream:
        return StreamingResponse(events(rid, body, model, plan, calls[0], firsts[0]), media_type="text/event-stream")
    chat = await _collected(calls, firsts, Reply(rid, int(time.time()), model, plan, [""]))
    return JSONResponse(response(rid, body, model, chat))


async def _collected(calls: list[Any], firsts: list[Any], reply: Reply) -> dict[str, Any]:
    """The whole chat or completion reply; a call that fails midway is an HTTP error."""
    try:
        return await collect(calls, firsts, reply)
    except grpc.RpcError as e:
        raise _from_rpc(e) from None


async def _start(
    stub: api_pb2_grpc.TandemStub,
    http: Request,
    body: dict[str, Any],
    model: str,
    read: Callable[[dict[str, Any]], Plan],
) -> tuple[Plan, list[Any], list[Any]]:
    """The body's plan, its calls started, and each call's first message: a refusal (a bad field,
    a gRPC error before any token) is an HTTP error, every call cancelled. A `model` other than the
    served model's name names a LoRA adapter (the router answers NOT_FOUND, a 404, if none serves it)."""
    named = body.get("model")
    if named is not None and (not isinstance(named, str) or not named):
        raise HTTPError(400, "invalid_request_error", "model must be a non-empty string", "model")
    try:
        plan = read(body)
    except FieldError as e:
        raise HTTPError(400, "invalid_request_error", e.message, e.param) from None
    for request in plan.requests:
        request.sampling.adapter = "" if named in (None, model) else named
    metadata = _credentials(http)
    calls = [stub.Generate(request, metadata=metadata) for request in plan.requests for _ in range(plan.n)]
    firsts = []
    try:
        for call in calls:  # nothing is sent to the client until every choice has its first tokens
            firsts.append(await call.read())
    except grpc.RpcError as e:
        for call in calls:
            call.cancel()
        raise _from_rpc(e) from None
    return plan, calls, firsts


def _model_routes(app: FastAPI, state: dict[str, Any], stub: Callable[[], Any], model: str) -> None:
    """`/v1/models`, and vLLM's endpoints for LoRA adapters while serving (the router's Admin service)."""

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """The served model, and each LoRA adapter the workers serve with the model as its parent."""
        try:
            info = await stub().GetModelInfo(api_pb2.GetModelInfoRequest(), metadata=_credentials(request))
        except grpc.RpcError as e:
            raise _from_rpc(e) from None
        base = {"id": model, "object": "model", "created": 0, "owned_by": "tandem", "root": model, "parent": None}
        return {"object": "list", "data": [base, *({**base, "id": a, "parent": model} for a in info.adapters)]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: every worker reads `lora_path` and serves `lora_name` (needs lora.runtime_loading)."""
        body = await _json(request)
        name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
        await _admin(state, stub, "LoadAdapter", worker_pb2.LoadAdapterRequest(name=name, path=path), request)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: new requests through `lora_name` are refused; running ones finish."""
        name = _text_field(await _json(request), "lora_name")
        await _admin(state, stub, "UnloadAdapter", worker_pb2.UnloadAdapterRequest(name=name), request)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _text_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise HTTPError(400, "invalid_request_error", f"{name} must be a non-empty string", name)
    return value


async def _admin(state: dict[str, Any], stub: Callable[[], Any], method: str, message: Any, http: Request) -> Any:
    """A call to the router's Admin service on the channel the app's Tandem stub uses."""
    stub()  # the channel, made once
    try:
        return await getattr(worker_pb2_grpc.AdminStub(state["channel"]), method)(message, metadata=_credentials(http))
    except grpc.RpcError as e:
        raise _from_rpc(e) from None


def _credentials(http: Request) -> list[tuple[str, str]]:
    """The caller's API key, passed on to the router."""
    return [("authorization", http.headers["authorization"])] if "authorization" in http.headers else []


def _echo(plan: Plan, prompt: int, first: Any) -> str:
    """The text that leads a choice of prompt `prompt`: the prompt as sent, or as the router decoded its token ids."""
    if not plan.echo:
        return ""
    text = plan.prompt_texts[prompt]
    return text if text is not None else getattr(first, "prompt_text", "")


class HTTPServer:
    """uvicorn on its own thread, stoppable."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="tandem-http")

    def start(self, timeout_s: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise OSError("the HTTP server did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
