"""Credentials on every channel: client API keys, the cluster secret, and KV-transfer capabilities.

- Clients present `authorization: Bearer <key>`; the router compares it, in constant time and
  case-exact, with every configured key. Health checks stay open; everything else needs a key.
- Internal calls (router -> workers, prefill -> decode KV pushes) carry the cluster secret in
  `x-tandem-cluster-secret`; workers refuse calls without it (health stays open).
- Each KV transfer carries a capability the router minted for that request: request id, the most
  blocks it may reserve, an expiry, and an HMAC-SHA256 over them under the cluster secret. The
  decode worker checks it before reserving anything (PERMISSION_DENIED otherwise).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc
from tandem.v1 import kv_transfer_pb2 as pb

from cluster.config import AuthConfig

SECRET_HEADER = "x-tandem-cluster-secret"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def api_keys(config: AuthConfig) -> list[bytes]:
    keys = [k.get_secret_value() for k in config.api_keys]
    if config.api_keys_file is not None:
        keys += [line.strip() for line in Path(config.api_keys_file).read_text().splitlines() if line.strip()]
    return [k.encode() for k in keys]


def _matches(candidate: bytes, keys: Iterable[bytes]) -> bool:
    # compare_digest on every key, without stopping at the first match: the time does not tell which.
    found = False
    for key in keys:
        found |= hmac.compare_digest(candidate, key)
    return found


class RequireKey(grpc.ServerInterceptor):
    """Refuses every call outside `open_prefixes` whose metadata lacks a valid credential."""

    def __init__(self, check: Callable[[Sequence[tuple[str, str]]], bool], message: str) -> None:
        self.check = check
        self.message = message

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES) or self.check(handler_call_details.invocation_metadata or ()):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return refusing(handler, self.message)


def client_keys(config: AuthConfig) -> RequireKey | None:
    """The router's interceptor for client API keys (None when no key is configured)."""
    keys = api_keys(config)
    if not keys:
        return None

    def check(metadata: Sequence[tuple[str, str]]) -> bool:
        for k, v in metadata:
            if k == "authorization" and v.startswith("Bearer "):
                return _matches(v[len("Bearer ") :].encode(), keys)
        return False

    return RequireKey(check, "a valid API key is required (authorization: Bearer <key>)")


def cluster_secret(config: AuthConfig) -> RequireKey | None:
    """A worker's interceptor for the cluster secret (None when none is configured)."""
    if config.cluster_secret is None:
        return None
    secret = config.cluster_secret.get_secret_value().encode()

    def check(metadata: Sequence[tuple[str, str]]) -> bool:
        return any(k == SECRET_HEADER and _matches(v.encode(), [secret]) for k, v in metadata)

    return RequireKey(check, "internal channel: the cluster secret is missing or wrong")


def secret_metadata(config: AuthConfig) -> list[tuple[str, str]]:
    """Metadata carrying the cluster secret on internal calls (empty without one)."""
    return [] if config.cluster_secret is None else [(SECRET_HEADER, config.cluster_secret.get_secret_value())]


# -- KV-transfer capabilities ------------------------------------------------------------------------


def _mac(secret: bytes, request_id: str, num_blocks: int, expires_at: float) -> bytes:
    message = request_id.encode() + b"\0" + struct.pack("<Id", num_blocks, expires_at)
    return hmac.new(secret, message, hashlib.sha256).digest()


def mint_capability(
    secret: bytes, request_id: str, num_tokens: int, block_size: int, ttl_s: float, now: float | None = None
) -> bytes:
    """The serialized capability for a transfer of `num_tokens` tokens' KV for `request_id`."""
    num_blocks = math.ceil(num_tokens / block_size)
    expires_at = (time.time() if now is None else now) + ttl_s
    return pb.Capability(
        request_id=request_id, num_blocks=num_blocks, expires_at=expires_at,
        mac=_mac(secret, request_id, num_blocks, expires_at),
    ).SerializeToString()  # fmt: skip


def verify_capability(
    secret: bytes, data: bytes, request_id: str, num_tokens: int, block_size: int, now: float | None = None
) -> None:
    """Raises PERMISSION_DENIED unless `data` is this request's capability, unexpired, genuine,
    and covers `num_tokens` tokens."""
    # Here, not above: `tandem serve`'s own process imports this module, and the wire format's
    # imports torch (2.5 s before Ray could start).
    from cluster.kv.wire import TransferError

    def deny(why: str) -> TransferError:
        return TransferError(grpc.StatusCode.PERMISSION_DENIED, f"KV transfer refused: {why}")

    if not data:
        raise deny("no capability")
    try:
        cap = pb.Capability.FromString(data)
    except Exception:
        raise deny("malformed capability") from None
    if not hmac.compare_digest(cap.mac, _mac(secret, cap.request_id, cap.num_blocks, cap.expires_at)):
        raise deny("the capability's signature does not check out")
    if cap.request_id != request_id:
        raise deny("the capability is for another request")
    if (time.time() if now is None else now) > cap.expires_at:
        raise deny("the capability has expired")
    if math.ceil(num_tokens / block_size) > cap.num_blocks:
        raise deny(f"the capability allows {cap.num_blocks} blocks, the transfer needs more")


def refusing(handler: grpc.RpcMethodHandler, message: str, aio: bool = False) -> grpc.RpcMethodHandler:
    """`handler`'s method answering UNAUTHENTICATED with `message`, for a threaded server or (`aio`)
    a `grpc.aio` one, whose aborts are awaited and whose streaming handlers are async generators."""
    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    behaviour = _aio_refusal(message, handler.response_streaming) if aio else _refusal(message)
    return make(
        behaviour,  # type: ignore[arg-type]
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _refusal(message: str) -> Callable[..., None]:
    def abort(request, context):  # type: ignore[no-untyped-def]
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return abort


def _aio_refusal(message: str, response_streaming: bool) -> Callable[..., object]:
    async def abort(request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a streaming handler must be

    return abort_stream if response_streaming else abort
