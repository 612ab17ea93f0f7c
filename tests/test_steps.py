"""A router's step stream on a decode worker (`Worker.Steps`): every request of the stream in one frame
per step, with the tokens Submit streams for it; refusals and failures as `RequestEnded` with Submit's
status; a cancel, and the stream's own end, free the blocks. The demo model, real gRPC, no Ray."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import grpc
import pytest
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

from cluster.config import parse_config
from decode_worker import service as decode_service

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
PROMPTS = [[481, 795, 10, 67, 14, 313, 307], [481, 1024, 10, 67], [40, 41, 42, 43, 44, 45], [481, 500]]


@pytest.fixture(scope="module", params=["thread", "process"])
def worker(request):
    config = parse_config({
        "model": {"path": str(DEMO), "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": 64},
        "scheduler": {"engine_core": request.param},
    })  # fmt: skip
    worker = decode_service.from_config(config, "decode-0")
    address = worker.start()
    channel = grpc.insecure_channel(address)
    yield worker, worker_pb2_grpc.WorkerStub(channel)
    channel.close()
    worker.stop()


class StepStream:
    """The router's side of a step stream: commands sent as they are put, frames read by the caller."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.commands: queue.Queue[worker_pb2.StepCommand | None] = queue.Queue()
        self.frames = stub.Steps(iter(self.commands.get, None), timeout=60)

    def submit(self, rid: str, prompt: list[int], max_tokens: int, **sampling) -> None:  # type: ignore[no-untyped-def]
        params = api_pb2.SamplingParams(
            **{"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, **sampling}
        )
        request = worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt, sampling=params)
        self.commands.put(worker_pb2.StepCommand(submit=request))

    def cancel(self, rid: str) -> None:
        self.commands.put(worker_pb2.StepCommand(cancel=rid))

    def until(self, done) -> list[worker_pb2.StepFrame]:  # type: ignore[no-untyped-def]
        frames = []
        for frame in self.frames:
            frames.append(frame)
            if done(frames):
                return frames
        raise AssertionError("the stream ended first")


def submitted_alone(stub: worker_pb2_grpc.WorkerStub, rid: str, prompt: list[int], max_tokens: int):  # type: ignore[no-untyped-def]
    params = api_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    messages = stub.Submit(worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt, sampling=params))
    messages = list(messages)
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages), messages[-1].finish_reason


def finished(frames: list[worker_pb2.StepFrame]) -> set[str]:
    return {t.request_id for f in frames for t in f.tokens if t.finish_reason} | {
        e.request_id for f in frames for e in f.ended
    }


def wait_idle(worker) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 5
    while True:
        o = worker.engine.occupancy
        if o.running == 0 and o.waiting == 0 and o.free_blocks == o.total_blocks:
            return
        assert time.monotonic() < deadline, f"blocks still held: {o}"
        time.sleep(0.02)


def test_one_frame_per_step_carries_every_request_with_submits_tokens(worker):
    worker, stub = worker
    stream = StepStream(stub)
    for i, prompt in enumerate(PROMPTS):
        stream.submit(f"s{i}", prompt, 12)
    frames = stream.until(lambda fs: finished(fs) >= {f"s{i}" for i in range(len(PROMPTS))})
    stream.commands.put(None)
    for i, prompt in enumerate(PROMPTS):
        entries = [t for f in frames for t in f.tokens if t.request_id == f"s{i}"]
        tokens = [t for e in entries for t in e.token_ids]
        text = "".join(e.text for e in entries)
        assert (tokens, text, entries[-1].finish_reason) == submitted_alone(stub, f"alone{i}", prompt, 12)
        assert not any(e.finish_reason for e in entries[:-1]), "the last entry alone finishes it"
    assert max(len(f.tokens) for f in frames) == len(PROMPTS), "a step's frame carries every request of it"
    assert len(frames) < sum(len(f.tokens) for f in frames), "fewer frames than entries"
    wait_idle(worker)


def test_refusals_end_with_submits_status_and_a_cancel_frees_the_blocks(worker):
    worker, stub = worker
    stream = StepStream(stub)
    stream.submit("long", PROMPTS[0], 400)
    stream.submit("bad", PROMPTS[1], 8, temperature=-1.0)
    stream.submit("long", PROMPTS[1], 8)  # the same id again
    stream.submit("too-long", PROMPTS[1], 1024 - len(PROMPTS[1]) + 1)  # past the model's context: the engine says so
    frames = stream.until(lambda fs: sum(len(f.ended) for f in fs) >= 3)
    ended = {(e.request_id, e.code, e.details) for f in frames for e in f.ended}
    assert {(rid, code) for rid, code, _ in ended} == {
        ("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
        ("long", grpc.StatusCode.ALREADY_EXISTS.value[0]),  # the first 'long' runs on
        ("too-long", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
    }, ended
    assert any("sampling" in details for rid, _, details in ended if rid == "bad")
    assert any("max_tokens" in details for rid, _, details in ended if rid == "too-long")
    stream.until(lambda fs: any(t.request_id == "long" for f in fs for t in f.tokens))  # the first 'long' runs on
    stream.cancel("long")
    wait_idle(worker)
    stream.commands.put(None)


def test_the_streams_end_aborts_every_request_on_it(worker):
    worker, stub = worker
    stream = StepStream(stub)
    stream.submit("a", PROMPTS[0], 400)
    stream.submit("b", PROMPTS[2], 400)
    stream.until(lambda fs: {t.request_id for f in fs for t in f.tokens} == {"a", "b"})
    stream.frames.cancel()  # the router went away
    wait_idle(worker)


def test_a_command_with_neither_submit_nor_cancel_ends_the_stream_with_invalid_argument(worker):
    worker, stub = worker
    stream = StepStream(stub)
    stream.submit("a", PROMPTS[0], 400)
    stream.until(lambda fs: any(t.request_id == "a" for f in fs for t in f.tokens))
    stream.commands.put(worker_pb2.StepCommand())
    with pytest.raises(grpc.RpcError) as ended:
        stream.until(lambda fs: False)
    assert ended.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "neither" in ended.value.details()
    wait_idle(worker)  # its request went with it
