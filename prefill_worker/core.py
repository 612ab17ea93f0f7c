"""The prefill engine's core: the one thread that steps it, and how the worker's front reaches it.

    ThreadCore(engine, senders)     the engine in the worker's own process, stepped by a thread of its own
    ProcessCore.spawn(config, id)   the engine in a process of its own (what a served worker runs): one
                                    thread stepping it, taking commands between steps and sleeping
                                    when idle; no gRPC server, no server threads, no GIL shared with
                                    the front
    prefill_core_main               that process's entry: builds the engine and runs its `PrefillLoop`

Either hands the front one `Frame` per turn that changed anything: the first tokens the step sampled
(each with its KV transfer's sending end, or the front's view of it), the step's times, the load
after it and what the prefix cache stored and evicted. Both take the same calls: `add_request`
(the decode worker to ship to named by its address), `abort`, `stats`.

The KV senders live with the cache they read (`Senders`): in a core process, the core's (a collective
transport on a GPU must run where the cache is). Each transfer's end comes to the front as a
`TransferEnd` (a process core's transfers are `RemoteTransfer`s on the front's side), so a Submit
waits on its transfer as it would on the sending end itself. The core exits when its front's end
of the pipe closes; the front, seeing the core's end close, fails every request and calls `on_exit`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from cluster import startup
from cluster.auth import secret_metadata
from cluster.config import AuthConfig, ClusterConfig, SchedulerConfig, TransferConfig
from cluster.engine.changes import Changes
from cluster.engine.core_process import IDLE_WAKE_S, AdapterCalls, CoreLoop, CorePipe, say_hello, spawn
from cluster.engine.kv_events import KVBatch, KVJournal, replay
from cluster.engine.request import SamplingParams
from cluster.kv.collective import CollectiveGroups
from cluster.kv.grpc_transport import CollectiveSender, GrpcSender
from cluster.kv.transport import KVSender, SendStream, TransferOutcome, TransferState
from cluster.kv.wire import TransferError
from cluster.tls import channel_credentials
from prefill_worker.engine import PrefillEngine, PrefillOutput, PrefillStats

log = logging.getLogger(__name__)

LEASE_POLL_S = 0.05  # how often an idle prefill engine releases the blocks of transfers that ended


@dataclass
class Frame:
    """What one turn of the prefill engine tells its front: the first tokens it sampled (their
    `transfer` the sending end, or the front's `RemoteTransfer`), when the step ran, the load after
    it and the prefix cache's events since the last frame. `failed` carries a step's error: every
    request here was aborted with it."""

    outputs: list[PrefillOutput] = field(default_factory=list)
    stats: PrefillStats | None = None
    kv: KVBatch | None = None
    busy: bool = False
    started: float = 0.0
    ended: float = 0.0
    failed: str | None = None
    taken: int = -1  # the last command the core applied


@dataclass(frozen=True)
class TransferEnd:
    """A transfer's end, as the core tells its front."""

    request_id: str
    state: TransferState
    bytes_sent: int
    code: grpc.StatusCode | None = None
    message: str = ""


class RemoteTransfer(TransferOutcome):
    """The front's view of a transfer that a core process sends: what a Submit reads of a `SendStream`."""

    def __init__(self) -> None:
        super().__init__()
        self.delivered = False  # its first token reached the front

    def end(self, state: TransferState, bytes_sent: int, error: TransferError | None) -> None:
        self.state, self.bytes_sent, self.error = state, bytes_sent, error
        self._finished.set()


class Senders:
    """The KV senders of one prefill engine, one per decode worker it ships to, over the configured
    transport, with the cluster secret and TLS."""

    def __init__(self, transfer: TransferConfig, groups: CollectiveGroups, auth: AuthConfig) -> None:
        self.transfer, self.groups, self.auth = transfer, groups, auth
        self._senders: dict[str, KVSender] = {}
        self._lock = threading.Lock()

    def __call__(self, target: str) -> KVSender:
        with self._lock:
            sender = self._senders.get(target)
            if sender is None:
                t = self.transfer
                metadata, creds = secret_metadata(self.auth), channel_credentials(self.auth)
                if t.transport == "collective":
                    sender = CollectiveSender(target, self.groups, t.timeout_s, t.max_queued_chunks, metadata, creds)
                else:
                    mib = t.max_message_mib << 20
                    sender = GrpcSender(target, t.timeout_s, mib, t.max_queued_chunks, metadata, creds)
                self._senders[target] = sender
            return sender

    def close(self) -> None:
        with self._lock:
            for sender in self._senders.values():
                sender.close()  # type: ignore[attr-defined]
            self._senders.clear()
        self.groups.close()


class Shipping:
    """The prefill engine as its core's commands reach it: a request names the decode worker its KV
    goes to, and the core's `Senders` reach it; its other calls (abort, the adapters) are the engine's."""

    def __init__(self, engine: PrefillEngine, senders: Senders) -> None:
        self.engine, self.senders = engine, senders

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, decode_target: str,
        capability: bytes = b"", output_token_ids: Sequence[int] = (), decode_cached_tokens: int = 0,
    ) -> None:  # fmt: skip
        sender = self.senders(decode_target)
        self.engine.add_request(request_id, prompt, params, sender, capability, output_token_ids, decode_cached_tokens)


