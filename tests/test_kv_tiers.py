"""The KV tiers alone, without a model: each store's LRU order and budget, a block being loaded never
evicted, a failed write leaving nothing half-written, sealed entries (a corrupted one, or one written
without the cluster's secret under a real block's name, is a miss), the disk tier surviving a
restart, and a real Redis that dies and comes back: its tier off, then on again, nothing raised."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cluster.engine.block_manager import BlockManager
from cluster.engine.block_names import UNNAMED_MODEL, chain
from cluster.kv.stores import DiskStore, HostStore, RedisStore, StoreDown
from cluster.kv.tiering import PROBE_EVERY, Tiering
from cluster.kv.tiers import Tiers, seal, unseal
from tests.redis_server import RedisServer, needs_redis

SECRET, LAYOUT = b"cluster-secret", b"float32 2x16x2x8"
NAMES = chain(list(range(16 * 8)), 16, UNNAMED_MODEL)  # eight real block names
PAYLOAD = 1000  # bytes per block in these tests


def payload(i: int) -> bytes:
    return bytes([i % 256]) * PAYLOAD


def sealed(i: int) -> bytes:
    return seal(SECRET, NAMES[i], LAYOUT, payload(i))


@pytest.fixture(params=["host", "disk"])
def store(request, tmp_path):  # type: ignore[no-untyped-def]
    budget = 3 * (PAYLOAD + 64)
    return HostStore(budget) if request.param == "host" else DiskStore(tmp_path / "kv", budget)


def test_a_store_evicts_the_least_recently_used_past_its_budget(store):
    for i in range(3):
        store.put(NAMES[i], sealed(i))
    assert store.get_many([NAMES[0]]) == [sealed(0)]  # 0 is now the most recent
    store.put(NAMES[3], sealed(3))
    assert [store.holds(n) for n in NAMES[:4]] == [True, False, True, True]
    assert store.get_many(NAMES[:4]) == [sealed(0), None, sealed(2), sealed(3)]


def test_a_pinned_entry_outlives_the_budget_until_unpinned(store):
    for i in range(3):
        store.put(NAMES[i], sealed(i))
    store.pin(NAMES[:3])
    store.put(NAMES[3], sealed(3))
    store.put(NAMES[4], sealed(4))
    assert all(store.holds(n) for n in NAMES[:3]), "a pinned entry was evicted"
    store.unpin(NAMES[:3])
    store.put(NAMES[5], sealed(5))
    assert sum(store.holds(n) for n in NAMES[:6]) == 3


def test_a_block_being_loaded_is_never_evicted_by_the_writes_meanwhile(tmp_path):
    """The loader holds the run it reads pinned: the writer filling the tier past its budget at the
    same time evicts other blocks, and the load gets all it found."""
    disk = DiskStore(tmp_path / "kv", 4 * (PAYLOAD + 64))
    reading, go_on = threading.Event(), threading.Event()
    read = disk.get_many

    def slow_read(names):  # type: ignore[no-untyped-def]
        reading.set()
        go_on.wait(10)
        return read(names)

    tiers = Tiers([disk], SECRET, LAYOUT)
    for i in range(4):
        tiers.offer(NAMES[i], payload(i))
    assert tiers.flush()
    disk.get_many = slow_read  # type: ignore[method-assign]
    loading = tiers.fetch(NAMES[:4])
    assert reading.wait(10)
    for i in range(4, 8):  # enough to evict every unpinned entry twice over
        tiers.offer(NAMES[i], payload(i))
    assert tiers.flush()
    go_on.set()
    run = loading.result(10)
    assert run.payloads == [payload(i) for i in range(4)] and run.sources == ["disk"] * 4
    tiers.close()


def test_a_failed_write_leaves_nothing_half_written_and_turns_the_tier_off(tmp_path, monkeypatch):
    disk, host = DiskStore(tmp_path / "kv", 1 << 20), HostStore(1 << 20)
    tiers = Tiers([host, disk], SECRET, LAYOUT, retry_after_s=60)

    def half_then_fail(self, data):  # type: ignore[no-untyped-def]
        with open(self, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", half_then_fail)
    tiers.offer(NAMES[0], payload(0))
    assert tiers.flush()
    assert not disk.holds(NAMES[0]) and not list((tmp_path / "kv").rglob("*.kv*")), "a partial file was left"
    assert tiers.stats["disk"].failures == 1 and tiers.stats["disk"].off_until > time.monotonic()
    assert host.holds(NAMES[0]), "the host tier lost the block because the disk failed"
    monkeypatch.undo()
    assert tiers.fetch(NAMES[:1]).result(10).sources == ["host"]
    tiers.close()


def test_a_killed_write_is_cleared_at_start_and_the_disk_tier_survives_a_restart(tmp_path):
    tiers = Tiers([DiskStore(tmp_path / "kv", 1 << 20)], SECRET, LAYOUT)
    for i in range(3):
        tiers.offer(NAMES[i], payload(i))
    assert tiers.flush()
    tiers.close()
    torn = tmp_path / "kv" / "ab" / "abcd.kv.123.456.tmp"
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"half an entry")
    restarted = Tiers([DiskStore(tmp_path / "kv", 1 << 20)], SECRET, LAYOUT)
    assert not torn.exists()
    assert restarted.fetch(NAMES[:4]).result(10).payloads == [payload(i) for i in range(3)]
    assert restarted.stats["disk"].hits == 3 and restarted.stats["disk"].load_rate
    restarted.close()


def test_a_corrupted_entry_or_one_sealed_without_the_secret_is_a_miss(tmp_path):
    disk = DiskStore(tmp_path / "kv", 1 << 20)
    tiers = Tiers([disk], SECRET, LAYOUT)
    for i in range(4):
        tiers.offer(NAMES[i], payload(i))
    assert tiers.flush()
    path = disk._path(NAMES[1])
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))  # one bit of block 1 flipped
    assert tiers.fetch(NAMES[:4]).result(10).payloads == [payload(0)]
    forged = seal(b"not the secret", NAMES[0], LAYOUT, b"\x00" * PAYLOAD)  # a real block's name
    disk._path(NAMES[0]).write_bytes(forged)
    assert tiers.fetch(NAMES[:4]).result(10).payloads == []
    assert tiers.stats["disk"].rejected == 2
    assert unseal(SECRET, NAMES[2], b"another layout", sealed(2)) is None
    assert unseal(SECRET, NAMES[3], LAYOUT, sealed(2)) is None, "an entry served under another block's name"
    assert unseal(SECRET, NAMES[2], LAYOUT, b"short") is None
    tiers.close()


@needs_redis
def test_the_shared_tier_on_a_real_redis_goes_off_when_it_dies_and_back_when_it_returns(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        shared = RedisStore(server.url, password=server.password, timeout_s=0.5)
        host = HostStore(1 << 20)
        tiers = Tiers([host, shared], SECRET, LAYOUT, retry_after_s=0.5)
        for i in range(3):
            tiers.offer(NAMES[i], payload(i))
        assert tiers.flush()
        stranger = Tiers([HostStore(1 << 20), RedisStore(server.url, password=server.password)], SECRET, LAYOUT)
        run = stranger.fetch(NAMES[:4]).result(10)  # another worker: nothing of its own, all from Redis
        assert run.payloads == [payload(i) for i in range(3)] and run.sources == ["shared"] * 3
        again = stranger.fetch(NAMES[:3]).result(10)
        assert again.sources == ["host"] * 3, "what came from Redis is kept in the host tier"
        with pytest.raises(StoreDown):
            RedisStore(server.url, password="wrong").get_many(NAMES[:1])
        server.stop()
        fresh = Tiers(
            [RedisStore(server.url, password=server.password, timeout_s=0.2)], SECRET, LAYOUT, retry_after_s=0.5
        )
        assert fresh.fetch(NAMES[:3]).result(10).payloads == []  # a miss, not an error
        assert fresh.stats["shared"].failures == 1
        server.start()  # on the same port, empty
        tiers.offer(NAMES[5], payload(5))
        assert tiers.flush()
        time.sleep(0.6)  # past retry_after_s
        fresh.offer(NAMES[6], payload(6))
        assert fresh.flush()
        assert fresh.fetch(NAMES[6:7]).result(10).sources == ["shared"], "the tier did not come back"
        for t in (tiers, stranger, fresh):
            t.close()
    finally:
        server.stop()


def test_a_tier_is_read_only_while_its_block_costs_less_than_computing_one_save_a_probe(tmp_path):
    tiers = Tiers([HostStore(1 << 20), DiskStore(tmp_path / "kv", 1 << 20)], SECRET, LAYOUT)
    tiering = Tiering(tiers, BlockManager(8, 16), runner=None)  # type: ignore[arg-type]
    assert tiering._worth_loading() == ["host", "disk"], "nothing measured yet: every tier is worth a try"
    tiering.prefill_rate = 1600.0  # a 16-token block computes in 10 ms
    tiers.stats["host"].hits, tiers.stats["host"].load_seconds = 10, 0.001  # 0.1 ms a block
    tiers.stats["disk"].hits, tiers.stats["disk"].load_seconds = 10, 0.5  # 50 ms a block
    picks = [tiering._worth_loading() for _ in range(PROBE_EVERY)]
    assert all("host" in p for p in picks)
    assert sum("disk" in p for p in picks) == 1 and tiering.passed_over["disk"] == PROBE_EVERY - 1
    tiers.close()


@needs_redis
def test_the_shared_tier_speaks_tls_to_a_redis_that_serves_only_tls(tmp_path):
    from cluster.tls import generate_dev_certs

    certs = generate_dev_certs(tmp_path / "certs", 1)
    server = RedisServer(tmp_path, tls=certs)
    try:
        server.start()
    except RuntimeError:
        pytest.skip("this redis-server does not serve TLS (built without it)")
    try:
        writer = Tiers([RedisStore(server.url, server.password, tls_ca=certs["ca"])], SECRET, LAYOUT)
        writer.offer(NAMES[0], payload(0))
        assert writer.flush() and writer.stats["shared"].failures == 0
        reader = Tiers([RedisStore(server.url, server.password, tls_ca=certs["ca"])], SECRET, LAYOUT)
        assert reader.fetch(NAMES[:1]).result(10).payloads == [payload(0)]
        plain = Tiers([RedisStore(server.url.replace("rediss", "redis"), server.password, 0.3)], SECRET, LAYOUT)
        assert plain.fetch(NAMES[:1]).result(10).payloads == [] and plain.stats["shared"].failures == 1
        for t in (writer, reader, plain):
            t.close()
    finally:
        server.stop()


def test_the_int8_host_form_keeps_each_row_within_half_its_scale():
    import torch

    from cluster.kv.tiering import Int8Rows

    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 3, 4, 2, 16) * torch.rand(2, 3, 4, 2, 1) * 10).to(dtype)  # rows of unlike sizes
        codec = Int8Rows(dtype, 16)
        blob = codec.encode(x.contiguous().view(torch.uint8).numpy().tobytes())
        assert len(blob) == x.numel() // 16 * (16 + 4)  # an int8 value each, and a float32 scale a row
        back = torch.frombuffer(bytearray(codec.decode(blob)), dtype=torch.uint8).view(dtype).view_as(x).float()
        bound = x.float().abs().amax(-1, keepdim=True) / 127 / 2 + x.float().abs() * 2**-7  # rounding, then dtype's
        assert ((back - x.float()).abs() <= bound + 1e-6).all(), dtype


def test_tandem_profile_measures_each_configured_tiers_load_cost(tmp_path):
    from cluster.config import parse_config
    from planner.measure import _tiers
    from planner.profile import Profile, from_json, to_json

    demo = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
    tiers = {"host": {"gib": 0.01}, "disk": {"path": str(tmp_path / "kv"), "gib": 0.01}}
    config = parse_config({"model": {"path": str(demo)}, "cache": {"tiers": tiers}, "auth": {"cluster_secret": "s"}})
    costs, points = _tiers(config, 64 * 1024, quick=True)
    assert set(costs) == {"host", "disk"} and all(len(p) == 2 for p in points.values())
    assert all(c.at(64 * 1024) > 0 for c in costs.values())
    profile = Profile({}, {}, costs["host"], kv_bytes_per_token=4096, tiers=costs)
    assert profile.tier_load_s("disk", 16) == costs["disk"].at(16 * 16 * 4096)
    step = {"prefill": {"base_s": 0, "token_s": 1}, "decode": {"base_s": 0, "row_s": 1}}
    assert from_json({**to_json(profile), "costs": {"1": step}}).tiers == costs
