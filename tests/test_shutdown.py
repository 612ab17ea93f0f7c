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

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def health(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def router_address(serve: subprocess.Popen, timeout_s: float) -> str:
    """The address `tandem serve` says its router listens on (it binds port 0: a port picked here
    and freed could be taken by one of Ray's own servers before the router binds it)."""
    said: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in serve.stderr:  # type: ignore[union-attr]
            said.append(line)  # read on to the end: a full pipe would stall the server
            if line.startswith("router at "):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not found.wait(0.2):
        assert serve.poll() is None, "".join(said)
        assert time.monotonic() < deadline, "the cluster did not come up: " + "".join(said)
    (line,) = [line for line in said if line.startswith("router at ")]
    return line.removeprefix("router at ").split(";")[0]


def test_sigterm_drains_then_exits_cleanly(tmp_path):
    serve = subprocess.Popen(
        [str(Path(sys.executable).parent / "tandem"), "serve", "--config", str(ROOT / "examples" / "local.yaml"),
         "--port", "0", "--num-cpus", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        address = router_address(serve, 120)
        deadline = time.monotonic() + 30
        while health(address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"the router at {address} never said SERVING"
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
        serve.send_signal(signal.SIGINT)  # a second signal while the first is handled changes nothing
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
