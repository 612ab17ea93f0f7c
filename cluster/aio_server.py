"""Tandem's gRPC servers on `grpc.aio` (the router's and both workers'): one event loop serves every
stream (no thread each), with the same message limits, `grpc.health.v1` health, reflection, key
check and TLS as the threaded servers of `cluster.grpc_server`; and `LoopThread`, the event loop a
caller that is not async runs them on.

A handler that is a coroutine or an async generator runs on the loop; a plain function runs on the
server's `executor` (a worker's calls that wait on its engine: Abort, Drain, a KV push). A plain
*streaming* handler would never hear that its call was cancelled, so every long stream is async.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.auth import OPEN_PREFIXES, RequireKey, refusing
from cluster.grpc_server import message_options


@dataclass
class AioServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool, service: str = "") -> None:
        """The health of the server (`service` ""), or of one named part of it."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(service, status)

    async def stop(self, grace: float | None = None) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_aio_server(
    add_services: Callable[[grpc.aio.Server], Sequence[str]],
    address: str,
    key_check: RequireKey | None = None,
    credentials: grpc.ServerCredentials | None = None,
    options: Sequence[tuple[str, int]] = (),
    executor: Executor | None = None,
) -> AioServer:
    """Starts a server on the running loop; `add_services(server)` registers the services and
    returns their full names. `key_check` refuses calls without a valid key (health stays open);
    `executor` runs the handlers that are plain functions."""
    interceptors = [] if key_check is None else [RequireKeyAio(key_check)]
    server = grpc.aio.server(executor, options=[*message_options(), *options], interceptors=interceptors)
    names = list(add_services(server))
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind a gRPC server to {address}")
    await server.start()
    result = AioServer(server, port, checker)
    await result.set_serving(True)
    return result


class RequireKeyAio(grpc.aio.ServerInterceptor):
    """`cluster.auth.RequireKey` on an aio server: the same check, the same refusal."""

    def __init__(self, key: RequireKey) -> None:
        self.key = key

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if self.key.check(handler_call_details.invocation_metadata or ()):
            return handler
        return refusing(handler, self.key.message, aio=True)


class LoopThread:
    """An asyncio event loop running on a thread of its own, for callers that are not async."""

    def __init__(self, name: str = "router-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def run(self, coroutine: Coroutine, timeout_s: float | None = 30.0):  # type: ignore[no-untyped-def,type-arg]
        """Runs `coroutine` on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def soon(self, coroutine: Coroutine) -> None:  # type: ignore[type-arg]
        """Starts `coroutine` on the loop without waiting for it (callable from the loop itself)."""
        asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
