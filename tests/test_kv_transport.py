"""One conformance suite for every KV transport (and an in-memory wire fake): round trip, wrong
fingerprint, corrupted chunk, a sender that dies mid-stream, a duplicate request id, no room.
After every case the decode worker's block manager checks out and holds no leaked block."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch
from tandem.v1 import kv_transfer_pb2 as pb

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.request import SamplingParams
from cluster.kv.collective import CollectiveGroups
from cluster.kv.framing import deserialize, serialize
from cluster.kv.grpc_transport import CollectiveSender, GrpcSender, serve
from cluster.kv.transport import KVReceiver, LocalSender, SendStream, TransferState
from cluster.kv.wire import (
    KVChunk,
    KVCommit,
    KVHeader,
    WireChunk,
    decode_chunk,
    decode_commit,
    decode_header,
    encode,
    make_chunk,
    model_fingerprint,
)
from cluster.model.attention import quantize_rows
from cluster.model.loader import load_model
from decode_worker.engine import Engine
from decode_worker.kv_intake import KVIntake

TIMEOUT_S = 1.0
CACHE = CacheConfig(block_size=4, num_blocks=40, watermark=0.0)


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


class WireFake:
    """Every message through its protobuf bytes and back, in memory: the wire format on its own."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    def open(self, header: KVHeader) -> SendStream:
        return _WireStream(self.receiver, header)


class _WireStream(SendStream):
    def __init__(self, receiver: KVReceiver, header: KVHeader) -> None:
        self.receiver = receiver
        super().__init__(header)

    def _run(self) -> int:
        transfer = header = None
        for message in self._messages():
            m = pb.KVTransferMessage.FromString(encode(message).SerializeToString())
            if m.HasField("header"):
                header = decode_header(m.header)
                transfer = self.receiver.reserve(header)
            elif m.HasField("chunk"):
                self.receiver.write(transfer, decode_chunk(m.chunk, header))
            else:
                return self.receiver.commit(transfer, decode_commit(m.commit))
        raise AssertionError("stream ended without a commit")


@pytest.fixture(scope="module")
def model(hf_models):
    return load_model(hf_models["llama"][0], "float32")


TRANSPORTS = ["fake", "local", "grpc", "collective"]


@pytest.fixture(params=TRANSPORTS)
def link(request, model):
    """(sender, decode engine, intake) with the decode side served over the transport."""
    yield from serve_link(request.param, model, CACHE)


@pytest.fixture(params=TRANSPORTS)
def int8_link(request, model):
    """The same, for a decode worker whose KV cache is int8."""
    yield from serve_link(request.param, model, CACHE.model_copy(update={"kv_dtype": "int8"}))


def serve_link(kind: str, model, cache: CacheConfig):  # type: ignore[no-untyped-def]
    engine = Engine(model, NoText(), cache, SchedulerConfig(max_num_seqs=8))
    intake = KVIntake(engine, model_fingerprint(model, model.arch), timeout_s=TIMEOUT_S)
    intake.start(interval_s=0.05)
    closers = [intake.close]
    if kind == "fake":
        sender = WireFake(intake)
    elif kind == "local":
        sender = LocalSender(intake)
    else:
        groups = CollectiveGroups("cpu", timeout_s=5.0)
        server, port = serve(intake, groups=groups)
        closers += [lambda: server.stop(None), groups.close]
        if kind == "grpc":
            sender = GrpcSender(f"127.0.0.1:{port}", timeout_s=10.0)
        else:
            sender_groups = CollectiveGroups("cpu", timeout_s=5.0)
            sender = CollectiveSender(f"127.0.0.1:{port}", sender_groups, timeout_s=10.0)
            closers.append(sender_groups.close)
        closers.append(sender.close)
    yield sender, engine, intake
    for close in reversed(closers):
        close()


