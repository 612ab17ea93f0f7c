"""SIGTERM: `tandem serve` turns its health NOT_SERVING at once, refuses new requests, lets the
request in flight finish, then stops the cluster and exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.sdk.client import Client, Unavailable
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def health(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def test_sigterm_drains_then_exits_cleanly(tmp_path):
    port = free_port()
    config = tmp_path / "cluster.yaml"
    config.write_text((ROOT / "examples" / "local.yaml").read_text().replace("port: 50051", f"port: {port}"))
    serve = subprocess.Popen(
        [str(Path(sys.executable).parent / "tandem"), "serve", "--config", str(config), "--num-cpus", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while health(address) != health_pb2.HealthCheckResponse.SERVING:
            assert serve.poll() is None, serve.stderr.read()
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.2)
        tokens: list[int] = []
        first = threading.Event()

        def long_request() -> None:
            with Client(address, timeout=120, retries=0) as client:
                for delta in client.stream("def main():", max_tokens=300, temperature=0, ignore_eos=True):
                    tokens.extend(delta.token_ids)
                    first.set()

        runner = threading.Thread(target=long_request)
        runner.start()
        assert first.wait(60)
        serve.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while health(address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health should turn NOT_SERVING at once"
            time.sleep(0.05)
        with Client(address, timeout=10, retries=0) as client, pytest.raises(Unavailable):
            client.generate("x = 1", max_tokens=2)
        runner.join(120)
        assert len(tokens) == 300, "the request in flight runs to its end"
        assert serve.wait(120) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
