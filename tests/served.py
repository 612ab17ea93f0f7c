"""A cluster served in this process, as the OpenAI-face tests run it: one decode and one prefill
worker over gRPC (no Ray), a router, and the router's OpenAI HTTP face, all on loopback."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cluster.config import ClusterConfig
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from router.openai.app import HTTPServer, create_app
from router.service import server as router_server


@dataclass(frozen=True)
class Served:
    base: str  # the HTTP face, "http://host:port"
    grpc_address: str  # the router's
    router: router_server.Router
    decode: decode_service.DecodeWorker
    prefill: prefill_service.PrefillWorker


@contextlib.contextmanager
def serving(config: ClusterConfig, model_name: str) -> Iterator[Served]:
    """The cluster of `config` serving `model_name`, stopped on the way out."""
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = router_server.from_config(config, lambda: workers)
    grpc_address = router.start()
    http = HTTPServer(create_app(grpc_address, model_name, router.telemetry.metrics.registry), "127.0.0.1", 0)
    try:
        yield Served(f"http://{http.start()}", grpc_address, router, decode, prefill)
    finally:
        http.stop()
        router.stop()
        prefill.stop()
        decode.stop()


def wait_idle(served) -> None:  # type: ignore[no-untyped-def]
    """Until both workers' pushed loads show nothing running or waiting and every KV block free
    (cached blocks count as free): a block still held now is a leak."""
    deadline = time.monotonic() + 30
    while True:
        loads = [served.decode.load(), served.prefill.load()]
        if all(not x.running_seqs and not x.waiting_seqs and x.free_kv_blocks == x.total_kv_blocks for x in loads):
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {loads}"
        time.sleep(0.05)
