"""`tandem control` stopped and started again under a live `tandem router`, on a Ray cluster both
joined (this test process holds it, as a Ray head would): streams in flight when the workers went
migrate to the new ones and end with their fault-free tokens, greedy and seeded; the router finds the
new registry and pools by name without a restart of its own."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from router.sdk.client import Client
from tests.streams import run_streams

ROOT = Path(__file__).resolve().parents[1]
TANDEM = str(Path(sys.executable).parent / "tandem")
STREAMS, TOKENS = 8, 900  # long enough to outlive the workers' stop on a fast CPU (the demo model holds 1,024)
PROMPT = list(range(40, 90))

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_address():
    ray.init("local", num_cpus=4, include_dashboard=False, namespace="tandem-controller-tests", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


class Process:
    """A `tandem` command, its stderr read to the end on a thread (a full pipe would stall it)."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([TANDEM, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.said: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:  # type: ignore[union-attr]
            self.said.append(line.decode())

    def wait_for(self, words: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(words in line for line in self.said):
            assert self.process.poll() is None and time.monotonic() < deadline, "".join(self.said)
            time.sleep(0.2)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(120)


def streams(address: str, first: threading.Event | None = None) -> list[list[int]]:
    return run_streams([address], STREAMS, PROMPT, TOKENS, first)


def test_a_controller_started_again_under_a_live_router_loses_nothing(ray_address, tmp_path):
    config = tmp_path / "cluster.yaml"
    text = (ROOT / "examples" / "local.yaml").read_text().replace("port: 50051", "port: 0")
    config.write_text(f"ray_address: {ray_address}\n{text}")
    control = Process("control", "--config", str(config))
    router = None
    try:
        control.wait_for("pools up", 300)
        router = Process("router", "--config", str(config))
        line = router.process.stdout.readline().decode().split()  # type: ignore[union-attr]
        assert line[:1] == ["router"], "".join(router.said)
        address = line[3]
        fault_free, first = streams(address), threading.Event()
        with ThreadPoolExecutor(1) as pool:
            under_restart = pool.submit(streams, address, first)
            assert first.wait(60), "the streams never got going"
            assert control.stop() == 0, "".join(control.said)
            assert not under_restart.done(), "the streams should outlive their workers: make them longer"
            control = Process("control", "--config", str(config))
            control.wait_for("pools up", 300)
            assert under_restart.result(300) == fault_free, "a stream was lost or changed"
        with Client(address, timeout=60, retries=0) as client:
            assert len(client.generate(PROMPT, max_tokens=4, ignore_eos=True).token_ids) == 4
        assert router.process.poll() is None, "the router served on through the restart"
    finally:
        if router is not None:
            router.stop()
        control.stop()
