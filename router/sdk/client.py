"""Tandem's client SDK: talk to a Tandem router over gRPC (`tandem.v1`).

Imports grpcio, protobuf and the generated `tandem.v1` stubs only (no torch, no Ray), so any
Python program can use it:

    from router.sdk.client import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("def fibonacci(n):", max_tokens=32, temperature=0).text)
        for delta in client.stream("import os", max_tokens=16):
            print(delta.text, end="", flush=True)

`AsyncClient` has the same methods as coroutines and async iterators. Every call takes a
`timeout` (seconds, the call's deadline). Calls that fail with UNAVAILABLE are retried with
exponential backoff: before the first token from the start, after it as a resumption (the request
again, with `resume`: its id and the tokens and text received), which any router continues from
where the stream broke, nothing lost or repeated. Other failures raise a `TandemError` subclass
named for the gRPC status code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from tandem.v1 import api_pb2, api_pb2_grpc

from router.sdk import constraints
from router.sdk.constraints import Choice, Grammar, JsonObject, JsonSchema, Regex
from router.sdk.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TandemError,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from router.sdk.resume import Received, retryable

__all__ = [
    "AsyncClient",
    "Choice",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "Delta",
    "Grammar",
    "InvalidArgument",
    "JsonObject",
    "JsonSchema",
    "Logprob",
    "NotFound",
    "Regex",
    "ResourceExhausted",
    "TandemError",
    "Unauthenticated",
    "Unavailable",
]


_FINISH = {
    api_pb2.FINISH_REASON_STOP: "stop",
    api_pb2.FINISH_REASON_LENGTH: "length",
    api_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class Delta:
    """One streamed piece of a completion."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last delta
    logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability where it stands, and the top alternatives there (id, logprob)."""

    token_id: int
    token: str  # the text it completes
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Beam:
    """One beam of a beam search (`num_beams` > 1)."""

    text: str
    token_ids: list[int]
    score: float  # sum of log-probs / length ** length_penalty
    finish_reason: str | None


@dataclass(frozen=True)
class Speculation:
    """How speculative decoding went for a request."""

    draft_tokens: int
    accepted_tokens: int
    target_passes: int
    acceptance_rate: float
    tokens_per_pass: float


@dataclass(frozen=True)
class Completion:
    """A whole completion."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    metadata: dict[str, str]  # the router's placement: "tandem-prefill", "tandem-decode", ...
    beams: list[Beam] = field(default_factory=list)  # beam search: every beam, best first
    speculation: Speculation | None = None  # when the request used speculative decoding
    # With prompt_logprobs=n: each prompt token's after the first, with the top n at its position.
    prompt_logprobs: list[Logprob] = field(default_factory=list)


def _settings(client, target, api_key, timeout, retries, backoff_s) -> None:  # type: ignore[no-untyped-def]
    """What `Client` and `AsyncClient` keep alike."""
    client.target, client.timeout, client.retries, client.backoff_s = target, timeout, retries, backoff_s
    client.resumed = 0  # streams this client resumed after they broke mid-way
    client._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _credentials(tls_ca: str) -> grpc.ChannelCredentials:
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def _request(
    prompt: str | Sequence[dict[str, str]] | Sequence[int], request_id: str, sampling: dict[str, Any]
) -> api_pb2.GenerateRequest:
    structured = sampling.pop("structured", None)
    request = api_pb2.GenerateRequest(request_id=request_id, sampling=api_pb2.SamplingParams(**sampling))
    if structured is not None:
        request.sampling.structured.CopyFrom(constraints.to_proto(structured))
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.chat.messages.extend(api_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)  # type: ignore[index]
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return request


def _delta(m: api_pb2.GenerateResponse) -> Delta:
    return Delta(m.text, list(m.token_ids), _FINISH.get(m.finish_reason), [lp.logprob for lp in m.logprobs])


