"""The KV transport contract: one small sender and receiver interface that every transport implements.

A prefill worker opens a `SendStream` per request on the `KVSender` for the chosen decode worker,
then feeds it in order:

    stream = sender.open(header)      # RESERVED: the header goes out before any layer is ready
    stream.send(chunk) ...            # RECEIVING: one chunk per group of layers, as each finishes
    stream.commit(first_token)        # the receiver admits the sequence
    stream.wait(timeout)              # DONE, or FAILED with `stream.error` (a TransferError)

Messages leave on the stream's own thread, so the caller's forward pass keeps computing while
earlier layers travel. `send` blocks once `max_queued` chunks are waiting (flow control: a slow
link slows the producer instead of filling its memory).

On the decode side a transport hands what arrives to a `KVReceiver` in the same order: `reserve`
on the header, `write` per chunk, `commit` at the end, `fail` when the stream breaks. A receiver
method that raises has already failed the transfer and freed every block it reserved.

Transports: `local` (this module: same process, tensors handed over in memory), `grpc`
(`cluster.kv.grpc_transport`) and `collective` (`cluster.kv.collective`).
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc

from cluster.kv.wire import KVChunk, KVCommit, KVHeader, Message, TransferError


class TransferState(enum.Enum):
    RESERVED = "reserved"  # header sent (sender) or blocks reserved (receiver)
    RECEIVING = "receiving"  # chunks in flight
    DONE = "done"  # the sequence is admitted on the decode worker
    FAILED = "failed"  # refused or broken; the receiver has freed its blocks


class KVReceiver(Protocol):
    def reserve(self, header: KVHeader) -> object:
        """Checks the header and reserves blocks; returns a handle for the calls below."""
        ...

    def write(self, transfer: object, chunk: KVChunk) -> None: ...

    def commit(self, transfer: object, commit: KVCommit) -> int:
        """Admits the sequence with the prefill worker's first token; returns the blocks it holds."""
        ...

    def fail(self, transfer: object, error: TransferError) -> None: ...


class KVSender(Protocol):
    def open(self, header: KVHeader) -> SendStream: ...


_ABORT = object()


class TransferOutcome:
    """How a transfer ended, as a caller waits on it: its state, its error, the bytes it sent."""

    def __init__(self) -> None:
        self.state = TransferState.RESERVED
        self.error: TransferError | None = None
        self.bytes_sent = 0  # tensor bytes handed to the transport
        self._finished = threading.Event()

    def wait(self, timeout: float | None = None) -> TransferState:
        """Blocks until the receiver answered (or `timeout` passed); returns the state."""
        self._finished.wait(timeout)
        return self.state

    @property
    def finished(self) -> bool:
        return self._finished.is_set()


class SendStream(TransferOutcome):
    """One transfer's sending end. Subclasses implement `_run`, which consumes `_messages()`."""

    def __init__(self, header: KVHeader, max_queued: int = 8) -> None:
        super().__init__()
        self.header = header
        self.num_blocks = 0  # reported by the receiver on success
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queued + 2)
        self._queue.put(header)
        self._on_finished: list[Callable[[SendStream], None]] = []
        self._callbacks_lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"kv-send-{header.request_id}")
        self._thread.start()

    def send(self, chunk: KVChunk) -> None:
        self.state = TransferState.RECEIVING if self.state is TransferState.RESERVED else self.state
        self.bytes_sent += chunk.nbytes
        self._put(chunk)

    def commit(
        self, first_token: int, logprob: float | None = None, top_logprobs: tuple[tuple[int, float], ...] = ()
    ) -> None:
        self._put(KVCommit(first_token, logprob, tuple(top_logprobs)))

    def abort(self) -> None:
        """Stops the transfer without a commit; the receiver frees what it reserved."""
        if not self._finished.is_set():
            self._cancel()
            self._put(_ABORT)

    def when_finished(self, callback: Callable[[SendStream], None]) -> None:
        """Calls `callback(self)` once the receiver answered or the stream failed (at once if it has),
        on the stream's own thread."""
        with self._callbacks_lock:
            if not self._finished.is_set():
                self._on_finished.append(callback)
                return
        callback(self)

    # -- for subclasses ----------------------------------------------------------------------------

    def _run(self) -> int:
        """Delivers `_messages()` in order; returns the receiver's block count; raises TransferError."""
        raise NotImplementedError

    def _cancel(self) -> None:
        """Breaks the link at once (an aborting sender looks to the receiver like one that died)."""

    def _messages(self) -> Iterator[Message]:
        """Header, chunks, commit, in order; ends early (without a commit) on abort."""
        while True:
            item = self._queue.get()
            if item is _ABORT:
                return
            yield item  # type: ignore[misc]
            if isinstance(item, KVCommit):
                return

    # -- internals ---------------------------------------------------------------------------------

    def _put(self, item: object) -> None:
        while not self._finished.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue
        # The stream already ended (failed or aborted): later chunks have nowhere to go.

    def _main(self) -> None:
        try:
            self.num_blocks = self._run()
            self.state = TransferState.DONE
        except TransferError as e:
            self.error, self.state = e, TransferState.FAILED
        except Exception as e:  # a transport bug must still end the stream, loudly
            self.error, self.state = TransferError(grpc.StatusCode.INTERNAL, repr(e)), TransferState.FAILED
        finally:
            with self._callbacks_lock:
                self._finished.set()
                callbacks, self._on_finished = self._on_finished, []
            for callback in callbacks:
                callback(self)


class NullReceiver:
    """A receiver that accepts every transfer and keeps nothing, so a benchmark times the transport alone."""

    def reserve(self, header):  # type: ignore[no-untyped-def]
        return header

    def write(self, transfer, chunk) -> None:  # type: ignore[no-untyped-def]
        pass

    def commit(self, transfer, first_token: int) -> int:  # type: ignore[no-untyped-def]
        return 0

    def fail(self, transfer, error) -> None:  # type: ignore[no-untyped-def]
        pass


class LocalSender:
    """Prefill and decode in one process: chunks are handed to the receiver in memory."""

    def __init__(self, receiver: KVReceiver, max_queued: int = 8) -> None:
        self.receiver = receiver
        self.max_queued = max_queued

    def open(self, header: KVHeader) -> SendStream:
        return _LocalStream(self.receiver, header, self.max_queued)


class _LocalStream(SendStream):
    def __init__(self, receiver: KVReceiver, header: KVHeader, max_queued: int) -> None:
        self.receiver = receiver
        super().__init__(header, max_queued)

    def _run(self) -> int:
        transfer = None
        for message in self._messages():
            if isinstance(message, KVHeader):
                transfer = self.receiver.reserve(message)
            elif isinstance(message, KVChunk):
                self.receiver.write(transfer, message)
            else:
                return self.receiver.commit(transfer, message)
        error = TransferError(grpc.StatusCode.CANCELLED, "the sender stopped before its commit")
        if transfer is not None:
            self.receiver.fail(transfer, error)
        raise error
