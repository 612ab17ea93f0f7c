"""A KV sender of each transport to a decode engine's intake, for the tests that ship KV between
engines in one process: `local` calls the intake directly; `grpc` and `collective` go through a
real gRPC server on loopback (and a Gloo group for `collective`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cluster.kv.collective import CollectiveGroups
from cluster.kv.grpc_transport import CollectiveSender, GrpcSender, serve
from cluster.kv.transport import KVSender, LocalSender
from decode_worker.kv_intake import KVIntake


@contextmanager
def kv_sender(transport: str, intake: KVIntake, timeout_s: float = 10) -> Iterator[KVSender]:
    if transport == "local":
        yield LocalSender(intake)
        return
    closers: list[Callable[[], object]] = []
    groups = CollectiveGroups("cpu", timeout_s=timeout_s)
    server, port = serve(intake, groups=groups)
    closers += [lambda: server.stop(None), groups.close]
    try:
        if transport == "grpc":
            yield GrpcSender(f"127.0.0.1:{port}")
        else:
            sender_groups = CollectiveGroups("cpu", timeout_s=timeout_s)
            closers.append(sender_groups.close)
            yield CollectiveSender(f"127.0.0.1:{port}", sender_groups)
    finally:
        for close in reversed(closers):
            close()
