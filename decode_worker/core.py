"""The decode engine's core: the one thread that steps it, and how the worker's front reaches it.

    ThreadCore(engine)          the engine in the worker's own process, stepped by a thread of its own
    ProcessCore.spawn(config)   the engine in a process of its own (what a served worker runs): one
                                thread stepping it in a busy loop, taking commands between steps and
                                sleeping only when idle; no gRPC, no server threads, no GIL shared
                                with the front

Either hands the front one `Frame` per step: every request's new outputs, the load after the step
and what the prefix cache stored and evicted. The front (`decode_worker.service`) routes the outputs
to their streams and feeds Watch from the frames; it never polls the engine. Both take the same
calls (`add_request`, `abort`, and the KV intake's `reserve`, `release`, `admit`), which raise
what the engine raises.

In a process of its own the engine's paged KV cache lives in shared memory: the front's KV intake
writes received layers straight into the blocks the core reserved, with no copy of the bytes across
the process boundary (on a GPU the same tensors are CUDA IPC handles; see docs/engine.md). The core
exits when its front's end of the pipe closes (the worker died); the front, seeing the core's end
close, fails every stream and calls `on_exit`: the worker stops serving and calls its `on_fatal`
(a Ray actor's process exits, so Ray restarts it; the routers have moved its requests).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing  # noqa: F401  (its reductions send the shared KV cache over the pipe)

from cluster.config import ClusterConfig, SchedulerConfig, dump_config
from cluster.engine.changes import Changes, Occupancy
from cluster.engine.kv_events import KVBatch, KVJournal
from cluster.model.arch import ModelArch
from decode_worker.engine import Engine, RequestOutput

log = logging.getLogger(__name__)

# An idle core sleeps on its commands; it wakes this often anyway (the front's watchdog sees it alive).
IDLE_WAKE_S = 0.5


@dataclass
class Frame:
    """What one turn of the engine loop tells its front: the step's outputs (none for a turn that
    only applied commands), the load after it, the prefix cache's events since the last frame, and
    whether work remains. `failed` carries a step's error: every request in flight has lost its step."""

    outputs: list[RequestOutput] = field(default_factory=list)
    occupancy: Occupancy = field(default_factory=Occupancy)
    kv: KVBatch | None = None
    busy: bool = False
    failed: str | None = None
    steps: int = 0  # the engine's steps so far


OnFrame = Callable[[Frame], None]


@dataclass(frozen=True)
class CoreInfo:
    """What the front needs to know of the engine once: the model's shape, the KV cache's (the
    tensors themselves in shared memory), and the batching limits."""

    arch: ModelArch
    block_size: int
    kv_cache: list[tuple[Any, Any]]
    fingerprint: bytes = b""
    occupancy: Occupancy = field(default_factory=Occupancy)  # the load before any request


