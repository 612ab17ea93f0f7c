"""KV tiers under a real engine's pool (a small random Llama, float32): a turn whose blocks the
pool evicted loads them from the host tier and computes only the rest, with the tokens (greedy and
seeded) of a fresh prefill; a restarted engine finds its blocks on disk; a second engine loads a
prefix the first wrote through to a real Redis; a corrupted entry is computed instead."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from cluster.config import CacheConfig, DiskTierConfig, HostTierConfig, SchedulerConfig, SharedTierConfig, TiersConfig
from cluster.engine.request import SamplingParams
from cluster.model.loader import load_model
from decode_worker.engine import Engine
from tests.conftest import drive
from tests.redis_server import RedisServer, needs_redis

SECRET = "tier-test-secret"
BATCHING = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_chunk=32)
GREEDY, SEEDED = SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.9, seed=3)


class NoText:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


@pytest.fixture(scope="module")
def model(hf_models):  # type: ignore[no-untyped-def]
    return load_model(hf_models["llama"][0], "float32")


_OPEN: list[Engine] = []  # closed after each test: their tiers' threads stop


@pytest.fixture(autouse=True)
def _close_engines():  # type: ignore[no-untyped-def]
    yield
    while _OPEN:
        _OPEN.pop().close()


def engine(model, tiers: TiersConfig | None = None, num_blocks: int = 24) -> Engine:  # type: ignore[no-untyped-def]
    cache = CacheConfig(block_size=4, num_blocks=num_blocks, watermark=0.0, tiers=tiers or TiersConfig())
    _OPEN.append(Engine(model, NoText(), cache, BATCHING, secret=SECRET))
    return _OPEN[-1]


def one(e: Engine, prompt: list[int], params: SamplingParams = GREEDY):  # type: ignore[no-untyped-def]
    streamed, finals = drive(e, {"r": (prompt, params)})
    return streamed["r"], finals["r"]


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 31 + 7 * i) % 300 + 3 for i in range(n)]


def test_an_evicted_turn_loads_from_the_host_tier_and_equals_a_fresh_prefill(model):
    tiered = engine(model, TiersConfig(host=HostTierConfig(gib=0.01)))
    history = prompt(1)
    first, _ = one(tiered, history)
    for seed in (2, 3, 4):  # three other 40-token prompts: the 24-block pool lets turn 1's blocks go
        one(tiered, prompt(seed))
    assert tiered.scheduler.blocks.cached_blocks([*history, *first]) == 0, "turn 1 is still in the pool"
    assert tiered.tiering is not None and tiered.tiering.tiers.flush()
    turn_2 = [*history, *first, 9, 8, 7]
    for params in (GREEDY, SEEDED):
        fresh, _ = one(engine(model, num_blocks=64), turn_2, params)
        tokens, final = one(tiered, turn_2, params)
        assert tokens == fresh
        assert final.num_cached_tokens >= 40, "the tiers' blocks were not counted as cached"
    assert tiered.tiering.tiers.stats["host"].hits >= 10
    tiered.scheduler.blocks.check_integrity()


def test_each_prompt_prefilled_says_where_its_first_token_waited(model):
    tiered = engine(model, TiersConfig(host=HostTierConfig(gib=0.01)))
    history = prompt(1)
    first, _ = one(tiered, history)
    (computed,) = tiered.take_first_tokens()
    assert computed.tier_load_s == 0 and computed.queue_s >= 0 and computed.prefill_s > 0
    for seed in (2, 3, 4):  # turn 1's blocks leave the pool for the host tier
        one(tiered, prompt(seed))
    assert len(tiered.take_first_tokens()) == 3 and tiered.tiering is not None and tiered.tiering.tiers.flush()
    one(tiered, [*history, *first, 9, 8, 7])
    (loaded,) = tiered.take_first_tokens()
    assert loaded.tier_load_s > 0, "its wait for the host tier's load was not counted"
    assert loaded.queue_s >= 0 and loaded.prefill_s > 0
    assert tiered.take_first_tokens() == []


def test_a_transferred_sequence_preempted_and_computed_again_is_no_local_first_token(model):
    """A sequence whose KV came by transfer had its first token from the prefill worker: when the pool
    preempts it and it is computed here again, that is not a local prefill's first token."""
    small = engine(model, num_blocks=24)  # 96 tokens: two growing 40-token sequences do not fit
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    small.add_request("local", prompt(1), long)
    small.step()
    small.reserve("moved", prompt(2), long)
    small.admit("moved", prompt(2), long, first_token=5)
    preempted = 0
    while small.has_unfinished:
        small.step()
        preempted += sum(r.num_preemptions for r in small.scheduler.running if r.request_id == "moved")
    assert preempted, "the pool never preempted the transferred sequence"
    (waited,) = small.take_first_tokens()  # the local prompt's only
    assert 0 <= waited.queue_s < 60 and waited.prefill_s > 0


