"""An engine in a process of its own, both ends of the pipe between it and its worker's front.

    spawn(main, config, name)   starts `main(commands, events, config_json)` in a process of its own and
                                waits for its hello (what its front needs to know of the engine once)
    fork_next_core()            the next core of this process (one that has run nothing yet) forks from it
    say_hello(events, value)    the core's hello: `value`, and where its start spent its time
    CorePipe                    the front's end: round-trip calls, one-way commands, and the reader that
                                hands on each frame the core sends
    CoreLoop                    the core's end: the one thread stepping the engine, which applies every
                                waiting command between steps and sleeps on the pipe when idle
    Outbox                      the core's messages to its front, written by a thread of their own

A command is `(method, call_id, args, answer)`: the core calls `engine.method(*args)` and answers
`(call_id, ok, value)` "always", only on "errors", or never (None). Commands carry increasing call ids,
and each frame says the last one the core applied (`taken`), so a front knows which commands
answered only on errors went through. Each role's frames and engine are its own: the decode
worker's in `decode_worker.core` and `decode_worker.engine_loop`, the prefill worker's in
`prefill_worker.core`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from cluster import startup
from cluster.config import ClusterConfig, dump_config

log = logging.getLogger(__name__)

# An idle core sleeps on its commands; it wakes this often anyway (the front's watchdog sees it alive).
IDLE_WAKE_S = 0.5


_fork_next: Callable[[str], None] | None = None  # `fork_next_core`'s `retitle`, taken by the next `spawn`


def fork_next_core(retitle: Callable[[str], None] = lambda title: None) -> None:
    """Says this process has done nothing yet but import (a served worker's, before it builds its
    engine): its next core starts as a fork of it, with every module already imported, rather than
    as a fresh interpreter that imports them all again (about 3 s of a worker's start on two cores).
    Only the next: once a process has run torch's OpenMP regions (GNU OpenMP's threads hang in a
    forked child that uses them) or CUDA, a core must start afresh, so later ones are spawned.
    `retitle(title)` names the forked process as `ps` shows it (else it shows its front's title)."""
    global _fork_next
    _fork_next = retitle


class CoreDied(RuntimeError):
    """The engine core process is gone: nothing it held can be reached."""


def spawn(
    main: Callable[..., None], config: ClusterConfig, name: str, timeout_s: float = 600.0,
    meanwhile: Callable[[], Any] = lambda: None,
) -> tuple[multiprocessing.process.BaseProcess, Any, Any, Any, Any]:  # fmt: skip
    """Starts `main` in a process of its own and waits until it says hello (`say_hello`: its engine
    built and warmed up), running `meanwhile` here in the meantime. Returns the process, the front's
    ends of the command and event pipes, the hello's value, and what `meanwhile` returned; raises
    CoreDied if the core never says hello, or what it sent instead (its start failed). The core's
    start is noted here as the phase "engine core" (`cluster.startup`). It starts as a fork of this
    process where `fork_next_core` said it may, else spawned."""
    global _fork_next
    retitle, _fork_next = (_fork_next if not _cuda_started() else None), None
    ctx = multiprocessing.get_context("spawn" if retitle is None else "fork")
    commands_theirs, commands = ctx.Pipe(duplex=False)
    events, events_theirs = ctx.Pipe(duplex=False)
    target = main
    if retitle is not None:
        target = functools.partial(_forked, main, (commands, events), functools.partial(retitle, f"tandem::{name}"))
    process = ctx.Process(
        target=target,
        args=(commands_theirs, events_theirs, dump_config(config)),
        name=name,
        daemon=True,
    )
    began = time.perf_counter()
    with _no_main_script(main):
        process.start()
    commands_theirs.close()
    events_theirs.close()
    extra = meanwhile()
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
    value, phases = hello
    startup.note(startup.with_rest("engine core", time.perf_counter() - began, phases, "process start, imports"))
    return process, commands, events, value, extra


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _forked(main: Callable[..., None], fronts: tuple[Any, ...], retitle: Callable[[], None], *args: Any) -> None:
    """A forked core's start: the front's ends of the pipes (held here, the core would never see its
    front go), what the front noted of its own start, the signal handlers its host installed (Ray's,
    in a served worker) and its process title are not the core's."""
    for end in fronts:
        end.close()
    startup.taken()
    retitle()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(*args)


@contextlib.contextmanager
def _no_main_script(main: Callable[..., None]) -> Iterator[None]:
    """A spawned process runs its parent's main script again first (as `__mp_main__`), in case its
    entry was defined there; a core's entry is defined in a module it imports, and a Ray worker's
    script imports all of Ray: 0.8 s of each core's start for nothing. So while the process starts,
    the parent has no script to tell of."""
    script = sys.modules["__main__"]
    path = script.__dict__.pop("__file__", None) if main.__module__ != "__main__" else None
    try:
        yield
    finally:
        if path is not None:
            script.__file__ = path


def say_hello(events, value: object) -> None:  # type: ignore[no-untyped-def]
    """The core's first message, once its engine is ready: `value` for its front, with the phases
    its start noted."""
    events.send((value, startup.taken()))


class CorePipe:
    """The front's end of a core process's pipes. Calls are round trips, each bounded by
    `call_timeout_s`; `read` hands on every frame until the core's end closes."""

    def __init__(self, process: multiprocessing.process.BaseProcess, commands, events, call_timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        self.process, self.call_timeout_s = process, call_timeout_s
        self._commands, self._events = commands, events
        self._send_lock = threading.Lock()
        self._calls: dict[int, tuple[threading.Event, list]] = {}
        self._ids = itertools.count()
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._commands.send(("stop", -1, (), None))
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _send(self, method: str, *args: Any) -> Any:
        """A round trip: the engine's answer, or what it raised."""
        done, result = threading.Event(), []
        call_id = -1
        try:
            call_id = self._command(
                method, args, "always", lambda call_id: self._calls.__setitem__(call_id, (done, result))
            )
            if not done.wait(self.call_timeout_s):
                raise CoreDied(f"the engine core did not answer {method} within {self.call_timeout_s:g} s")
        finally:
            self._calls.pop(call_id, None)
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def _command(
        self, method: str, args: tuple, answer: str | None, register: Callable[[int], None] | None = None
    ) -> int:
        """Sends a command under the next call id, in id order (`register` sees the id first). The core
        answers it "always", only on "errors", or never (None)."""
        with self._send_lock:
            call_id = next(self._ids)
            if register is not None:
                register(call_id)
            try:
                self._commands.send((method, call_id, args, answer))
            except (OSError, ValueError):
                raise CoreDied("the engine core process is gone") from None
        return call_id

    def _read(self, on_frame: Callable[[Any], None]) -> bool:
        """Hands each frame to `on_frame` and each answer to its caller until the core's end closes;
        then fails the calls still waiting. True if the core died (it was not stopped)."""
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            if not isinstance(message, tuple):
                on_frame(message)
                continue
            call_id, ok, value = message
            self._answered(call_id, ok, value)
            waiting = self._calls.get(call_id)
            if waiting is not None:
                waiting[1].append((ok, value))
                waiting[0].set()
        for done, result in list(self._calls.values()):  # calls in flight get the news
            result.append((False, CoreDied("the engine core process is gone")))
            done.set()
        died = not self._stopping
        if died:
            log.error("the engine core process %s died (exit code %s)", self.process.name, self.process.exitcode)
        return died

    def _answered(self, call_id: int, ok: bool, value: Any) -> None:
        """An answer came (before its caller, if any, wakes)."""


class AdapterCalls:
    """A core handle's `load_adapter` and `unload_adapter`: calls to its engine like any other (over a
    pipe, an adapter's tensors travel by value or through shared memory)."""

    _send: Callable[..., Any]  # the handle's call to its engine

    def load_adapter(self, adapter: Any) -> None:
        self._send("load_adapter", adapter)

    def unload_adapter(self, name: str) -> None:
        self._send("unload_adapter", name)


class Outbox:
    """The core's messages to its front, in order, sent by a thread of their own: a frame's pickling,
    and its write (which waits while the front reads the frame before), overlap the next step
    instead of delaying it. At most `depth` wait, so a front that falls behind still slows the core."""

    def __init__(self, events, depth: int = 4) -> None:  # type: ignore[no-untyped-def]
        self.events = events
        self.gone = False  # the front closed the pipe
        self._queue: queue.Queue[object] = queue.Queue(depth)
        self._thread = threading.Thread(target=self._send, daemon=True, name="core-outbox")
        self._thread.start()

    def send(self, message: object) -> None:
        """Queues `message` (from any thread); raises EOFError once the front is gone."""
        while not self.gone:
            try:
                self._queue.put(message, timeout=IDLE_WAKE_S)
                return
            except queue.Full:
                continue
        raise EOFError("the front closed the pipe")

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued, then stops."""
        if not self.gone:
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _send(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self.events.send(message)
            except (OSError, ValueError):
                self.gone = True
                return


class CoreLoop:
    """The core's stepping thread: `_turns` steps the engine, calling `_apply_commands` between steps,
    until the front says stop or closes its end."""

    def __init__(self, engine: Any, commands, events) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.commands = engine, commands
        self.outbox = Outbox(events)
        self.taken = -1  # the last command applied

    def run(self) -> None:
        try:
            self._turns()
        except (EOFError, OSError):
            return  # the front is gone
        self.outbox.close()

    def _turns(self) -> None:
        """Turns until `_apply_commands` says stop."""
        raise NotImplementedError

    def _before_answer(self) -> None:
        """What goes out ahead of a command's answer (the decode core: a frame with the load it changed)."""

    def _apply_commands(self) -> bool:
        """Every command waiting; False on `stop`."""
        while self.commands.poll(0):
            method, call_id, args, answer = self.commands.recv()
            if method == "stop":
                return False
            try:
                reply = (call_id, True, getattr(self.engine, method)(*args))
            except Exception as e:
                reply = (call_id, False, _picklable(e))
            answered = answer == "always" or (answer == "errors" and not reply[1])
            if answered:
                # First: a call returns once its front's load shows what it changed. That frame counts the
                # calls before this one as taken, not this one: a refused submit's front hears the refusal
                # before any frame could say it was taken without an error.
                self._before_answer()
            self.taken = call_id
            if answered:
                self.outbox.send(reply)  # else no answer wanted (an abort, a submit taken): the turn's frame tells
        return True


def _picklable(e: Exception) -> Exception:
    """`e` itself when it crosses the pipe (the engine's KeyError, ValueError, MemoryError do)."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(repr(e))
