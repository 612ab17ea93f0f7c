"""The first token of a remotely prefilled request leaves when the prefill worker samples it.

Real workers of the demo model in this process (no Ray), every prompt prefilled remotely over
`grpc`: the decode worker's KV intake holds each transfer's commit (the admission) back until the
test lets it go, or fails it. The client sees the first token while the admission is held; a
transfer that fails after that token was streamed is migrated, and every output equals the
fault-free run's, greedy and seeded."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import grpc
import pytest

from cluster.config import parse_config
from cluster.kv.wire import TransferError
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from router.sdk.client import Client
from router.service.server import from_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
PROMPT = "def fibonacci(n):\n    "
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 7}}

pytestmark = pytest.mark.slow


def config(first_token_from_prefill: bool = True):
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
            "cache": {"block_size": 16, "num_blocks": 128},
            "transfer": {"transport": "grpc", "timeout_s": 20},
            "router": {"local_prefill_max_tokens": 0, "first_token_from_prefill": first_token_from_prefill},
        }
    )


class HeldCommits:
    """Wraps the decode worker's `KVIntake.commit`: while `hold` is clear, each commit waits; a
    commit let go with `fail_next` set fails the transfer instead (UNAVAILABLE)."""

    def __init__(self, intake) -> None:  # type: ignore[no-untyped-def]
        self.intake, self.commit = intake, intake.commit
        self.hold = threading.Event()
        self.hold.set()
        self.waiting = threading.Event()  # a commit is being held now
        self.fail_next = False
        self.committed = 0
        intake.commit = self

    def __call__(self, transfer, commit):  # type: ignore[no-untyped-def]
        if not self.hold.is_set():
            self.waiting.set()
            self.hold.wait(30)
            self.waiting.clear()
        if self.fail_next:
            self.fail_next = False
            error = TransferError(grpc.StatusCode.UNAVAILABLE, "the test broke the transfer")
            self.intake.fail(transfer, error)
            raise error
        self.committed += 1
        return self.commit(transfer, commit)


@pytest.fixture(scope="module")
def cluster():
    cfg = config()
    decode = decode_service.from_config(cfg, "decode-0")
    prefill = prefill_service.from_config(cfg, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    held = HeldCommits(decode.intake)
    routers = {flag: from_config(config(flag), lambda: workers) for flag in (True, False)}
    addresses = {flag: router.start() for flag, router in routers.items()}
    yield decode, held, routers, addresses
    for router in routers.values():
        router.stop()
    prefill.stop()
    decode.stop()


def stream_on_thread(address: str, sampling: dict, max_tokens: int = 12):  # type: ignore[no-untyped-def]
    """The deltas of one request as they arrive (a queue, None after the last), and its thread."""
    deltas: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            with Client(address, timeout=60) as client:
                for delta in client.stream(PROMPT, max_tokens=max_tokens, **sampling):
                    deltas.put(delta)
        except Exception as e:
            deltas.put(e)
        deltas.put(None)

    thread = threading.Thread(target=run)
    thread.start()
    return deltas, thread


def collect(deltas: queue.Queue) -> tuple[list[int], str]:
    tokens, text = [], ""
    while (delta := deltas.get(timeout=60)) is not None:
        if isinstance(delta, Exception):
            raise delta
        tokens += delta.token_ids
        text += delta.text
    return tokens, text


def fault_free(address: str, sampling: dict) -> tuple[list[int], str]:
    deltas, thread = stream_on_thread(address, sampling)
    result = collect(deltas)
    thread.join()
    return result


@pytest.mark.parametrize("kind", SAMPLINGS)
def test_the_first_token_reaches_the_client_before_the_decode_worker_admits(cluster, kind):
    decode, held, _, addresses = cluster
    expected = fault_free(addresses[True], SAMPLINGS[kind])
    held.hold.clear()
    try:
        committed = held.committed
        deltas, thread = stream_on_thread(addresses[True], SAMPLINGS[kind])
        first = deltas.get(timeout=60)
        assert not isinstance(first, Exception), first
        assert held.committed == committed and not decode.engine.occupancy.running  # not admitted yet
        assert first.token_ids == expected[0][:1]
        assert held.waiting.wait(30)  # the transfer reached its commit, which is held
    finally:
        held.hold.set()
    tokens, text = collect(deltas)
    thread.join()
    assert [*first.token_ids, *tokens] == expected[0]
    assert first.text + text == expected[1]  # the first token's text once, not again with the decode worker's


def test_without_first_token_from_prefill_the_first_token_waits_for_the_admission(cluster):
    _, held, _, addresses = cluster
    held.hold.clear()
    try:
        deltas, thread = stream_on_thread(addresses[False], SAMPLINGS["greedy"])
        assert held.waiting.wait(30)
        with pytest.raises(queue.Empty):
            deltas.get(timeout=1.0)
    finally:
        held.hold.set()
    tokens, text = collect(deltas)
    thread.join()
    assert (tokens, text) == fault_free(addresses[True], SAMPLINGS["greedy"])


@pytest.mark.parametrize("kind", SAMPLINGS)
def test_a_transfer_that_fails_after_the_first_token_streamed_is_migrated(cluster, kind):
    decode, held, routers, addresses = cluster
    router = routers[True]
    expected = fault_free(addresses[True], SAMPLINGS[kind])
    free = decode.engine.occupancy.free_blocks
    migrations = router.telemetry.metrics.migrations.labels("prefill")._value.get()
    held.hold.clear()
    try:
        deltas, thread = stream_on_thread(addresses[True], SAMPLINGS[kind])
        first = deltas.get(timeout=60)
        assert not isinstance(first, Exception), first
        held.fail_next = True  # the held commit fails when let go
        assert held.waiting.wait(30)
    finally:
        held.hold.set()
    tokens, text = collect(deltas)
    thread.join()
    assert [*first.token_ids, *tokens] == expected[0]
    assert first.text + text == expected[1]
    assert router.telemetry.metrics.migrations.labels("prefill")._value.get() == migrations + 1
    assert decode.engine.occupancy.free_blocks == free  # the failed transfer's blocks came back