class ThreadCore:
    """The engine in this process: its calls go straight to it, and `run` steps it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.info = CoreInfo(engine.runner.model.arch, engine.scheduler.blocks.block_size, engine.kv_cache)
        self.scheduler_config = engine.scheduler.config
        self.kv_journal = engine.kv_journal
        self.changes = engine.changes
        self.steps = 0

    @property
    def occupancy(self) -> Occupancy:
        return self.engine.occupancy

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    def stop(self) -> None:
        """Nothing of its own to stop: `run` ends when its `stopped` is set."""

    def add_request(self, *args: Any) -> None:
        self.engine.add_request(*args)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def reserve(self, *args: Any) -> tuple[list[int], int]:
        return self.engine.reserve(*args)

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    def admit(self, *args: Any) -> None:
        self.engine.admit(*args)

    def run(self, on_frame: OnFrame, stopped: threading.Event) -> None:
        """Steps the engine while it has work, sleeping until it changes when it has none, until
        `stopped` is set (bump `changes` after setting it)."""
        engine = self.engine
        while not stopped.is_set():
            seen = engine.changes.version  # read first: a change from here on wakes the wait below
            if not engine.has_unfinished:  # asleep until a request, an admission or an abort arrives
                engine.changes.wait(seen, IDLE_WAKE_S)
                on_frame(Frame(occupancy=engine.occupancy))  # a turn: the watchdog sees the loop alive
                continue
            try:
                outputs = engine.step()
            except Exception:
                log.exception("the decode engine's step failed")
                on_frame(Frame(occupancy=engine.occupancy, busy=True, failed=traceback.format_exc(limit=3)))
                stopped.wait(0.1)
                continue
            self.steps += 1
            on_frame(Frame(outputs, engine.occupancy, None, engine.has_unfinished, steps=self.steps))


class CoreDied(RuntimeError):
    """The engine core process is gone: nothing it held can be reached."""


class ProcessCore:
    """The engine in a child process; this object is its front's handle. Calls are round trips on
    a pipe (the core takes commands between steps, never mid-step); `run` reads the frames, keeping
    the load, the change counter and a mirror of the prefix cache's journal for Watch."""

    def __init__(
        self, process: multiprocessing.process.BaseProcess, commands, events, info: CoreInfo,
        scheduler_config: SchedulerConfig,
    ) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
        self.process, self.info, self.scheduler_config = process, info, scheduler_config
        self.kv_journal = KVJournal()  # the core's journal, replayed from the frames
        self.changes = Changes()
        self.occupancy = info.occupancy
        self.has_unfinished = False
        self.steps = 0  # the core's steps, as of its last frame
        # The core died (it was not stopped): the worker's own `on_fatal` follows.
        self.on_exit: Callable[[], None] = lambda: None
        self._commands, self._events = commands, events
        self._send_lock = threading.Lock()
        self._calls: dict[int, tuple[threading.Event, list]] = {}
        self._ids = itertools.count()
        self._stopping = False

    @classmethod
    def spawn(cls, config: ClusterConfig, worker_id: str, timeout_s: float = 600.0) -> ProcessCore:
        """Starts the core for `config` and waits until its engine is built and warmed up."""
        ctx = multiprocessing.get_context("spawn")  # never fork: the front holds gRPC's and torch's threads
        commands_theirs, commands = ctx.Pipe(duplex=False)
        events, events_theirs = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_core_main, args=(commands_theirs, events_theirs, dump_config(config)), name=f"{worker_id}-core",
            daemon=True,
        )  # fmt: skip
        process.start()
        commands_theirs.close()
        events_theirs.close()
        if not events.poll(timeout_s):
            process.kill()
            raise CoreDied(f"the engine core did not start within {timeout_s:g} s")
        try:
            hello = events.recv()
        except EOFError:
            process.join(5)
            raise CoreDied(f"the engine core exited while starting (exit code {process.exitcode})") from None
        if isinstance(hello, BaseException):
            process.join(5)
            raise hello
        return cls(process, commands, events, hello, config.scheduler)

    def run(self, on_frame: OnFrame, stopped: threading.Event) -> None:
        """Reads the core's frames and replies until its pipe closes (`stop`, or its death)."""
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Frame):
                self._take(message)
                on_frame(message)
            else:
                call_id, ok, value = message
                waiting = self._calls.get(call_id)
                if waiting is not None:
                    waiting[1].append((ok, value))
                    waiting[0].set()
        for done, result in list(self._calls.values()):  # calls in flight get the news
            result.append((False, CoreDied("the engine core process is gone")))
            done.set()
        if not (self._stopping or stopped.is_set()):
            log.error("the engine core process died (exit code %s)", self.process.exitcode)
            on_frame(Frame(occupancy=self.occupancy, failed="the engine core process died"))
            self.on_exit()

    def stop(self) -> None:
        self._stopping = True
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._commands.send(("stop", -1, ()))
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def add_request(self, *args: Any) -> None:
        self._call("add_request", args)

    def abort(self, request_id: str) -> bool:
        return self._call("abort", (request_id,))

    def reserve(self, *args: Any) -> tuple[list[int], int]:
        return self._call("reserve", args)

    def release(self, request_id: str) -> None:
        self._call("release", (request_id,))

    def admit(self, *args: Any) -> None:
        self._call("admit", args)

    def _call(self, method: str, args: tuple) -> Any:
        call_id = next(self._ids)
        done, result = threading.Event(), []
        self._calls[call_id] = (done, result)
        try:
            with self._send_lock:
                try:
                    self._commands.send((method, call_id, args))
                except (OSError, ValueError):
                    raise CoreDied("the engine core process is gone") from None
            done.wait()
        finally:
            self._calls.pop(call_id, None)
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def _take(self, frame: Frame) -> None:
        self.occupancy, self.has_unfinished, self.steps = frame.occupancy, frame.busy, frame.steps
        if frame.kv is not None:
            replay(self.kv_journal, frame.kv)
        self.changes.bump()