def header_for(model, request_id: str, num_tokens: int, **changes) -> KVHeader:
    arch = model.arch
    header = KVHeader(
        request_id=request_id,
        fingerprint=model_fingerprint(model, arch),
        dtype="float32",
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        block_size=16,  # the wire carries positions, so the sender's block size need not match
        token_ids=tuple(range(3, 3 + num_tokens)),
        sampling=SamplingParams(max_tokens=8, temperature=0.0),
    )
    return dataclasses.replace(header, **changes)


def random_kv(header: KVHeader, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random keys and values per layer in the header's dtype (int8: quantised rows with their scales)."""
    g = torch.Generator().manual_seed(seed)
    shape = (header.num_tokens, header.num_kv_heads, header.head_dim)
    make = (lambda: quantize_rows(torch.randn(shape, generator=g))) if header.dtype == "int8" else None
    make = make or (lambda: torch.randn(shape, generator=g))
    return [(make(), make()) for _ in range(header.num_layers)]


def chunks(kv) -> list[KVChunk]:
    return [make_chunk(i, k[None], v[None]) for i, (k, v) in enumerate(kv)]


def assert_clean(engine: Engine, intake: KVIntake) -> None:
    blocks = engine.scheduler.blocks
    blocks.check_integrity()
    assert intake.in_flight == 0
    assert blocks.num_free_blocks == blocks.num_blocks, "a KV block leaked"


def expect_failure(stream: SendStream, code: grpc.StatusCode) -> None:
    assert stream.wait(15) is TransferState.FAILED
    assert stream.error is not None and stream.error.code == code, stream.error


def test_round_trip_is_bit_identical(link, model):
    sender, engine, intake = link
    header = header_for(model, "r1", 37)
    kv = random_kv(header)
    stream = sender.open(header)
    for chunk in chunks(kv):
        stream.send(chunk)
    stream.commit(first_token=11)
    assert stream.wait(15) is TransferState.DONE, stream.error
    table = engine.scheduler.blocks.block_table("r1")
    assert stream.num_blocks == len(table) == 10
    for layer, (k, v) in enumerate(kv):
        k_cache, v_cache = engine.kv_cache[layer]
        got_k = k_cache[table].flatten(0, 1)[: header.num_tokens]
        got_v = v_cache[table].flatten(0, 1)[: header.num_tokens]
        assert torch.equal(got_k, k) and torch.equal(got_v, v), f"layer {layer}"
    first, second = engine.step()  # the first token comes out with the next step, which decodes the second
    assert first.request_id == second.request_id == "r1" and first.token_ids == [11] and not first.finished
    assert engine.abort("r1")
    assert_clean(engine, intake)


def test_int8_kv_round_trips_bit_for_bit(int8_link, model):
    sender, engine, intake = int8_link
    header = header_for(model, "q1", 29, dtype="int8")
    kv = random_kv(header)
    assert kv[0][0].dtype == torch.uint8 and kv[0][0].shape[-1] == model.arch.head_dim + 4
    stream = sender.open(header)
    for chunk in chunks(kv):
        stream.send(chunk)
    stream.commit(first_token=7)
    assert stream.wait(15) is TransferState.DONE, stream.error
    table = engine.scheduler.blocks.block_table("q1")
    for layer, (k, v) in enumerate(kv):
        k_cache, v_cache = engine.kv_cache[layer]
        assert torch.equal(k_cache[table].flatten(0, 1)[:29], k) and torch.equal(v_cache[table].flatten(0, 1)[:29], v)
    assert engine.abort("q1")
    assert_clean(engine, intake)
    stream = sender.open(header_for(model, "q2", 9))  # float32 KV for an int8 cache: refused whole
    stream.commit(1)
    expect_failure(stream, grpc.StatusCode.FAILED_PRECONDITION)
    assert_clean(engine, intake)


def test_int8_kv_to_a_float_cache_is_refused(link, model):
    sender, engine, intake = link
    header = header_for(model, "q3", 9, dtype="int8")
    stream = sender.open(header)
    for chunk in chunks(random_kv(header)):
        stream.send(chunk)
    stream.commit(1)
    expect_failure(stream, grpc.StatusCode.FAILED_PRECONDITION)
    assert_clean(engine, intake)


def test_wrong_fingerprint_is_refused(link, model):
    sender, engine, intake = link
    stream = sender.open(header_for(model, "r2", 9, fingerprint=b"another model"))
    for chunk in chunks(random_kv(header_for(model, "r2", 9))):
        stream.send(chunk)
    stream.commit(1)
    expect_failure(stream, grpc.StatusCode.FAILED_PRECONDITION)
    assert_clean(engine, intake)


def test_corrupted_chunk_is_data_loss(link, model):
    sender, engine, intake = link
    header = header_for(model, "r3", 21)
    good = chunks(random_kv(header))
    key = good[1].key.clone()
    key.view(-1)[5] += 1.0  # a flipped value after the checksum was taken
    stream = sender.open(header)
    stream.send(good[0])
    stream.send(KVChunk(1, key, good[1].value, good[1].checksum))
    stream.commit(1)
    expect_failure(stream, grpc.StatusCode.DATA_LOSS)
    assert_clean(engine, intake)


def test_sender_dying_mid_stream_frees_blocks_within_the_timeout(link, model):
    sender, engine, intake = link
    header = header_for(model, "r4", 30)
    stream = sender.open(header)
    stream.send(chunks(random_kv(header))[0])
    blocks = engine.scheduler.blocks
    start = time.monotonic()
    while blocks.num_free_blocks == blocks.num_blocks and time.monotonic() - start < 5:
        time.sleep(0.01)  # wait for the reservation to land
    assert blocks.num_free_blocks < blocks.num_blocks, "the header should have reserved blocks"
    reserved_at = time.monotonic()
    # The sender now goes silent: no more chunks, no commit, no goodbye.
    while blocks.num_free_blocks < blocks.num_blocks and time.monotonic() - reserved_at < TIMEOUT_S + 3:
        time.sleep(0.02)
    freed_after = time.monotonic() - reserved_at
    assert_clean(engine, intake)
    assert freed_after <= TIMEOUT_S + 0.5
    stream.abort()
    assert stream.wait(15) is TransferState.FAILED


def test_a_worker_shutting_down_mid_transfer_answers_its_sender_unavailable(link, model):
    """The sender learns why its transfer ended (the worker is going away: another worker may take
    the request), not a timeout the router would give up on."""
    sender, engine, intake = link
    header = header_for(model, "r9", 30)
    stream = sender.open(header)
    kv = chunks(random_kv(header))
    stream.send(kv[0])
    blocks = engine.scheduler.blocks
    start = time.monotonic()
    while blocks.num_free_blocks == blocks.num_blocks and time.monotonic() - start < 5:
        time.sleep(0.01)  # wait for the reservation to land
    assert blocks.num_free_blocks < blocks.num_blocks, "the header should have reserved blocks"
    intake.close()
    for chunk in kv[1:]:
        stream.send(chunk)
    stream.commit(1)
    expect_failure(stream, grpc.StatusCode.UNAVAILABLE)
    assert "shutting down" in stream.error.message, stream.error
    assert_clean(engine, intake)


def test_duplicate_request_id_is_refused_and_the_first_transfer_survives(link, model):
    sender, engine, intake = link
    header = header_for(model, "r5", 13)
    kv = chunks(random_kv(header))
    first = sender.open(header)
    first.send(kv[0])
    start = time.monotonic()
    while intake.in_flight == 0 and time.monotonic() - start < 5:
        time.sleep(0.01)
    second = sender.open(header)
    second.commit(1)
    expect_failure(second, grpc.StatusCode.ALREADY_EXISTS)
    for chunk in kv[1:]:
        first.send(chunk)
    first.commit(2)
    assert first.wait(15) is TransferState.DONE, first.error
    engine.step()
    assert engine.abort("r5")
    assert_clean(engine, intake)


def test_no_room_now_queues_the_sequence_to_be_prefilled_here(link, model):
    """A full worker takes the request rather than refuse it: the chunks are dropped, and the
    sequence waits in its queue until room frees, then is prefilled here."""
    sender, engine, intake = link
    size = CACHE.num_blocks * CACHE.block_size - 8  # fits an empty cache, not one holding "busy"
    header = header_for(model, "r6", size, token_ids=(7,) * size, sampling=SamplingParams(max_tokens=4))
    busy = sender.open(header_for(model, "busy", 20))
    for chunk in chunks(random_kv(header_for(model, "busy", 20))):
        busy.send(chunk)
    busy.commit(1)
    assert busy.wait(15) is TransferState.DONE, busy.error
    stream = sender.open(header)
    for chunk in chunks(random_kv(header)):
        stream.send(chunk)
    stream.commit(1)
    assert stream.wait(15) is TransferState.DONE, stream.error
    assert stream.num_blocks == 0 and intake.prefilled_here == 1
    assert [r.request_id for r in engine.scheduler.waiting] == ["r6"]
    engine.step()
    assert engine.abort("busy")
    outputs = [o for _ in range(3) for o in engine.step() if o.request_id == "r6"]
    assert outputs and outputs[0].token_ids, "prefilled here once room freed"
    assert engine.abort("r6")
    assert_clean(engine, intake)


def test_token_ids_outside_the_vocabulary_are_refused(model):
    engine = Engine(model, NoText(), CACHE, SchedulerConfig())
    intake = KVIntake(engine, model_fingerprint(model, model.arch))
    stream = LocalSender(intake).open(header_for(model, "r8", 3, token_ids=(1, 2, model.arch.vocab_size)))
    stream.commit(1)
    expect_failure(stream, grpc.StatusCode.INVALID_ARGUMENT)
    assert_clean(engine, intake)


def test_commit_before_every_layer_is_data_loss(model):
    engine = Engine(model, NoText(), CACHE, SchedulerConfig())
    intake = KVIntake(engine, model_fingerprint(model, model.arch))
    header = header_for(model, "r7", 5)
    stream = LocalSender(intake).open(header)
    stream.send(chunks(random_kv(header))[0])
    stream.commit(1)
    expect_failure(stream, grpc.StatusCode.DATA_LOSS)
    assert_clean(engine, intake)


def test_wire_messages_round_trip(model):
    header = header_for(model, "w", 6, capability=b"cap", sampling=SamplingParams(max_tokens=3, seed=9, stop=("x",)))
    assert decode_header(encode(header).header) == header
    chunk = chunks(random_kv(header))[1]
    back = decode_chunk(encode(chunk).chunk, header)
    assert back.layer_start == 1 and back.checksum == chunk.checksum and torch.equal(back.key, chunk.key)
    assert encode(KVCommit(5)).commit.first_token == 5
    future = encode(header)
    future.header.format_version = 99
    with pytest.raises(Exception, match="wire format 99"):
        decode_header(future.header)


@pytest.mark.parametrize("layer_start", [0, 1])
def test_fast_chunk_framing_is_protobuf(model, layer_start):
    header = header_for(model, "f", 7)
    chunk = chunks(random_kv(header))[layer_start]
    for inline in (True, False):
        data = serialize(chunk, inline)
        assert data == encode(chunk, inline).SerializeToString()  # byte for byte what protobuf writes
        parsed = deserialize(data)
        assert isinstance(parsed, WireChunk) and parsed.checksum == chunk.checksum
        assert parsed.layer_start == layer_start and parsed.layer_count == 1
    back = decode_chunk(deserialize(serialize(chunk)), header)
    assert torch.equal(back.key, chunk.key) and torch.equal(back.value, chunk.value)
    # Fields in another order (another protobuf writer may do that) still parse.
    m = encode(chunk).chunk
    reordered = (
        pb.KVChunk(checksum=m.checksum, value=m.value).SerializeToString()
        + pb.KVChunk(key=m.key, layer_count=1, layer_start=layer_start).SerializeToString()
    )
    outer = pb.KVTransferMessage()
    outer.chunk.ParseFromString(reordered)
    assert decode_chunk(deserialize(outer.SerializeToString()), header).checksum == chunk.checksum
    assert isinstance(deserialize(serialize(header)), pb.KVHeader)
    assert deserialize(serialize(KVCommit(3))).first_token == 3
    with pytest.raises(Exception, match="malformed"):
        deserialize(data[:-3] if len(data) > 3 else b"\x12\x50")


def test_cancelled_grpc_stream_frees_blocks_at_once(model):
    engine = Engine(model, NoText(), CACHE, SchedulerConfig())
    intake = KVIntake(engine, model_fingerprint(model, model.arch), timeout_s=60)  # no reaper: cancel alone frees
    server, port = serve(intake)
    sender = GrpcSender(f"127.0.0.1:{port}")
    try:
        header = header_for(model, "c1", 25)
        stream = sender.open(header)
        stream.send(chunks(random_kv(header))[0])
        start = time.monotonic()
        while intake.in_flight == 0 and time.monotonic() - start < 5:
            time.sleep(0.01)
        stream.abort()  # the call is cancelled, as when the sending process dies
        assert stream.wait(10) is TransferState.FAILED
        while intake.in_flight and time.monotonic() - start < 5:
            time.sleep(0.01)
        assert_clean(engine, intake)
    finally:
        sender.close()
        server.stop(None)


def test_collective_groups_are_capped_and_rebuilt_after_a_peer_goes_away(model):
    engine = Engine(model, NoText(), CACHE, SchedulerConfig())
    intake = KVIntake(engine, model_fingerprint(model, model.arch), timeout_s=5)
    receiver_groups = CollectiveGroups("cpu", timeout_s=5, max_groups=2)
    server, port = serve(intake, groups=receiver_groups)
    senders = [CollectiveGroups("cpu", timeout_s=5) for _ in range(3)]
    try:
        for i, groups in enumerate(senders):  # three prefill workers, room for two groups
            sender = CollectiveSender(f"127.0.0.1:{port}", groups)
            header = header_for(model, f"g{i}", 9)
            stream = sender.open(header)
            for chunk in chunks(random_kv(header)):
                stream.send(chunk)
            stream.commit(1)
            assert stream.wait(15) is TransferState.DONE, stream.error
            assert engine.abort(header.request_id)
        assert len(receiver_groups) == 2, "the least recently used group was torn down"
        # The first prefill worker's group is gone on the far side: its next transfer fails
        # (the receiver no longer knows the group), it drops its end, and the one after rebuilds.
        sender = CollectiveSender(f"127.0.0.1:{port}", senders[0])
        header = header_for(model, "again", 9)
        stream = sender.open(header)
        for chunk in chunks(random_kv(header)):
            stream.send(chunk)
        stream.commit(1)
        assert stream.wait(15) is TransferState.FAILED
        start = time.monotonic()  # the sender saw its group break; the receiver sees the call end just after
        while intake.in_flight and time.monotonic() - start < 5:
            time.sleep(0.01)
        assert_clean(engine, intake)
        assert len(senders[0]) == 0
        retry = sender.open(header)
        for chunk in chunks(random_kv(header)):
            retry.send(chunk)
        retry.commit(1)
        assert retry.wait(15) is TransferState.DONE, retry.error
        assert engine.abort("again")
        assert_clean(engine, intake)
    finally:
        server.stop(None)
        for groups in [receiver_groups, *senders]:
            groups.close()