def test_a_restarted_engine_serves_its_next_turn_from_disk(model, tmp_path):
    tiers = TiersConfig(disk=DiskTierConfig(path=tmp_path / "kv", gib=0.01), write="computed")
    history = prompt(5)
    first, _ = one(before := engine(model, tiers), history)
    assert before.tiering is not None and before.tiering.tiers.flush()
    before.tiering.close()
    restarted = engine(model, tiers)
    turn_2 = [*history, *first, 11]
    tokens, final = one(restarted, turn_2)
    assert tokens == one(engine(model, num_blocks=64), turn_2)[0]
    assert final.num_cached_tokens >= 40 and restarted.tiering.tiers.stats["disk"].hits >= 10


def test_a_corrupted_disk_entry_is_computed_instead(model, tmp_path):
    tiers = TiersConfig(disk=DiskTierConfig(path=tmp_path / "kv", gib=0.01), write="computed")
    history = prompt(6)
    writer = engine(model, tiers)
    one(writer, history)
    assert writer.tiering is not None and writer.tiering.tiers.flush()
    for path in sorted((tmp_path / "kv").rglob("*.kv")):
        blob = bytearray(path.read_bytes())
        blob[-3] ^= 0x40
        path.write_bytes(bytes(blob))
    reader = engine(model, tiers)
    tokens, final = one(reader, [*history, 1])
    assert tokens == one(engine(model, num_blocks=64), [*history, 1])[0]
    assert final.num_cached_tokens == 0 and reader.tiering.tiers.stats["disk"].rejected >= 1


@needs_redis
def test_a_second_engine_loads_a_prefix_the_first_wrote_through_to_redis(model, tmp_path):
    server = RedisServer(tmp_path, password=SECRET).start()
    try:
        tiers = TiersConfig(shared=SharedTierConfig(url=server.url), write="computed")
        history = prompt(7)
        owner = engine(model, tiers)
        one(owner, history)
        assert owner.tiering is not None and owner.tiering.tiers.flush()
        stranger = engine(model, tiers)
        turn = [*history, 4, 5]
        tokens, final = one(stranger, turn, SEEDED)
        assert tokens == one(engine(model, num_blocks=64), turn, SEEDED)[0]
        assert final.num_cached_tokens >= 40 and stranger.tiering.tiers.stats["shared"].hits >= 10
    finally:
        server.stop()


def test_a_tier_slower_than_computing_is_passed_over(model, tmp_path):
    """Loading only where it is cheaper: once a block from the disk tier has cost more than the
    engine takes to compute one, prompts compute instead."""
    tiers = TiersConfig(disk=DiskTierConfig(path=tmp_path / "kv", gib=0.01), write="computed")
    tiered = engine(model, tiers)
    history = prompt(8)
    one(tiered, history)
    assert tiered.tiering is not None and tiered.tiering.tiers.flush()
    disk = tiered.tiering.tiers.stores[0]
    read = disk.get_many

    def slow(names):  # type: ignore[no-untyped-def]
        time.sleep(0.05 * len(names))  # 50 ms a block: the tiny model computes one in well under that
        return read(names)

    disk.get_many = slow  # type: ignore[method-assign]

    def turn() -> int:
        for seed in (2, 3, 4):  # turn 1's blocks leave the pool
            one(tiered, prompt(seed))
        tokens, final = one(tiered, [*history, 1])
        assert tokens == one(engine(model, num_blocks=64), [*history, 1])[0]
        return final.num_cached_tokens

    assert turn() >= 36, "the first load (nothing measured yet) did not read the disk tier"
    assert tiered.tiering.prefill_rate is not None
    assert turn() == 0 and tiered.tiering.passed_over["disk"] >= 1, "a slower tier was still read"


