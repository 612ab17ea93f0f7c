"""The decode engine in a process of its own (`decode_worker.core.ProcessCore`): it streams what the
engine in this process streams, one frame per turn; its errors cross the pipe as the engine raises
them; an abort's blocks are free when the call returns; a core that dies takes its worker out of
service and its requests move; a client that reads nothing holds up neither the engine nor the
other streams. The demo model, real gRPC, no Ray."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from tandem.v1 import api_pb2, api_pb2_grpc

from cluster.config import parse_config
from cluster.engine.core_process import Outbox
from cluster.engine.request import SamplingParams
from decode_worker import service as decode_service
from decode_worker.core import ProcessCore
from decode_worker.engine_loop import Frame, build_engine
from decode_worker.text import BeamOutput, RequestOutput
from router.sdk.client import Client
from router.service.server import from_config
from tests.conftest import drive

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"

pytestmark = pytest.mark.slow
DEF_ADD = [481, 795, 10, 67, 14, 313, 307]  # "def add(a, b):" in the demo model's tokenizer


def config(**scheduler):
    return parse_config({
        "model": {"path": str(DEMO), "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": 256},
        "scheduler": scheduler,
        "router": {"local_prefill_max_tokens": 4096, "migration_limit": 3},
    })  # fmt: skip


class Frames:
    """Runs a core's frame reader on a thread, keeping every frame and each request's tokens."""

    def __init__(self, core: ProcessCore) -> None:
        self.core, self.frames, self.tokens, self.texts, self.finished = core, [], {}, {}, {}
        self.scored: dict[str, list] = {}  # each request's prompt logprobs
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=core.run, args=(self.take, self.stopped), daemon=True)
        self.thread.start()

    def take(self, frame: Frame) -> None:
        self.frames.append(frame)
        for out in frame.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.token_ids)
            self.texts[out.request_id] = self.texts.get(out.request_id, "") + out.text
            self.scored.setdefault(out.request_id, []).extend(out.prompt_logprobs)
            if out.finished:
                self.finished[out.request_id] = out

    def wait_for(self, ids, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not set(ids) <= set(self.finished):
            assert time.monotonic() < deadline, f"unfinished: {set(ids) - set(self.finished)}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def core():
    core = ProcessCore.spawn(config(), "decode-test")
    frames = Frames(core)
    yield core, frames
    frames.stopped.set()
    core.stop()
    frames.thread.join(10)
    assert not core.process.is_alive()


def requests() -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        "greedy": (list(range(10, 40)), SamplingParams(max_tokens=24, temperature=0.0)),
        "seeded": (list(range(50, 70)), SamplingParams(max_tokens=20, temperature=0.8, seed=7)),
        # "def add(a, b):", whose greedy output has "return" 15 tokens on, far from its length: the core
        # would step it on if the front's stop did not reach it
        "stop": (DEF_ADD, SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, stop=["return"])),
        "short": ([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0)),
        "scored": (list(range(80, 100)), SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)),
    }


def test_the_core_streams_what_the_engine_in_this_process_streams(core):
    """Tokens, text and finish reasons alike: the engine here cuts the text at a stop string itself;
    the core leaves that to its front, which drops what the core stepped past the stop."""
    core, frames = core
    engine = build_engine(config())
    texts: dict[str, str] = {}
    scored: list = []

    def seen(out) -> None:  # type: ignore[no-untyped-def]
        texts[out.request_id] = texts.get(out.request_id, "") + out.text
        scored.extend(out.prompt_logprobs)

    expected, finals = drive(engine, requests(), after_outputs=seen)
    assert finals["stop"].finish_reason == "stop" and texts["stop"].endswith('"""\n        '), "a stop string ends one"
    for rid, (prompt, params) in requests().items():
        core.add_request(rid, prompt, params)
    frames.wait_for(requests())
    assert {rid: frames.tokens[rid] for rid in requests()} == expected
    assert {rid: frames.texts[rid] for rid in requests()} == texts
    assert len(frames.scored["scored"]) == len(requests()["scored"][0]) - 1
    assert [t for t, _ in frames.scored["scored"]] == [t for t, _ in scored] == list(range(81, 100))
    for (_, (lp, top)), (_, (expected_lp, expected_top)) in zip(frames.scored["scored"], scored, strict=True):
        assert lp == pytest.approx(expected_lp, abs=1e-4) and [t for t, _ in top] == [t for t, _ in expected_top]
    assert {rid: out.finish_reason for rid, out in frames.finished.items() if rid in requests()} == {
        rid: out.finish_reason for rid, out in finals.items()
    }
    assert {rid: out.num_output_tokens for rid, out in frames.finished.items() if rid in requests()} == {
        rid: out.num_output_tokens for rid, out in finals.items()
    }
    assert sum(1 for f in frames.frames if f.outputs) <= core.steps, "one frame per step, never one per token"
    deadline = time.monotonic() + 5  # the stopped request's abort is not waited for: it lands with the next turn
    while core.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not core.has_unfinished, "the request a stop string ended runs no more in the core"
    # Watch's mirror holds what the core's cache holds: what the engine here holds, and at most one
    # block more (the core may step the stopped request once before its abort lands, filling a block)
    extra = core.kv_journal.held() - engine.kv_journal.held()
    assert engine.kv_journal.held() <= core.kv_journal.held() and len(extra) <= 1
    assert core.occupancy.free_blocks == core.occupancy.total_blocks == 256


