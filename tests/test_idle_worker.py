"""An idle worker sleeps: its engine loop and the Watch streams of the routers that follow it wait
for the engine to change (a request added, admitted or aborted, a step taken) instead of polling,
and a remotely prefilled request is admitted and decoded at once all the same. Real workers of the
demo model and a real router in this process (no Ray)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.config import parse_config
from cluster.engine.core_process import IDLE_WAKE_S
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from router.sdk.client import Client
from router.service.server import from_config

ROOT = Path(__file__).resolve().parents[1]
IDLE_S = 2.0

pytestmark = pytest.mark.slow


class Counted:
    """Wraps a bound method, counting its calls."""

    def __init__(self, owner, name: str) -> None:  # type: ignore[no-untyped-def]
        self.method, self.calls = getattr(owner, name), 0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.method(*args, **kwargs)


def test_an_idle_worker_sleeps_and_still_serves_at_once():
    config = parse_config({
        "model": {"path": str(ROOT / "models" / "tandem-demo-code"), "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": 64},
        "router": {"local_prefill_max_tokens": 0},  # every prompt is prefilled remotely: an admission wakes decode
    })  # fmt: skip
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    turns, loads = Counted(decode.watchdog, "progress"), Counted(decode, "load")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = from_config(config, lambda: workers)
    address = router.start()
    try:
        with Client(address, timeout=60) as client:
            client.generate("def f(x):", max_tokens=4, temperature=0)  # the router now watches both workers
            turns.calls = loads.calls = 0
            time.sleep(IDLE_S)
            idle_turns, idle_loads = turns.calls, loads.calls
            reply = client.generate("def fibonacci(n):", max_tokens=8, temperature=0)
        wakes = IDLE_S / IDLE_WAKE_S
        assert idle_turns <= wakes + 2, f"the idle engine loop turned {idle_turns} times in {IDLE_S} s"
        heartbeats = IDLE_S / 0.5  # the router's Watch asks for a heartbeat every 0.5 s
        assert idle_loads <= heartbeats + 2, f"an idle worker's load was read {idle_loads} times in {IDLE_S} s"
        assert len(reply.token_ids) == 8 and reply.finish_reason == "length"
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