def test_a_salted_request_loads_nothing_another_salt_left_in_the_tiers(model):
    tiered = engine(model, TiersConfig(host=HostTierConfig(gib=0.01), write="computed"))
    history = prompt(9)
    one(tiered, history, SamplingParams(max_tokens=2, temperature=0.0, cache_salt="tenant-a"))
    assert tiered.tiering is not None and tiered.tiering.tiers.flush()
    for seed in (2, 3, 4):  # the pool lets tenant a's blocks go; the host tier keeps them
        one(tiered, prompt(seed))
    salted = {salt: SamplingParams(max_tokens=2, temperature=0.0, cache_salt=salt) for salt in ("tenant-b", "tenant-a")}
    assert one(tiered, [*history, 1], salted["tenant-b"])[1].num_cached_tokens == 0
    assert one(tiered, [*history, 1])[1].num_cached_tokens == 0, "an unsalted request loaded a salted one's KV"
    assert one(tiered, [*history, 1], salted["tenant-a"])[1].num_cached_tokens >= 36


def test_an_int8_host_tier_keeps_int8_rows_and_serves_the_turn(model):
    tiered = engine(model, TiersConfig(host=HostTierConfig(gib=0.01, int8=True), write="computed"))
    history = prompt(10)
    first, _ = one(tiered, history)
    assert tiered.tiering is not None and tiered.tiering.tiers.flush()
    host = tiered.tiering.tiers.stores[0]
    (keys, _), layers = tiered.kv_cache[0], len(tiered.kv_cache)
    float32_block = 2 * layers * keys[0].numel() * keys.element_size()
    head_dim = keys.shape[-1]
    int8_block = float32_block // 4 * (head_dim + 4) // head_dim  # int8 values and a float32 scale a row
    assert host.bytes == int8_block * len(host.names()), (host.bytes, len(host.names()), int8_block)
    for seed in (2, 3, 4):
        one(tiered, prompt(seed))
    turn_2 = [*history, *first, 6]
    tokens, final = one(tiered, turn_2)
    assert final.num_cached_tokens >= 40 and tiered.tiering.tiers.stats["host"].hits >= 10
    fresh, _ = one(engine(model, num_blocks=64), turn_2)
    assert tokens[0] == fresh[0]  # int8 KV is close, not equal: the first greedy token agrees


def test_a_request_id_waiting_for_its_load_is_in_use_until_it_is_aborted(model):
    tiered = engine(model, TiersConfig(host=HostTierConfig(gib=0.01), write="computed"))
    history = prompt(11)
    one(tiered, history)
    assert tiered.tiering is not None and tiered.tiering.tiers.flush()
    for seed in (2, 3, 4):
        one(tiered, prompt(seed))
    never: concurrent.futures.Future = concurrent.futures.Future()  # a load that does not end
    tiered.tiering.tiers.fetch = lambda names, kinds=None: never  # type: ignore[method-assign]
    tiered.add_request("dup", [*history, 1], GREEDY)
    assert "dup" in tiered.tiering and tiered.has_unfinished
    with pytest.raises(ValueError, match="already in use"):
        tiered.add_request("dup", [*history, 2], GREEDY)
    with pytest.raises(KeyError, match="already in use"):
        tiered.reserve("dup", [*history, 2], GREEDY)
    assert tiered.step() == [] and "dup" in tiered.tiering
    assert tiered.abort("dup") and "dup" not in tiered.tiering and not tiered.has_unfinished
    tiered.scheduler.blocks.check_integrity()