def build_engine(config: ClusterConfig) -> PrefillEngine:
    """The prefill engine for the config's model, cache, batching and transfer settings."""
    from cluster.engine.adapters import lora_part, startup_adapters
    from cluster.engine.model_runner import num_kv_blocks
    from cluster.engine.structured import for_tokenizer
    from cluster.worker_shell import load_model_and_tokenizer

    with startup.phase("model"):
        model, tokenizer = load_model_and_tokenizer(config.model)
    with startup.phase("engine"):
        eos, num_blocks = tokenizer.eos_token_ids, num_kv_blocks(model, config.cache)
        grammars, seed = for_tokenizer(tokenizer, model.arch.vocab_size, eos), config.model.seed
        engine = PrefillEngine(
            model, config.cache, config.scheduler, config.transfer, num_blocks, eos, seed=seed, grammars=grammars,
            secret=config.auth.secret, lora=lora_part(config),
        )  # fmt: skip
        for adapter in startup_adapters(config, model):
            engine.load_adapter(adapter)
    return engine


def senders_for(config: ClusterConfig) -> Senders:
    t = config.transfer
    return Senders(t, CollectiveGroups(config.model.device, t.timeout_s, t.max_groups), config.auth)


class ThreadCore(AdapterCalls):
    """The prefill engine in this process: its calls go straight to it (under a lock), and `run` steps it."""

    def __init__(self, engine: PrefillEngine, senders: Senders) -> None:
        self.engine = engine
        self.scheduler_config: SchedulerConfig = engine.scheduler_config
        self.kv_journal, self.changes = engine.kv_journal, engine.changes
        self._shipping = Shipping(engine, senders)
        self._lock = threading.Lock()

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams, *rest) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self._shipping.add_request(request_id, prompt, params, *rest)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            return self.engine.abort(request_id)

    def _send(self, method: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self._shipping, method)(*args)

    def stats(self) -> PrefillStats:
        return self.engine.stats()

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def stop(self) -> None:
        self._shipping.senders.close()

    def run(self, on_frame: Callable[[Frame], None], stopped: threading.Event) -> None:
        """Steps the engine while it has work, releasing the leases of transfers that ended when it
        has none, until `stopped` is set (bump `changes` after setting it)."""
        engine = self.engine
        while not stopped.is_set():
            seen = engine.changes.version  # read first: a change from here on wakes the wait below
            with self._lock:
                busy = engine.has_work
                started = time.time()
                try:
                    frame = Frame(engine.step() if busy else [], started=started, ended=time.time())
                except Exception:  # a failed pass fails every request here, loudly
                    log.exception("the prefill engine's step failed")
                    engine.abort_all()
                    frame = Frame(failed=traceback.format_exc(limit=3))
                if not busy:
                    engine.poll_leases()
            on_frame(frame)
            if not busy:  # asleep until a request arrives, waking to release the leases that ended
                engine.changes.wait(seen, LEASE_POLL_S)
        engine.close()


