"""The router's OpenAI-compatible HTTP face (FastAPI on uvicorn).

    POST /v1/completions         POST /v1/chat/completions      (both with "stream": true as SSE)
    GET  /v1/models              GET  /health                   GET /metrics

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
from collections.abc import AsyncIterator
from typing import Any

import grpc
import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import api_pb2, api_pb2_grpc

from cluster.request import EARLY_STOPPING

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
FINISH = {api_pb2.FINISH_REASON_STOP: "stop", api_pb2.FINISH_REASON_LENGTH: "length"}
SAMPLING = {  # OpenAI (or Tandem extra) body field -> tandem.v1.SamplingParams field
    "temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos", "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids", "speculative_tokens": "speculative_tokens", "num_beams": "num_beams",
    "length_penalty": "length_penalty",
}  # fmt: skip


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
    return HTTPError(status, kind, details, details.split(":")[0] if status == 400 else None)


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
        def check() -> int:
            with (
                grpc.insecure_channel(grpc_target)
                if channel_credentials is None
                else grpc.secure_channel(grpc_target, channel_credentials) as channel
            ):
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status

        try:
            serving = await asyncio.to_thread(check) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            serving = False
        return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if registry is None:
            return Response(status_code=404)
        return Response(prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "tandem"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json(request)
        base = _completion_prompt(body)
        return await _complete(stub(), request, body, base, model, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json(request)
        base = _chat_prompt(body)
        return await _complete(stub(), request, body, base, model, chat=True)

    return app


def _completion_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """The GenerateRequest prompt field of a completions body."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"token_ids": api_pb2.TokenIds(ids=prompt)}
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"text": prompt}
    raise HTTPError(400, "invalid_request_error", "prompt must be a string or a list of token ids", "prompt")


def _chat_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """The GenerateRequest prompt field of a chat body (text parts of list contents joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "invalid_request_error", "messages must be a non-empty list", "messages")
    chat = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str) or not isinstance(m.get("role"), str):
            raise HTTPError(400, "invalid_request_error", f"messages[{i}] needs a role and text content", "messages")
        chat.append(api_pb2.ChatMessage(role=m["role"], content=content))
    return {"chat": api_pb2.ChatPrompt(messages=chat)}


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPError(400, "invalid_request_error", "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "invalid_request_error", "the body must be a JSON object")
    return body


def _generate_request(body: dict[str, Any], base: dict[str, Any], chat: bool) -> api_pb2.GenerateRequest:
    sampling = api_pb2.SamplingParams()
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        if max_tokens is not None:
            sampling.max_tokens = int(max_tokens)
        elif not chat:
            sampling.max_tokens = 16  # OpenAI's default for completions
        for key, field in SAMPLING.items():
            if body.get(key) is not None:
                setattr(sampling, field, body[key]) if field != "stop_token_ids" else sampling.stop_token_ids.extend(
                    body[key]
                )
        early = body.get("early_stopping")
        if early is not None:
            early = {True: "true", False: "false"}.get(early, early)
            if early not in EARLY_STOPPING:
                raise HTTPError(
                    400, "invalid_request_error", 'early_stopping must be true, false or "never"', "early_stopping"
                )
            sampling.early_stopping = EARLY_STOPPING[early]
        stop = body.get("stop")
        if stop is not None:
            sampling.stop.extend([stop] if isinstance(stop, str) else stop)
        logprobs = body.get("top_logprobs") if chat else body.get("logprobs")
        if chat and body.get("logprobs"):
            sampling.logprobs = int(logprobs or 0)
        elif not chat and logprobs is not None:
            sampling.logprobs = int(logprobs)
    except (TypeError, ValueError) as e:
        raise HTTPError(400, "invalid_request_error", f"bad sampling parameter: {e}") from None
    request = api_pb2.GenerateRequest(sampling=sampling, **base)
    for key, field in (("ttft_seconds", "ttft_seconds"), ("tpot_seconds", "tpot_seconds")):
        if body.get(key) is not None:
            setattr(request.budget, field, float(body[key]))
    return request


async def _complete(
    stub: api_pb2_grpc.TandemStub, http: Request, body: dict[str, Any], base: dict[str, Any], model: str, chat: bool
) -> Response:
    if body.get("model") not in (None, model):
        raise HTTPError(
            404, "not_found_error", f"model {body.get('model')!r} is not served here (try {model!r})", "model"
        )
    n = body.get("n", 1)
    if not isinstance(n, int) or not 1 <= n <= 16:
        raise HTTPError(400, "invalid_request_error", "n must be an integer in [1, 16]", "n")
    request = _generate_request(body, base, chat)
    metadata = [("authorization", http.headers["authorization"])] if "authorization" in http.headers else []
    calls = [stub.Generate(request, metadata=metadata) for _ in range(n)]
    firsts = []
    try:
        for call in calls:  # nothing is sent to the client until every choice has its first tokens
            firsts.append(await call.read())
    except grpc.RpcError as e:
        for call in calls:
            call.cancel()
        raise _from_rpc(e) from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = _stream(calls, firsts, rid, created, model, chat, include_usage, http)
        return StreamingResponse(stream, media_type="text/event-stream")
    return JSONResponse(await _collect(calls, firsts, rid, created, model, chat))


async def _rest(call, first) -> AsyncIterator[api_pb2.GenerateResponse]:  # type: ignore[no-untyped-def]
    """The call's messages from `first` on (read with `read()`: gRPC forbids mixing it with iteration)."""
    m = first
    while m is not grpc.aio.EOF:
        yield m
        m = await call.read()