class _Assembler:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.last: api_pb2.GenerateResponse | None = None
        self.prompt_logprobs: list[Logprob] = []

    def add(self, m: api_pb2.GenerateResponse) -> None:
        self.prompt_logprobs += [
            Logprob(lp.token_id, lp.token, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
            for lp in m.prompt_logprobs
        ]
        self.text.append(m.text)
        self.tokens += m.token_ids
        self.last = m

    def completion(self, metadata: dict[str, str]) -> Completion:
        last = self.last or api_pb2.GenerateResponse()
        return Completion(
            request_id=last.request_id,
            text="".join(self.text),
            token_ids=self.tokens,
            finish_reason=_FINISH.get(last.finish_reason),
            prompt_tokens=last.usage.prompt_tokens,
            completion_tokens=last.usage.completion_tokens,
            cached_prompt_tokens=last.usage.cached_prompt_tokens,
            metadata=metadata,
            beams=[Beam(b.text, list(b.token_ids), b.score, _FINISH.get(b.finish_reason)) for b in last.beams],
            speculation=_speculation(last),
            prompt_logprobs=self.prompt_logprobs,
        )


def _speculation(m: api_pb2.GenerateResponse) -> Speculation | None:
    if not m.HasField("speculation"):
        return None
    s = m.speculation
    return Speculation(s.draft_tokens, s.accepted_tokens, s.target_passes, s.acceptance_rate, s.tokens_per_pass)


class Client:
    """A blocking client for a Tandem router at `target` ("host:port").

    `api_key` is sent as `authorization: Bearer <key>` metadata. `timeout` is the default
    deadline of each call in seconds; `retries` how many times a call that fails with
    UNAVAILABLE is tried again (resumed, once tokens have arrived), waiting `backoff_s`, then
    twice that, ...
    `tls_ca` (a PEM file) makes the connection TLS, trusting that CA.
    """

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        tls_ca: str | None = None,
    ) -> None:
        _settings(self, target, api_key, timeout, retries, backoff_s)
        credentials = _credentials(tls_ca) if tls_ca else None
        self._channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        self._stub = api_pb2_grpc.TandemStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[dict[str, str]] | Sequence[int],
        *,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Completion:
        """Completes `prompt` (text, chat messages as {"role", "content"} dicts, or token ids).
        Keyword arguments are `tandem.v1.SamplingParams` fields: max_tokens, temperature, top_p, ...;
        `structured` takes a `JsonSchema`, `JsonObject`, `Regex`, `Grammar` or `Choice`."""
        parts = _Assembler()
        metadata: dict[str, str] = {}
        for m in self._responses(_request(prompt, request_id, sampling), timeout, metadata):
            parts.add(m)
        return parts.completion(metadata)

    def stream(
        self,
        prompt: str | Sequence[dict[str, str]] | Sequence[int],
        *,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[Delta]:
        """Streams the completion of `prompt` as `Delta`s; leaving the loop early cancels the request."""
        for m in self._responses(_request(prompt, request_id, sampling), timeout, {}):
            yield _delta(m)

    def model_info(self, timeout: float | None = None) -> api_pb2.ModelInfo:
        """The served model: name, context length, vocabulary size, dtype, EOS ids, chat template."""
        try:
            return self._stub.GetModelInfo(
                api_pb2.GetModelInfoRequest(), timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def close(self) -> None:
        """Closes the channel; calls in progress are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _responses(
        self, request: api_pb2.GenerateRequest, timeout: float | None, metadata: dict[str, str]
    ) -> Iterator[api_pb2.GenerateResponse]:
        deadline = None if (timeout or self.timeout) is None else time.monotonic() + (timeout or self.timeout)  # type: ignore[operator]
        received = Received(request)
        for attempt in range(self.retries + 1):
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            call = self._stub.Generate(received.request(), timeout=remaining, metadata=self._metadata)
            try:
                for m in call:
                    if not metadata:
                        metadata.update({k: str(v) for k, v in call.initial_metadata()})
                    received.add(m)
                    yield m
                return
            except grpc.RpcError as e:
                if not retryable(e, attempt, self.retries):
                    raise from_rpc_error(e) from None
                self.resumed += bool(received.tokens)
            finally:
                call.cancel()  # a no-op once the call is over; cancels it if the caller left early
            time.sleep(self.backoff_s * 2**attempt)


class AsyncClient:
    """The asyncio twin of `Client`: `await generate(...)`, `async for delta in stream(...)`."""

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        tls_ca: str | None = None,
    ) -> None:
        _settings(self, target, api_key, timeout, retries, backoff_s)
        credentials = _credentials(tls_ca) if tls_ca else None
        aio = grpc.aio
        self._channel = aio.secure_channel(target, credentials) if credentials else aio.insecure_channel(target)
        self._stub = api_pb2_grpc.TandemStub(self._channel)

    async def generate(
        self,
        prompt: str | Sequence[dict[str, str]] | Sequence[int],
        *,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Completion:
        """As `Client.generate`."""
        parts = _Assembler()
        metadata: dict[str, str] = {}
        async for m in self._responses(_request(prompt, request_id, sampling), timeout, metadata):
            parts.add(m)
        return parts.completion(metadata)

    async def stream(
        self,
        prompt: str | Sequence[dict[str, str]] | Sequence[int],
        *,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Delta]:
        """As `Client.stream`; leaving the loop early cancels the request."""
        async for m in self._responses(_request(prompt, request_id, sampling), timeout, {}):
            yield _delta(m)

    async def model_info(self, timeout: float | None = None) -> api_pb2.ModelInfo:
        """As `Client.model_info`."""
        try:
            return await self._stub.GetModelInfo(
                api_pb2.GetModelInfoRequest(), timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def close(self) -> None:
        """Closes the channel; calls in progress are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _responses(
        self, request: api_pb2.GenerateRequest, timeout: float | None, metadata: dict[str, str]
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        loop = asyncio.get_running_loop()
        limit = timeout or self.timeout
        deadline = None if limit is None else loop.time() + limit
        received = Received(request)
        for attempt in range(self.retries + 1):
            remaining = None if deadline is None else max(deadline - loop.time(), 0.001)
            call = self._stub.Generate(received.request(), timeout=remaining, metadata=self._metadata)
            try:
                async for m in call:
                    if not metadata:
                        metadata.update({k: str(v) for k, v in (await call.initial_metadata())})
                    received.add(m)
                    yield m
                return
            except grpc.RpcError as e:
                if not retryable(e, attempt, self.retries):
                    raise from_rpc_error(e) from None
                self.resumed += bool(received.tokens)
            finally:
                call.cancel()
            await asyncio.sleep(self.backoff_s * 2**attempt)