def replay(journal: KVJournal, batch: KVBatch) -> None:
    """Applies another journal's batch to `journal`, which then holds what that one holds."""
    if batch.snapshot:
        for block_hash in journal.held() - set(batch.stored):
            journal.removed(block_hash)
        held = journal.held()
        for block_hash in batch.stored:
            if block_hash not in held:
                journal.stored(block_hash)
        return
    for block_hash in batch.removed:
        journal.removed(block_hash)
    for block_hash in batch.stored:
        journal.stored(block_hash)


# -- in the core process -----------------------------------------------------------------------------


def build_engine(config: ClusterConfig, shared: bool = False) -> Engine:
    """The decode engine for the config's model, cache and batching, warmed up. `shared`: its KV
    cache in shared memory, for a front in another process to write transfers into."""
    # Here, not above: the front's KV intake imports this module, and a GPU check's process that has
    # neither OpenTelemetry (the worker shell's) nor a tokenizer's grammar library imports the intake.
    from cluster.engine.speculative import build_proposer
    from cluster.engine.structured import for_tokenizer
    from cluster.worker_shell import load_model_and_tokenizer

    m = config.model
    model, tokenizer = load_model_and_tokenizer(m)
    spec = config.speculative
    proposer = build_proposer(spec, model, config.cache.block_size, m.seed, m.compile_buckets)
    engine = Engine(
        model, tokenizer, config.cache, config.scheduler, tokenizer.eos_token_ids, m.max_model_len, seed=m.seed,
        compile_buckets=m.compile_buckets, proposer=proposer, num_speculative_tokens=spec.num_tokens,
        grammars=for_tokenizer(tokenizer, model.arch.vocab_size, tokenizer.eos_token_ids), shared_kv=shared,
    )  # fmt: skip
    engine.warm_up()
    return engine


def _core_main(commands, events, config_json: str) -> None:  # type: ignore[no-untyped-def]
    try:
        from cluster.kv.wire import model_fingerprint

        config = ClusterConfig.model_validate_json(config_json)
        engine = build_engine(config, shared=True)
        model = engine.runner.model
        fingerprint = model_fingerprint(model, model.arch)
        info = CoreInfo(model.arch, config.cache.block_size, engine.kv_cache, fingerprint, engine.occupancy)
    except BaseException as e:  # the front raises it: a bad model or config fails the worker's start
        events.send(RuntimeError(f"the engine core failed to start: {e!r}"))
        raise
    events.send(info)
    EngineLoop(engine, commands, events).run()


class EngineLoop:
    """The core's one thread: commands between steps, a frame after each turn that changed anything."""

    def __init__(self, engine: Engine, commands, events) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.commands, self.events = engine, commands, events
        self.cursor: int | None = None  # the journal's events the front has
        self.sent = engine.changes.version  # the change count the last frame (or the hello) told
        self.steps = 0

    def run(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished
            try:
                if self.commands.poll(IDLE_WAKE_S if idle else 0) and not self._apply_commands():
                    return
            except (EOFError, OSError):
                return  # the front is gone
            outputs: list[RequestOutput] = []
            failed = None
            if engine.has_unfinished:
                try:
                    outputs = engine.step()
                    self.steps += 1
                except Exception:
                    log.exception("the decode engine's step failed")
                    failed = traceback.format_exc(limit=3)
            if outputs or failed or engine.changes.version != self.sent:
                self._send_frame(outputs, failed)

    def _send_frame(self, outputs: list[RequestOutput], failed: str | None = None) -> None:
        engine = self.engine
        self.sent = engine.changes.version
        batch = engine.kv_journal.since(self.cursor)
        if batch is not None:
            self.cursor = batch.last
        self.events.send(Frame(outputs, engine.occupancy, batch, engine.has_unfinished, failed, self.steps))

    def _apply_commands(self) -> bool:
        """Every command waiting; False on `stop`."""
        while self.commands.poll(0):
            method, call_id, args = self.commands.recv()
            if method == "stop":
                return False
            try:
                reply = (call_id, True, getattr(self.engine, method)(*args))
            except Exception as e:
                reply = (call_id, False, _picklable(e))
            if self.engine.changes.version != self.sent:
                self._send_frame([])  # first: a call returns once its front's load shows what it changed
            self.events.send(reply)
        return True


def _picklable(e: Exception) -> Exception:
    """`e` itself when it crosses the pipe (the engine's KeyError, ValueError, MemoryError do)."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(repr(e))