def _logprobs(messages: list[api_pb2.GenerateResponse], chat: bool) -> dict[str, Any] | None:
    entries = [lp for m in messages for lp in m.logprobs]
    if not entries:
        return None
    if chat:
        return {
            "content": [
                {"token": str(lp.token_id), "logprob": lp.logprob,
                 "top_logprobs": [{"token": str(t.token_id), "logprob": t.logprob} for t in lp.top]}
                for lp in entries
            ]
        }  # fmt: skip
    return {
        "tokens": [str(lp.token_id) for lp in entries],
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [{str(t.token_id): t.logprob for t in lp.top} for lp in entries],
        "text_offset": [],
    }


async def _collect(calls, firsts, rid: str, created: int, model: str, chat: bool) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, (call, first) in enumerate(zip(calls, firsts, strict=True)):
        try:
            messages = [m async for m in _rest(call, first)]
        except grpc.RpcError as e:
            raise _from_rpc(e) from None
        text = "".join(m.text for m in messages)
        last = messages[-1] if messages else api_pb2.GenerateResponse()
        finish = FINISH.get(last.finish_reason, "stop")
        prompt_tokens = last.usage.prompt_tokens
        completion_tokens += last.usage.completion_tokens
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": _logprobs(messages, chat)}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        choices.append(choice)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
    kind = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, "usage": usage}


async def _stream(calls, firsts, rid, created, model, chat, include_usage, http) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
    kind = "chat.completion.chunk" if chat else "text_completion"
    queue: asyncio.Queue[tuple[int, api_pb2.GenerateResponse | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for m in _rest(calls[index], firsts[index]):
                await queue.put((index, m))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(calls))]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    started: set[int] = set()
    try:
        open_choices = len(calls)
        while open_choices:
            index, m = await queue.get()
            if m is None:
                open_choices -= 1
                continue
            finish = FINISH.get(m.finish_reason) if m.finish_reason else None
            if chat:
                delta: dict[str, Any] = {"content": m.text}
                if index not in started:
                    delta["role"] = "assistant"
                    started.add(index)
                choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": index, "text": m.text, "finish_reason": finish}
            choice["logprobs"] = _logprobs([m], chat)
            if m.finish_reason:
                usage["prompt_tokens"] = m.usage.prompt_tokens
                usage["completion_tokens"] += m.usage.completion_tokens
            chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        if include_usage:
            total = usage["prompt_tokens"] + usage["completion_tokens"]
            chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                     "usage": {**usage, "total_tokens": total}}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:  # a client that disconnects cancels every choice: the cluster frees their KV
        for call in calls:
            call.cancel()
        for task in tasks:
            task.cancel()


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
