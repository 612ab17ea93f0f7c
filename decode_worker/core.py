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
what the engine raises, and both give each output its text and stop strings on the front's side
(`CoreHandle`): the core never detokenises. The core process's own side is `decode_worker.engine_loop`.

In a process of its own the engine's paged KV cache lives in shared memory: the front's KV intake
writes received layers straight into the blocks the core reserved, with no copy of the bytes across
the process boundary (on a GPU the same tensors are CUDA IPC handles; see docs/engine.md). The core
exits when its front's end of the pipe closes (the worker died); the front, seeing the core's end
close, fails every stream and calls `on_exit`: the worker stops serving and calls its `on_fatal`
(a Ray actor's process exits, so Ray restarts it; the routers have moved its requests).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.multiprocessing  # noqa: F401  (its reductions send the shared KV cache over the pipe)

from cluster.config import ClusterConfig, SchedulerConfig
from cluster.engine.block_names import model_root
from cluster.engine.changes import Changes, Occupancy
from cluster.engine.core_process import IDLE_WAKE_S, AdapterCalls, CoreDied, CorePipe, spawn
from cluster.engine.kv_events import KVJournal, replay
from cluster.engine.request import SamplingParams
from cluster.engine.sampler import TokenLogprob
from decode_worker.engine import Engine
from decode_worker.engine_loop import CoreInfo, Frame, OnFrame, core_main
from decode_worker.text import RequestOutput, TextStreams

log = logging.getLogger(__name__)


class CoreHandle(AdapterCalls):
    """What the front's handle on an engine core does on its side of the calls: each request's text
    opens as the request is queued or admitted, and each frame's outputs get their text and stop
    strings here (`decode_worker.text`), never in the core. A request a stop string ended is
    stopped in the core, and whatever the core made of it since is dropped."""

    text: TextStreams | None  # None where the engine applies the text itself

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        output_token_ids: Sequence[int] = (),
    ) -> None:  # fmt: skip
        with self._text_for(request_id, prompt_token_ids, output_token_ids, params.stop):
            self._send("add_request", request_id, prompt_token_ids, params, output_token_ids)

    def submit(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        output_token_ids: Sequence[int], refused: Callable[[Exception], None],
    ) -> None:  # fmt: skip
        """`add_request` without waiting for the engine to take it (a step stream submits many a step);
        if the engine refuses it, `refused` gets what it raised (on the frame reader's thread)."""
        with self._text_for(request_id, prompt_token_ids, output_token_ids, params.stop):
            self._send_later("add_request", (request_id, prompt_token_ids, params, output_token_ids), refused)

    def admit(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, first_token: int,
        logprob: TokenLogprob | None = None, num_output: int = 0,
    ) -> None:  # fmt: skip
        prompt = len(token_ids) - num_output
        with self._text_for(request_id, token_ids[:prompt], token_ids[prompt:], params.stop):
            self._send("admit", request_id, token_ids, params, first_token, logprob, num_output)

    def abort(self, request_id: str) -> bool:
        if self.text is not None:
            self.text.close(request_id)
        return self._send("abort", request_id)

    def abort_soon(self, request_id: str) -> None:
        """Aborts without waiting for the engine's answer: what the front's frame reader calls, since the
        answer to a call of its own would come through it."""
        if self.text is not None:
            self.text.close(request_id)
        self._stop_after_text(request_id)

    def reserve(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, num_output: int = 0
    ) -> tuple[list[int], int]:
        return self._send("reserve", request_id, token_ids, params, num_output)

    def release(self, request_id: str) -> None:
        self._send("release", request_id)

    def _send(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def _send_later(self, method: str, args: tuple, refused: Callable[[Exception], None]) -> None:
        raise NotImplementedError

    def _stop_after_text(self, request_id: str) -> None:
        """Stops a request a stop string has ended (without waiting for the engine to take it)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _text_for(
        self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], stop: Sequence[str]
    ) -> Iterator[None]:
        if self.text is None:
            yield
            return
        self.text.open(request_id, prompt_token_ids, output_token_ids, stop)
        try:
            yield
        except BaseException:
            self.text.close(request_id)
            raise

    def _with_text(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.text is None:
            return outputs
        kept = []
        for out in outputs:
            if out.request_id not in self.text:
                continue  # it ended here (a stop string, an abort) and the core has stepped it since
            if self.text.apply(out):
                self._stop_after_text(out.request_id)
            kept.append(out)
        return kept


class ThreadCore(CoreHandle):
    """The engine in this process: its calls go straight to it, and `run` steps it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.info = CoreInfo(engine.runner.model.arch, engine.scheduler.blocks.block_size, engine.kv_cache)
        self.scheduler_config = engine.scheduler.config
        self.kv_journal = engine.kv_journal
        self.changes = engine.changes
        self.steps = 0
        self.text = TextStreams(engine.tokenizer) if engine.text is None else None
        self.unanswered = 0  # `submit` takes effect at once here

    @property
    def occupancy(self) -> Occupancy:
        return self.engine.occupancy

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    def stop(self) -> None:
        """Nothing of its own to stop: `run` ends when its `stopped` is set."""

    def _send(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def _send_later(self, method: str, args: tuple, refused: Callable[[Exception], None]) -> None:
        try:
            getattr(self.engine, method)(*args)
        except Exception as e:
            if self.text is not None:
                self.text.close(args[0])
            refused(e)

    def _stop_after_text(self, request_id: str) -> None:
        self.engine.abort(request_id)  # on the stepping thread, between steps

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
            outputs = self._with_text(outputs)
            frame = Frame(outputs, engine.occupancy, None, engine.has_unfinished, steps=self.steps)
            frame.first_tokens = engine.take_first_tokens()
            on_frame(frame)
        engine.close()


class ProcessCore(CorePipe, CoreHandle):
    """The engine in a child process; this object is its front's handle. Calls are round trips on
    the pipe (`cluster.engine.core_process`: the core takes commands between steps, never mid-step);
    `run` reads the frames, keeping the load, the change counter and a mirror of the prefix cache's
    journal for Watch, and gives their outputs their text."""

    def __init__(
        self, process: multiprocessing.process.BaseProcess, commands, events, info: CoreInfo,
        scheduler_config: SchedulerConfig, text: TextStreams, call_timeout_s: float = 30.0,
    ) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
        super().__init__(process, commands, events, call_timeout_s)
        self.info, self.scheduler_config, self.text = info, scheduler_config, text
        # The core's journal, replayed from the frames; its root known before the first frame, for a
        # Watch stream that starts sooner
        self.kv_journal = KVJournal(model_root(info.fingerprint))
        self.changes = Changes()
        self.occupancy = info.occupancy
        self.has_unfinished = False
        self.steps = 0  # the core's steps, as of its last frame
        # The core died (it was not stopped): the worker's own `on_fatal` follows.
        self.on_exit: Callable[[], None] = lambda: None
        self._later: dict[int, tuple[str, Callable[[Exception], None]]] = {}  # unanswered, by call id
        self._later_lock = threading.Lock()  # never held across a pipe write: the frame reader takes it
        # Aborts the frame reader asks for, sent by a thread of their own: the reader never writes to the
        # pipe, since a full one would block it while the core, blocked on a full events pipe, waits
        # for it to read.
        self._aborts: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._send_aborts, daemon=True, name="core-aborts").start()

    @classmethod
    def spawn(
        cls, config: ClusterConfig, worker_id: str, timeout_s: float = 600.0, main: Callable[..., None] = core_main
    ) -> ProcessCore:
        """Starts the core for `config` and waits until its engine is built and warmed up (the
        model's tokenizer is loaded here meanwhile: the front applies the text). `main` is the
        process's entry: `core_main`, or a stand-in engine's (benchmarks/gpu_shaped.py)."""
        from cluster.model.gguf import model_folder  # here: a GPU check's intake process has no tokenizer library
        from cluster.model.tokenizer import Tokenizer

        process, commands, events, info, tokenizer = spawn(
            main, config, f"{worker_id}-core", timeout_s, lambda: Tokenizer(model_folder(config.model.path))
        )
        return cls(
            process, commands, events, info, config.scheduler, TextStreams(tokenizer), config.scheduler.wedged_after_s
        )

    def run(self, on_frame: OnFrame, stopped: threading.Event) -> None:
        """Reads the core's frames and replies until its pipe closes (`stop`, or its death)."""

        def take(frame: Frame) -> None:
            self._take(frame)
            frame.outputs = self._with_text(frame.outputs)
            on_frame(frame)

        died = self._read(take)
        self._later.clear()  # their requests fail with the frame below
        if died and not stopped.is_set():
            on_frame(Frame(occupancy=self.occupancy, failed="the engine core process died"))
            self.on_exit()

    def stop(self) -> None:
        self._aborts.put(None)
        super().stop()

    def _answered(self, call_id: int, ok: bool, value: Any) -> None:
        with self._later_lock:
            later = self._later.pop(call_id, None)  # answered only when it failed
        if later is not None:
            if self.text is not None:
                self.text.close(later[0])
            later[1](value)

    def _send_later(self, method: str, args: tuple, refused: Callable[[Exception], None]) -> None:
        """A command answered only if it fails; the frames say which commands the core has taken."""
        call_id = -1
        try:
            call_id = self._command(
                method, args, "errors", lambda call_id: self._register_later(call_id, args[0], refused)
            )
        except CoreDied:
            with self._later_lock:
                self._later.pop(call_id, None)
            raise

    def _register_later(self, call_id: int, request_id: str, refused: Callable[[Exception], None]) -> None:
        with self._later_lock:
            self._later[call_id] = (request_id, refused)

    @property
    def unanswered(self) -> int:
        """Requests sent with `submit` that the core has not taken yet."""
        return len(self._later)

    def _stop_after_text(self, request_id: str) -> None:
        self._aborts.put(request_id)  # no answer wanted, and no write here: this may be the frame reader

    def _send_aborts(self) -> None:
        while (request_id := self._aborts.get()) is not None:
            with contextlib.suppress(CoreDied):
                self._command("abort", (request_id,), None)

    def _take(self, frame: Frame) -> None:
        self.occupancy, self.has_unfinished, self.steps = frame.occupancy, frame.busy, frame.steps
        if self._later:
            with self._later_lock:
                for call_id in [c for c in self._later if c <= frame.taken]:  # taken without an error
                    del self._later[call_id]
        if frame.kv is not None:
            replay(self.kv_journal, frame.kv)
        self.changes.bump()
