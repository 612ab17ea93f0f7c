"""The errors an SDK call raises: a `TandemError` subclass named for the gRPC status code."""

from __future__ import annotations

import grpc


class TandemError(Exception):
    """A failed call; `code` is the gRPC status code and `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(TandemError):
    """The request was refused as invalid; the message names the field."""


class NotFound(TandemError):
    """The request named something the cluster does not serve (a LoRA adapter); the message names it."""


class ResourceExhausted(TandemError):
    """The cluster is full right now; retry later."""


class Unavailable(TandemError):
    """The router could not be reached (after the retries)."""


class DeadlineExceeded(TandemError):
    """The call's timeout passed."""


class Unauthenticated(TandemError):
    """A missing or wrong API key."""


_ERRORS: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def from_rpc_error(e: grpc.RpcError) -> TandemError:
    """The `TandemError` subclass named for the call's status code (`TandemError` itself for others)."""
    code = e.code()
    return _ERRORS.get(code, TandemError)(code, e.details() or "")
