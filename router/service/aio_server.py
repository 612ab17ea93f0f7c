"""The router's gRPC server on `grpc.aio`: one event loop serves every stream (no thread each), with
the same message limits, `grpc.health.v1` health, reflection, API-key check and TLS as the
threaded servers of `cluster.grpc_server`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)

    async def stop(self, grace: float | None = None) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_aio_server(
    add_services: Callable[[grpc.aio.Server], Sequence[str]],
    address: str,
    key_check: RequireKey | None = None,
    credentials: grpc.ServerCredentials | None = None,
    options: Sequence[tuple[str, int]] = (),
) -> AioServer:
    """Starts a server on the running loop; `add_services(server)` registers the services and
    returns their full names. `key_check` refuses calls without a valid key (health stays open)."""
    interceptors = [] if key_check is None else [RequireKeyAio(key_check)]
    server = grpc.aio.server(options=[*message_options(), *options], interceptors=interceptors)
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
