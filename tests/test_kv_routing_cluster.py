"""KV-aware routing end to end: real workers of the demo model in this process (one prefill, two
decode; real gRPC, no Ray) push their cache events on their watch streams, and the router places
each turn of a conversation where its history's KV is. Every turn's tokens equal one engine's;
turn 2 computes only its new tokens; a gap in a worker's events resynchronises its stream."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.config import parse_config
from cluster.engine.block_names import chain
from cluster.engine.kv_events import KVBatch
from cluster.generate import generate
from cluster.model.loader import load_model
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from router.sdk.client import Client
from router.service.server import from_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
BLOCK = 16
LOCAL_MAX = 24  # the uncached part of a prompt up to this many tokens is prefilled on the decode worker

pytestmark = pytest.mark.slow


def config(routing: str = "kv"):
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
            "cache": {"block_size": BLOCK, "num_blocks": 256},
            "transfer": {"transport": "grpc", "timeout_s": 20},
            "router": {"local_prefill_max_tokens": LOCAL_MAX, "prefix_routing": routing},
        }
    )


@pytest.fixture(scope="module")
def cluster():
    cfg = config()
    workers = {f"decode-{i}": decode_service.from_config(cfg, f"decode-{i}") for i in range(2)}
    workers["prefill-0"] = prefill_service.from_config(cfg, "prefill-0")
    addresses = {name: worker.start() for name, worker in workers.items()}
    router = from_config(cfg, lambda: addresses)
    address = router.start()
    yield workers, router, address
    router.stop()
    for worker in workers.values():
        worker.stop()


@pytest.fixture(scope="module")
def model():
    return load_model(DEMO, "float32")


def wait_for_blocks(router, worker: str, tokens: list[int], within_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    """Until the router has heard that `worker` holds the whole blocks of `tokens` and is idle
    again (as a user's next turn comes after a think time)."""
    prefix, index = router.view.index.prefix, router.view.index
    (root,) = prefix.roots()
    hashes = chain(tokens, BLOCK, root)

    def heard() -> bool:
        load = index.loads().get(worker)
        idle = load is not None and load.running_seqs == 0 and load.free_kv_blocks == load.total_kv_blocks
        return idle and prefix.match(hashes).get(worker, 0) == len(hashes)

    deadline = time.monotonic() + within_s
    while not heard() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert heard(), (worker, prefix.match(hashes), len(hashes))


def test_each_turn_returns_to_the_kv_it_left_and_computes_only_its_new_tokens(cluster, model):
    _workers, router, address = cluster
    history = [(7 * i) % 400 + 3 for i in range(40)]  # a system prompt and a first question
    placed = []
    with Client(address, timeout=60) as client:
        for turn in range(3):
            done = client.generate(history, max_tokens=16, temperature=0.0, ignore_eos=True)
            expected = generate(model, [history], 16)[0].tokens
            assert done.token_ids == expected, f"turn {turn + 1}"
            placed.append(done)
            decode = done.metadata["tandem-decode"]
            wait_for_blocks(router, decode, [*history, *done.token_ids[:-1]])  # the last token's KV is never computed
            history = [*history, *done.token_ids, *[(11 * i) % 400 + 3 for i in range(8)]]  # the next question
    first, second, third = placed
    assert first.metadata["tandem-prefill"].startswith("remote:")  # nothing cached: the prefill worker
    for later in (second, third):
        assert later.metadata["tandem-decode"] == first.metadata["tandem-decode"]  # back to its KV
        assert later.metadata["tandem-prefill"] == "local:cached-prefix"
        cached = int(later.metadata["tandem-cached-blocks"]) * BLOCK
        assert later.cached_prompt_tokens == cached > 0  # the decode worker computed only the rest
        assert later.prompt_tokens - cached <= LOCAL_MAX
    assert router.telemetry.metrics.placements.labels("local:cached-prefix")._value.get() >= 2


def test_remote_prefill_ships_only_the_blocks_the_decode_worker_lacks(cluster, model):
    workers, router, address = cluster
    kv_bytes = workers["prefill-0"].telemetry.metrics.kv_bytes.labels("grpc")
    arch = model.arch
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4  # float32 keys and values
    history = [(13 * i) % 400 + 3 for i in range(40)]
    with Client(address, timeout=60) as client:
        first = client.generate(history, max_tokens=16, temperature=0.0, ignore_eos=True)
        decode = first.metadata["tandem-decode"]
        wait_for_blocks(router, decode, [*history, *first.token_ids[:-1]])
        history = [*history, *first.token_ids, *[(17 * i) % 400 + 3 for i in range(40)]]  # too much to prefill there
        sent = kv_bytes._sum.get()
        second = client.generate(history, max_tokens=16, temperature=0.0, ignore_eos=True)
    shipped = kv_bytes._sum.get() - sent
    assert second.token_ids == generate(model, [history], 16)[0].tokens
    assert second.metadata["tandem-decode"] == decode and second.metadata["tandem-prefill"].startswith("remote:")
    kept = (40 + 16 - 1) // BLOCK * BLOCK  # turn 1's computed blocks, on the decode worker
    assert shipped == (len(history) - kept) * per_token


def test_a_decode_worker_without_the_blocks_the_router_expected_refuses_and_the_request_completes(cluster, model):
    """As when the worker evicted them after the router last heard: its intake refuses the
    transfer (ABORTED), and the request moves on shipping everything, with the same output."""
    _, router, address = cluster
    prompt = [(29 * i) % 400 + 3 for i in range(120)]
    prefix, name = router.view.index.prefix, "decode-1"
    cursor = prefix._cursor[name]
    (root,) = prefix.roots()
    claimed = chain(prompt, BLOCK, root)[:4]
    assert prefix.apply(name, KVBatch(cursor + 1, cursor + 1, claimed, []))  # what it does not hold
    migrations = router.telemetry.metrics.migrations.labels("prefill")._value.get()
    with Client(address, timeout=60) as client:
        done = client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    assert done.token_ids == generate(model, [prompt], 16)[0].tokens
    assert done.metadata["tandem-decode"] == name and done.metadata["tandem-prefill"].startswith("remote:")
    assert router.telemetry.metrics.migrations.labels("prefill")._value.get() == migrations + 1


def test_a_gap_in_a_workers_events_resynchronises_its_stream_without_leaving_placement(cluster):
    workers, router, address = cluster
    view, prefix = router.view, router.view.index.prefix
    name = "decode-0"
    held = prefix.blocks_of(name)
    resyncs = view.resyncs
    prefix._cursor[name] -= 1  # as if one batch had been lost
    with Client(address, timeout=60) as client:  # until decode-0 has new events to send
        for n in range(8):
            done = client.generate([5 + n] * 40, max_tokens=4, temperature=0.0)
            if done.metadata["tandem-decode"] == name:
                break
    deadline = time.monotonic() + 10
    while view.resyncs == resyncs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert view.resyncs > resyncs
    journal = workers[name].engine.kv_journal
    while prefix.blocks_of(name) != len(journal.held()) and time.monotonic() < deadline + 10:
        time.sleep(0.02)
    assert prefix.blocks_of(name) == len(journal.held()) >= held  # the snapshot: all it holds
    assert name in view.index.loads()


def test_a_worker_that_dies_takes_its_entries_with_it(cluster):
    workers, router, _address = cluster
    prefix = router.view.index.prefix
    assert prefix.blocks_of("prefill-0") > 0
    workers.pop("prefill-0").stop()  # its watch stream breaks (the last test: nothing needs it after)
    deadline = time.monotonic() + 10
    while prefix.blocks_of("prefill-0") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert prefix.blocks_of("prefill-0") == 0
    assert all(name != "prefill-0" for name in prefix.match([h for h in prefix._holders][:1]))
