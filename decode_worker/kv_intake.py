"""The receiving end of KV transfers on a decode worker (a `cluster.kv.transport.KVReceiver`).

Lifecycle of one transfer:

    reserve(header)   RESERVED   the header checks out (format, model fingerprint, layout, id not in
                                 use) and the engine reserves the sequence's blocks; refused otherwise
    write(chunk)      RECEIVING  each chunk's checksum is verified and its layers are written
                                 straight into the reserved blocks of the paged cache
    commit(token)     DONE       every layer has landed: the engine admits the sequence, with the
                                 prefill worker's first token, into its running batch
    (no room now)     DONE       the worker's cache or batch is full: the sequence joins its waiting
                                 queue and is prefilled here when room frees (preempting as any
                                 waiting request may); the chunks are read and dropped
    fail(error)       FAILED     on any error, a broken stream, or `timeout_s` after reservation:
                                 every reserved block is freed

Positions that this worker's own prefix cache already holds are not written again (their blocks
are shared with running sequences). Transports call in from their own threads; each transfer's
lock orders a write against a concurrent failure, so nothing lands in a block after it is freed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from cluster.auth import verify_capability
from cluster.engine.request import UnknownAdapter
from cluster.kv.transport import TransferState
from cluster.kv.wire import DTYPE_NAMES, KVChunk, KVCommit, KVHeader, TransferError, adapter_fingerprint, verify_chunk
from decode_worker.core import ProcessCore, ThreadCore
from decode_worker.engine import Engine


def _closing() -> TransferError:
    return TransferError(grpc.StatusCode.UNAVAILABLE, "the decode worker is shutting down")


@dataclass(eq=False)
class Transfer:
    header: KVHeader
    deadline: float
    slots: torch.Tensor  # [num_tokens - cached] cache slots of the positions this transfer writes
    cached: int  # leading positions already in this worker's prefix cache
    num_blocks: int = 0  # the blocks reserved for the sequence
    state: TransferState = TransferState.RESERVED
    layers: set[int] = field(default_factory=set)
    reserved_at: float = field(default_factory=time.time)
    nbytes: int = 0
    error: TransferError | None = None  # why it failed: what a later chunk or commit is answered with
    here: bool = False  # no room for it: the sequence waits to be prefilled on this worker instead
    lock: threading.Lock = field(default_factory=threading.Lock)


class KVIntake:
    def __init__(
        self,
        engine: Engine | ThreadCore | ProcessCore,  # an engine here, or its core wherever it steps
        fingerprint: bytes,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        capability_secret: bytes | None = None,
    ) -> None:
        self.engine = ThreadCore(engine) if isinstance(engine, Engine) else engine
        self.capability_secret = capability_secret  # set: every transfer needs a router-minted capability
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.clock = clock
        info = self.engine.info
        self.arch, self.kv_cache = info.arch, info.kv_cache  # the cache in shared memory for a core's process
        self.layout = {
            "dtype": DTYPE_NAMES[self.kv_cache[0][0].dtype],
            "num_layers": self.arch.num_layers,
            "num_kv_heads": self.arch.num_kv_heads,
            "head_dim": self.arch.head_dim,
        }
        self.block_size = info.block_size
        self._transfers: dict[str, Transfer | None] = {}  # None while its blocks are being reserved
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.prefilled_here = 0  # transfers that found no room: their sequences were prefilled here
        # request id -> (reserved at, admitted at, bytes), for the worker's traces; popped by it
        self.admitted: dict[str, tuple[float, float, int]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._transfers)

    # -- the receiver contract ---------------------------------------------------------------------

    def reserve(self, header: KVHeader) -> Transfer:
        self._check_header(header)
        rid = header.request_id
        with self._lock:
            if self._stop.is_set():
                raise _closing()
            if rid in self._transfers:
                raise TransferError(grpc.StatusCode.ALREADY_EXISTS, f"a transfer for {rid!r} is in flight")
            self._transfers[rid] = None  # claimed; the engine may be mid-step, so reserve outside this lock
        try:
            table, cached = self.engine.reserve(rid, header.token_ids, header.sampling, header.num_output_tokens)
        except MemoryError:
            return self._prefill_here(header)
        except (KeyError, ValueError, UnknownAdapter) as e:
            with self._lock:
                del self._transfers[rid]
            code = {
                KeyError: grpc.StatusCode.ALREADY_EXISTS,
                ValueError: grpc.StatusCode.OUT_OF_RANGE,
                UnknownAdapter: grpc.StatusCode.NOT_FOUND,
            }
            message = str(e) if isinstance(e, UnknownAdapter) else e.args[0] if e.args else repr(e)
            raise TransferError(code.get(type(e), grpc.StatusCode.RESOURCE_EXHAUSTED), message) from None
        if cached < header.first_position:  # evicted since the router saw it here
            self.engine.release(rid)
            with self._lock:
                del self._transfers[rid]
            raise TransferError(
                grpc.StatusCode.ABORTED,
                f"the sender skips the first {header.first_position} tokens, but this worker's cache holds {cached}",
            )
        positions = torch.arange(cached, header.num_tokens)
        blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
        slots = (blocks * self.block_size + positions % self.block_size).to(self.kv_cache[0][0].device)
        transfer = Transfer(header, self.clock() + self.timeout_s, slots, cached, num_blocks=len(table))
        with self._lock:
            self._transfers[rid] = transfer
        if self._stop.is_set():  # closed while the blocks were reserved: `close` did not see this one
            self.fail(transfer, _closing())
            raise _closing()
        return transfer

    def write(self, transfer: Transfer, chunk: KVChunk) -> None:
        if transfer.here:
            return
        try:
            verify_chunk(transfer.header, chunk)
            with transfer.lock:
                self._require_live(transfer)
                transfer.state = TransferState.RECEIVING
                self._copy_into_cache(transfer, chunk)
                transfer.nbytes += chunk.nbytes
                transfer.layers.update(range(chunk.layer_start, chunk.layer_start + chunk.layer_count))
        except TransferError as e:
            self.fail(transfer, e)
            raise

    def commit(self, transfer: Transfer, commit: KVCommit) -> int:
        header = transfer.header
        if transfer.here:
            return 0
        try:
            with transfer.lock:
                self._require_live(transfer)
                missing = header.num_layers - len(transfer.layers)
                if missing:
                    raise TransferError(grpc.StatusCode.DATA_LOSS, f"commit with {missing} layers never received")
                logprob = None if commit.logprob is None else (commit.logprob, list(commit.top_logprobs))
                self.engine.admit(
                    header.request_id, header.token_ids, header.sampling, commit.first_token, logprob,
                    header.num_output_tokens,
                )  # fmt: skip
                transfer.state = TransferState.DONE
        except TransferError as e:
            self.fail(transfer, e)
            raise
        with self._lock:
            self._transfers.pop(header.request_id, None)
            self.admitted[header.request_id] = (transfer.reserved_at, time.time(), transfer.nbytes)
            while len(self.admitted) > 4096:  # nobody collected these
                self.admitted.pop(next(iter(self.admitted)))
        return transfer.num_blocks

    def fail(self, transfer: Transfer, error: TransferError) -> None:
        with transfer.lock:
            if transfer.state in (TransferState.DONE, TransferState.FAILED):
                return
            transfer.state, transfer.error = TransferState.FAILED, error
            self.engine.release(transfer.header.request_id)
        with self._lock:
            if self._transfers.get(transfer.header.request_id) is transfer:
                del self._transfers[transfer.header.request_id]

    def _prefill_here(self, header: KVHeader) -> Transfer:
        """No room for the transfer's blocks now: rather than refuse the request, queue it to be
        prefilled on this worker (the same tokens: sampling is a function of the seed and the
        output index, so its first token is the prefill worker's)."""
        rid, tokens = header.request_id, list(header.token_ids)
        cut = len(tokens) - header.num_output_tokens
        try:
            self.engine.add_request(rid, tokens[:cut], header.sampling, tokens[cut:])
        except ValueError as e:
            raise TransferError(grpc.StatusCode.OUT_OF_RANGE, str(e)) from None
        finally:
            with self._lock:
                del self._transfers[rid]
        self.prefilled_here += 1
        return Transfer(header, self.clock(), torch.empty(0, dtype=torch.long), 0, TransferState.DONE, here=True)

    # -- timeouts ----------------------------------------------------------------------------------

    def reap(self) -> int:
        """Fails every transfer past its deadline; returns how many."""
        now = self.clock()
        with self._lock:
            expired = [t for t in self._transfers.values() if t is not None and t.deadline <= now]
        for transfer in expired:
            self.fail(transfer, TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "transfer timed out"))
        return len(expired)

    def start(self, interval_s: float | None = None) -> None:
        """Reaps expired transfers on a background thread until `close()`."""
        interval = interval_s if interval_s is not None else min(1.0, self.timeout_s / 4)

        def loop() -> None:
            while not self._stop.wait(interval):
                self.reap()

        self._reaper = threading.Thread(target=loop, daemon=True, name="kv-intake-reaper")
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            transfers = [t for t in self._transfers.values() if t is not None]
        for transfer in transfers:
            self.fail(transfer, _closing())

    # -- internals ---------------------------------------------------------------------------------

    def _expected_fingerprint(self, adapter: str) -> bytes:
        """This worker's fingerprint for KV through `adapter` ("" the base model); NOT_FOUND for an
        adapter it does not serve."""
        if not adapter:
            return self.fingerprint
        digest = next((a.digest for a in self.engine.occupancy.adapters if a.name == adapter), None)
        if digest is None:
            raise TransferError(grpc.StatusCode.NOT_FOUND, str(UnknownAdapter(adapter)))
        return adapter_fingerprint(self.fingerprint, digest)

    def _check_header(self, header: KVHeader) -> None:
        if self.capability_secret is not None:
            verify_capability(
                self.capability_secret, header.capability, header.request_id, header.num_tokens, self.block_size
            )
        if header.fingerprint != self._expected_fingerprint(header.sampling.adapter):
            raise TransferError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the sender serves another model or adapter (its fingerprint differs from this worker's)",
            )
        vocab = self.arch.vocab_size
        if max(header.token_ids) >= vocab:
            raise TransferError(
                grpc.StatusCode.INVALID_ARGUMENT, f"token id {max(header.token_ids)} >= vocabulary {vocab}"
            )
        for name, ours in self.layout.items():
            theirs = getattr(header, name)
            if theirs != ours:
                raise TransferError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"KV layout differs: sender {name}={theirs}, this worker {ours}",
                )

    @staticmethod
    def _require_live(transfer: Transfer) -> None:
        """A transfer failed meanwhile (timed out, or its worker shutting down) answers with why, so
        the sender, and the router behind it, see the first failure's code."""
        if transfer.state is TransferState.FAILED:
            error = transfer.error or TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "transfer timed out")
            raise TransferError(error.code, f"transfer already failed: {error.message}")

    def _copy_into_cache(self, transfer: Transfer, chunk: KVChunk) -> None:
        cached = transfer.cached
        kv_cache = self.kv_cache
        for j in range(chunk.layer_count):
            k_cache, v_cache = kv_cache[chunk.layer_start + j]
            _, _, heads, dim = k_cache.shape
            skip = cached - transfer.header.first_position  # the chunk starts at first_position
            key = chunk.key[j, skip:].to(k_cache.device, non_blocking=True)
            value = chunk.value[j, skip:].to(v_cache.device, non_blocking=True)
            k_cache.view(-1, heads, dim).index_copy_(0, transfer.slots, key)
            v_cache.view(-1, heads, dim).index_copy_(0, transfer.slots, value)