class ProcessCore(CorePipe, AdapterCalls):
    """The prefill engine in a child process; this object is its front's handle. `add_request` is a
    round trip (the core takes commands between steps); `abort` does not wait. `run` reads the
    frames and the transfers' ends, keeping the load, the change counter and a mirror of the prefix
    cache's journal for Watch."""

    def __init__(
        self, process: multiprocessing.process.BaseProcess, commands, events, stats: PrefillStats, root: bytes,
        scheduler_config: SchedulerConfig, call_timeout_s: float = 30.0,
    ) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
        super().__init__(process, commands, events, call_timeout_s)
        self.scheduler_config = scheduler_config
        # The core's journal, replayed from the frames; its root (the core's hello) known before the
        # first frame, for a Watch stream that starts sooner
        self.kv_journal = KVJournal(root)
        self.changes = Changes()
        self.has_work = False
        # The core died (it was not stopped): the worker's own `on_fatal` follows.
        self.on_exit: Callable[[], None] = lambda: None
        self._stats = stats
        # Transfers the front still hears of: until both their first token and their end came.
        self._transfers: dict[str, RemoteTransfer] = {}
        self._lock = threading.Lock()

    @classmethod
    def spawn(cls, config: ClusterConfig, worker_id: str, timeout_s: float = 600.0) -> ProcessCore:
        """Starts the core for `config` and waits until its engine is built."""
        process, commands, events, hello, _ = spawn(prefill_core_main, config, f"{worker_id}-core", timeout_s)
        stats, root = hello
        return cls(process, commands, events, stats, root, config.scheduler, config.scheduler.wedged_after_s)

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams, *rest) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            if request_id in self._transfers:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._transfers[request_id] = RemoteTransfer()
        try:
            self._send("add_request", request_id, list(prompt), params, *rest)
        except BaseException:
            with self._lock:
                self._transfers.pop(request_id, None)
            raise

    def abort(self, request_id: str) -> bool:
        """Aborts without waiting for the core (it may be mid-pass); whether the request was here."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is not None and not transfer.delivered:
                del self._transfers[request_id]  # no Submit waits on its transfer; if one began, its end is dropped
        if transfer is None or transfer.finished:
            return False
        self._command("abort", (request_id,), None)
        return True

    def stats(self) -> PrefillStats:
        return self._stats

    def run(self, on_frame: Callable[[Frame], None], stopped: threading.Event) -> None:
        """Reads the core's frames until its pipe closes (`stop`, or its death)."""

        def take(message: Frame | TransferEnd) -> None:
            if isinstance(message, TransferEnd):
                self._ended(message)
                return
            self._stats, self.has_work = message.stats or self._stats, message.busy
            if message.kv is not None:
                replay(self.kv_journal, message.kv)
            message.outputs = [self._delivered(out) for out in message.outputs]
            if message.failed is not None:
                self._fail_all("the prefill engine's step failed")
            self.changes.bump()
            on_frame(message)

        died = self._read(take)
        self._fail_all("the prefill engine core process is gone")
        if died and not stopped.is_set():
            on_frame(Frame(failed="the prefill engine core process died"))
            self.on_exit()

    def _delivered(self, out: PrefillOutput) -> PrefillOutput:
        with self._lock:
            transfer = self._transfers.setdefault(out.request_id, RemoteTransfer())
            transfer.delivered = True
            if transfer.finished:
                del self._transfers[out.request_id]
        return replace(out, transfer=transfer)  # type: ignore[arg-type]

    def _ended(self, end: TransferEnd) -> None:
        with self._lock:
            transfer = self._transfers.get(end.request_id)
            if transfer is None:
                return  # aborted before its first token: nobody waits on it
            if transfer.delivered:
                del self._transfers[end.request_id]
        error = TransferError(end.code, end.message) if end.code is not None else None
        transfer.end(end.state, end.bytes_sent, error)

    def _fail_all(self, message: str) -> None:
        """Every transfer the front still waits on ends as failed (the core aborted them, or is gone)."""
        with self._lock:
            waiting, self._transfers = self._transfers, {}
        for transfer in waiting.values():
            if not transfer.finished:
                transfer.end(
                    TransferState.FAILED, transfer.bytes_sent, TransferError(grpc.StatusCode.UNAVAILABLE, message)
                )


def prefill_core_main(commands, events, config_json: str) -> None:  # type: ignore[no-untyped-def]
    try:
        config = ClusterConfig.model_validate_json(config_json)
        engine = build_engine(config)
        senders = senders_for(config)
    except BaseException as e:  # the front raises it: a bad model or config fails the worker's start
        events.send(RuntimeError(f"the prefill engine core failed to start: {e!r}"))
        raise
    say_hello(events, (engine.stats(), engine.kv_journal.root))
    try:
        PrefillLoop(engine, senders, commands, events).run()
    finally:
        senders.close()


class PrefillLoop(CoreLoop):
    """The prefill core's stepping thread: commands between steps, a frame after each turn that
    changed anything, each transfer's end as it comes (from the transfer's thread)."""

    def __init__(self, engine: PrefillEngine, senders: Senders, commands, events) -> None:  # type: ignore[no-untyped-def]
        super().__init__(Shipping(engine, senders), commands, events)
        self.prefill = engine
        self.cursor: int | None = None  # the journal's events the front has
        self.sent = -1  # the change count the last frame told
        engine.on_transfer_end = self._transfer_ended

    def _turns(self) -> None:
        engine = self.prefill
        while True:
            busy = engine.has_work
            wait = 0 if busy else LEASE_POLL_S if engine.scheduler.held else IDLE_WAKE_S
            if self.commands.poll(wait) and not self._apply_commands():
                return
            frame = Frame()
            if engine.has_work:
                frame.started = time.time()
                try:
                    frame.outputs = [replace(out, transfer=None) for out in engine.step()]  # type: ignore[arg-type]
                except Exception:
                    log.exception("the prefill engine's step failed")
                    engine.abort_all()
                    frame.failed = traceback.format_exc(limit=3)
                frame.ended = time.time()
            else:
                engine.poll_leases()
            if frame.outputs or frame.failed or engine.changes.version != self.sent:
                self._send_frame(frame)

    def _before_answer(self) -> None:
        if self.prefill.changes.version != self.sent:
            self._send_frame(Frame())

    def _send_frame(self, frame: Frame) -> None:
        engine = self.prefill
        self.sent = engine.changes.version
        frame.kv = engine.kv_journal.since(self.cursor)
        if frame.kv is not None:
            self.cursor = frame.kv.last
        frame.stats, frame.busy, frame.taken = engine.stats(), engine.has_work, self.taken
        self.outbox.send(frame)

    def _transfer_ended(self, request_id: str, stream: SendStream) -> None:
        error = stream.error
        end = TransferEnd(
            request_id, stream.state, stream.bytes_sent, error.code if error else None, error.message if error else ""
        )
        with contextlib.suppress(EOFError):  # else the front is gone
            self.outbox.send(end)