def test_the_engines_errors_cross_the_pipe(core):
    core, _ = core
    with pytest.raises(ValueError, match="reach max_tokens"):
        core.add_request("done-already", [1, 2, 3, 4], SamplingParams(max_tokens=2), [9, 9])
    table, cached = core.reserve("moved", list(range(40)), SamplingParams(max_tokens=8))
    assert len(table) == 3 and cached >= 0
    with pytest.raises(KeyError, match="already in use"):
        core.reserve("moved", list(range(40)), SamplingParams(max_tokens=8))
    core.release("moved")
    assert core.occupancy.free_blocks == 256, "the release shows in the load when the call returns"
    assert core.abort("never-here") is False


def running(core: ProcessCore, frames: Frames, rid: str, prompt: list[int], tokens: int) -> None:
    """Starts a long greedy request and returns once its first `tokens` tokens have come."""
    core.add_request(rid, prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    deadline = time.monotonic() + 30
    while len(frames.tokens.get(rid, [])) < tokens:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_aborted_requests_blocks_are_free_when_the_abort_returns(core):
    core, frames = core
    running(core, frames, "long", list(range(10, 80)), 3)
    assert core.occupancy.free_blocks < 256
    assert core.abort("long") is True
    assert core.occupancy.free_blocks == 256 and core.occupancy.running == 0


def reference_tokens(prompts: list[str], max_tokens: int) -> list[list[int]]:
    worker = decode_service.from_config(config(engine_core="thread"), "reference")
    workers = {"reference": worker.start()}
    router = from_config(config(), lambda: workers)
    address = router.start()
    try:
        with Client(address, timeout=120) as client:
            return [client.generate(p, max_tokens=max_tokens, temperature=0.0).token_ids for p in prompts]
    finally:
        router.stop()
        worker.stop()


def test_a_core_that_dies_takes_its_worker_out_and_its_requests_move():
    prompts = [f"def f{i}(x):" for i in range(6)]
    expected = reference_tokens(prompts, 120)
    victim = decode_service.from_config(config(), "decode-0")
    other = decode_service.from_config(config(engine_core="thread"), "decode-1")
    fatal = threading.Event()
    victim.on_fatal = fatal.set
    workers = {"decode-0": victim.start(), "decode-1": other.start()}
    router = from_config(config(), lambda: workers)
    address = router.start()
    results: dict[int, list[int]] = {}
    try:
        with Client(address, timeout=120) as client:

            def run(i: int) -> None:
                results[i] = client.generate(prompts[i], max_tokens=120, temperature=0.0).token_ids

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while victim.engine.steps < 10:
                assert time.monotonic() < deadline, "decode-0 never got going"
                time.sleep(0.01)
            os.kill(victim.engine.process.pid, signal.SIGKILL)
            for t in threads:
                t.join(120)
        assert fatal.wait(10), "the worker calls its on_fatal when its core dies"
        assert [results[i] for i in range(len(prompts))] == expected
        assert router.telemetry.metrics.migrations.labels("decode")._value.get() >= 1
        assert victim.load().draining and not victim.engine.process.is_alive()
    finally:
        router.stop()
        victim.stop()
        other.stop()


def test_a_client_that_reads_nothing_holds_up_neither_the_engine_nor_the_other_streams():
    worker = decode_service.from_config(config(), "decode-0")
    workers = {"decode-0": worker.start()}
    router = from_config(config(), lambda: workers)
    address = router.start()
    channel = grpc.insecure_channel(address)
    try:
        held = api_pb2_grpc.TandemStub(channel).Generate(
            api_pb2.GenerateRequest(
                text="def held(x):", sampling=api_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
            ),
            timeout=120,
        )  # nothing read from it yet
        with Client(address, timeout=120) as client:
            started = time.monotonic()
            replies = [
                client.generate(f"def f{i}(x):", max_tokens=40, temperature=0.0, ignore_eos=True) for i in range(3)
            ]
            others_s = time.monotonic() - started
        assert all(len(r.token_ids) == 40 for r in replies), "the other streams ran to their end"
        deadline = time.monotonic() + 60
        while worker.engine.has_unfinished or worker.engine.occupancy.running:
            assert time.monotonic() < deadline, "the held client's request never finished in the engine"
            time.sleep(0.01)
        steps = worker.engine.steps
        tokens = [t for message in held for t in message.token_ids]  # read at last: every token, in order
        assert len(tokens) == 200
        assert worker.engine.steps == steps, "the engine had finished before the held client read a token"
        print(f"\nthree 40-token streams beside a held client: {others_s:.2f} s; engine steps {steps}")
    finally:
        channel.close()
        router.stop()
        worker.stop()


def test_a_stream_that_lags_sends_what_it_owes_in_one_message():
    from decode_worker.steps import EngineFailed, Outputs, tokens_message

    async def lagging() -> None:
        lp = (-0.5, [(1, -0.5)])
        outputs = Outputs()
        for n in range(1, 4):  # handed over from the frame reader's thread while the stream is busy
            out = RequestOutput("r", [10 + n], text=f"t{n}", logprobs=[lp], num_output_tokens=n)
            await asyncio.to_thread(outputs.put, out)
        last = RequestOutput("r", [14], "!", logprobs=[lp], finished=True, finish_reason="stop", num_output_tokens=4)
        await asyncio.to_thread(outputs.put, last)
        message = tokens_message(await outputs.next())
        assert list(message.token_ids) == [11, 12, 13, 14] and message.text == "t1t2t3!"
        assert len(message.logprobs) == 4 and message.finish_reason == api_pb2.FINISH_REASON_STOP

        outputs = Outputs()
        outputs.put(RequestOutput("r", [11], text="a"))
        outputs.put(RequestOutput("r", [12], text="b"))
        outputs.fail()  # the engine failed mid-request: what came before goes out, then the failure
        message = tokens_message(await outputs.next())
        assert list(message.token_ids) == [11, 12] and message.text == "ab" and not message.finish_reason
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(outputs.next(), 5)

    asyncio.run(lagging())


def test_the_frame_reader_never_waits_on_the_command_pipe(core):
    """A stop string's abort, asked for by the frame reader, returns while another thread holds the
    pipe (as a sender blocked on a full pipe would): were the reader to wait there while the core
    waits for it to read a frame, both would hang. The abort still lands once the pipe is free."""
    core, frames = core
    running(core, frames, "held", list(range(10, 60)), 2)
    with core._send_lock:  # the pipe is taken
        asked = threading.Thread(target=core.abort_soon, args=("held",), daemon=True)
        asked.start()
        asked.join(2)
        assert not asked.is_alive(), "the abort waited for the pipe"
    deadline = time.monotonic() + 10
    while core.occupancy.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.occupancy.running == 0 and core.occupancy.free_blocks == 256


class HeldPipe:
    """A pipe whose reader holds off until `release`, then takes everything; `closed`: it refuses."""

    def __init__(self) -> None:
        self.release, self.got, self.closed = threading.Event(), [], False

    def send(self, message: object) -> None:
        self.release.wait()
        if self.closed:
            raise OSError("the front closed the pipe")
        self.got.append(message)


def test_the_outbox_sends_in_order_beside_the_loop_and_a_front_behind_it_slows_the_loop():
    pipe = HeldPipe()
    outbox = Outbox(pipe, depth=2)
    for i in range(3):  # one in the sender's hands, two queued: the loop goes on at once
        outbox.send(i)
    blocked = threading.Thread(target=outbox.send, args=(3,), daemon=True)
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a full outbox holds the loop until the front reads"
    pipe.release.set()
    blocked.join(5)
    outbox.close()
    assert pipe.got == [0, 1, 2, 3]


def test_the_outbox_says_when_the_front_is_gone():
    pipe = HeldPipe()
    pipe.closed = True
    pipe.release.set()
    outbox = Outbox(pipe, depth=1)
    with pytest.raises(EOFError):
        for i in range(100):
            outbox.send(i)
            time.sleep(0.01)


class Refusing:
    """An engine's face to `EngineLoop`: `take` changes its load, `refuse` raises."""

    def __init__(self) -> None:
        from cluster.engine.changes import Changes, Occupancy
        from cluster.engine.kv_events import KVJournal

        self.changes, self.kv_journal, self.occupancy, self.has_unfinished = Changes(), KVJournal(), Occupancy(), False

    def take(self) -> None:
        self.changes.bump()

    def refuse(self) -> None:
        raise ValueError("refused")

    def take_first_tokens(self) -> list:  # type: ignore[type-arg]
        return []


def test_a_refused_submit_is_answered_before_any_frame_counts_it_taken():
    """A submit is answered only if it fails, and the front counts a call taken once a frame's `taken`
    reaches it: the frame sent ahead of a refusal (the load changed) must not count the refused call,
    or its front would drop the refusal and the request would never end."""
    import multiprocessing

    from decode_worker.engine_loop import EngineLoop

    commands_theirs, commands = multiprocessing.Pipe(duplex=False)
    events, events_theirs = multiprocessing.Pipe(duplex=False)
    loop = EngineLoop(Refusing(), commands_theirs, events_theirs)  # type: ignore[arg-type]
    commands.send(("take", 0, (), "errors"))
    commands.send(("refuse", 1, (), "errors"))
    assert loop._apply_commands()
    loop.outbox.close()
    messages = []
    while events.poll(0.5):
        messages.append(events.recv())
    reply = next(i for i, m in enumerate(messages) if isinstance(m, tuple) and m[0] == 1)
    assert not messages[reply][1] and "refused" in str(messages[reply][2])
    assert all(m.taken < 1 for m in messages[:reply] if isinstance(m, Frame)), messages


def test_a_frames_outputs_cross_the_pipe_as_columns_and_come_back_equal():
    outputs = [
        RequestOutput("plain", [7], num_prompt_tokens=20, num_output_tokens=3, num_passes=3),
        RequestOutput("done", [8, 9], finished=True, finish_reason="length", num_prompt_tokens=4,
                      num_cached_tokens=16, num_output_tokens=9, num_passes=5, num_draft_tokens=6,
                      num_accepted_tokens=4),
        RequestOutput("scored", [3], logprobs=[(-0.5, [(3, -0.5), (4, -1.5)])],
                      prompt_logprobs=[(11, (-2.0, [(12, -1.0)]))], text="x"),
        RequestOutput("beams", [1, 2], finished=True, finish_reason="stop",
                      beams=[BeamOutput([1, 2], "ab", -0.25, "stop")]),
    ]  # fmt: skip
    frame = Frame(outputs, steps=3, taken=7)
    assert pickle.loads(pickle.dumps(frame)) == frame
    assert pickle.loads(pickle.dumps(Frame())) == Frame()
