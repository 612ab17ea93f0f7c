"""Router replicas over fake workers: two router processes share one port (SO_REUSEPORT); one is
killed with SIGKILL mid-stream, and the SDK resumes every broken stream through the other."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from router.sdk.client import AsyncClient, Client
from tests.fake_workers import FakeFleet

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def start_router(addresses: dict[str, str], address: str, config: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A router process over `addresses`: over fake workers, or from `config` over real ones."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
    if config is None:
        args = ["-m", "tests.fake_workers", "--router-over", json.dumps(addresses), "--address", address]
    else:
        args = [str(ROOT / "tests" / "router_process.py"), json.dumps(config), json.dumps(addresses), address]
    process = subprocess.Popen(
        [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True
    )
    return process, process.stdout.readline().strip()  # type: ignore[union-attr]


def stop_all(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.stdin.close()  # type: ignore[union-attr]
            process.wait(20)


@pytest.fixture
def fleet():
    fleet = FakeFleet()
    for i in range(4):
        fleet.add(f"decode-{i}", step_s=0.03)
    yield fleet
    fleet.close()


REQUESTS = {f"r{i}": (f"prompt {i} " * (i + 1), {"temperature": 0} if i % 2 else {"seed": i}) for i in range(16)}
MAX_TOKENS = 24
RESUMED: dict[str, int] = {}  # request -> times the SDK resumed it, in the last run


def run_all(
    address: str, progress: dict[str, int], requests: dict = REQUESTS, max_tokens: int = MAX_TOKENS
) -> tuple[dict[str, tuple[list[int], str]], list[Exception]]:
    """Every request, half through the blocking client on threads and half through the async one."""
    results: dict[str, tuple[list[int], str]] = {}
    errors: list[Exception] = []
    resumed = RESUMED

    def one(rid: str) -> None:
        prompt, sampling = requests[rid]
        tokens, text = [], ""
        try:
            with Client(address, timeout=120, retries=5, backoff_s=0.05) as client:
                for delta in client.stream(prompt, max_tokens=max_tokens, **sampling):
                    tokens += delta.token_ids
                    text += delta.text
                    progress[rid] = len(tokens)
                resumed[rid] = client.resumed
        except Exception as e:
            errors.append(e)
        results[rid] = (tokens, text)

    async def async_one(rid: str) -> None:
        prompt, sampling = requests[rid]
        tokens, text = [], ""
        try:
            async with AsyncClient(address, timeout=120, retries=5, backoff_s=0.05) as client:
                async for delta in client.stream(prompt, max_tokens=max_tokens, **sampling):
                    tokens += delta.token_ids
                    text += delta.text
                    progress[rid] = len(tokens)
                resumed[rid] = client.resumed
        except Exception as e:
            errors.append(e)
        results[rid] = (tokens, text)

    names = sorted(requests)
    threads = [threading.Thread(target=one, args=(rid,)) for rid in names[::2]]
    for t in threads:
        t.start()

    async def async_all() -> None:
        await asyncio.gather(*(async_one(rid) for rid in names[1::2]))

    asyncio.run(async_all())
    for t in threads:
        t.join(120)
    return results, errors


def test_a_router_killed_mid_stream_loses_nothing_the_sdk_resumes_through_another(fleet):
    first, address = start_router(fleet.addresses(), "127.0.0.1:0")
    second, same = start_router(fleet.addresses(), address)
    assert same == address, "both routers serve the one port"
    try:
        expected, errors = run_all(address, {})
        RESUMED.clear()
        assert not errors and all(len(t) == 24 for t, _ in expected.values())
        # The kernel spreads connections over the two routers as it likes: a run in which no stream
        # happened to go through the killed router shows nothing, so it is tried again (a new first router
        # on the same port) until one did.
        for _ in range(5):
            before = sum(w.resumed for w in fleet.workers.values())
            RESUMED.clear()
            progress: dict[str, int] = {}
            killer = threading.Thread(target=kill_when_streaming, args=(first, progress))
            killer.start()
            results, errors = run_all(address, progress)
            killer.join()
            assert not errors, errors[:3]
            assert results == expected, "every output equals its fault-free run, greedy and seeded"
            resumed = sum(w.resumed for w in fleet.workers.values()) - before
            assert resumed == sum(RESUMED.values())
            if resumed:
                break
            first.wait(20)
            first, _ = start_router(fleet.addresses(), address)
        assert resumed >= 1, "streams through the killed router were resumed"
    finally:
        stop_all(first, second)


DEMO = ROOT / "models" / "tandem-demo-code"


def test_real_workers_a_killed_router_loses_nothing_greedy_and_seeded():
    """The same with the demo model on a real decode and prefill worker: prompts past
    local_prefill_max_tokens are prefilled remotely, shorter ones on the decode worker."""
    from cluster.config import parse_config
    from decode_worker import service as decode_service
    from prefill_worker import service as prefill_service

    data = {
        "model": {"path": str(DEMO), "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": 512},
        "router": {"local_prefill_max_tokens": 8},
    }
    config = parse_config(data)
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    requests = {
        f"r{i}": ("def f(x):\n    return" + " x +" * (i * 2), {"ignore_eos": True, **sampling(i)}) for i in range(8)
    }
    processes: list[subprocess.Popen] = []
    try:
        first, address = start_router(workers, "127.0.0.1:0", data)
        second, _ = start_router(workers, address, data)
        processes = [first, second]
        expected, errors = run_all(address, {}, requests, max_tokens=96)
        RESUMED.clear()
        assert not errors and all(len(t) == 96 for t, _ in expected.values())
        for _ in range(5):  # until a stream went through the killed router (the kernel spreads them)
            RESUMED.clear()
            progress: dict[str, int] = {}
            killer = threading.Thread(target=kill_when_streaming, args=(first, progress, len(requests)))
            killer.start()
            results, errors = run_all(address, progress, requests, max_tokens=96)
            killer.join()
            assert not errors, errors[:3]
            assert results == expected, "every output equals its fault-free run, greedy and seeded"
            if sum(RESUMED.values()):
                break
            first.wait(20)
            first, _ = start_router(workers, address, data)
            processes.append(first)
        assert sum(RESUMED.values()) >= 1, "streams through the killed router were resumed"
    finally:
        stop_all(*processes)
        prefill.stop()
        decode.stop()


def kill_when_streaming(router: subprocess.Popen, progress: dict[str, int], n: int = len(REQUESTS)) -> None:
    deadline = time.monotonic() + 120
    while len(progress) < n or min(progress.values()) < 3:
        assert time.monotonic() < deadline, "the load never got going"
        time.sleep(0.01)
    os.kill(router.pid, signal.SIGKILL)
    router.wait()


def sampling(i: int) -> dict:
    return {"temperature": 0} if i % 2 else {"seed": i}  # greedy and seeded sampled alike
