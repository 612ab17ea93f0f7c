"""The `collective` KV transport: tensors over a torch.distributed group per prefill-decode pair.

Control still travels on the gRPC `Push` stream (header, per-chunk layers and checksum, commit);
only the tensors take the group: NCCL when the KV cache lives on a GPU, Gloo on CPU, through the
same code, so CPU tests exercise it.

Lifecycle of a group (`CollectiveGroups`, one per worker):

    connect(target)   prefill side, on the first transfer to a decode worker: opens a TCP store,
                      asks the decode worker (`KVTransfer.JoinGroup` on the gRPC control channel)
                      to join as rank 1, and builds rank 0 while it does
    join(request)     decode side: builds rank 1 through the named store
    send / receive    every call waits at most `timeout_s`: a dead peer fails the transfer, never hangs it
    drop(group_id)    on any send or receive error, and for the least recently used group once more
                      than `max_groups` are open: a broken pair re-rendezvous on its next transfer

Each transfer on a group gets its own tag, so transfers to one decode worker may overlap (Gloo
matches on tags). NCCL ignores tags, so there one transfer at a time holds the group.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator

import grpc
import torch
import torch.distributed as dist
from tandem.v1 import kv_transfer_pb2 as pb

from cluster.kv.wire import DTYPES, KVChunk, KVHeader, TransferError


class _Group:
    def __init__(self, group_id: str, pg: dist.ProcessGroup, backend: str, peer: int, timeout_s: float) -> None:
        self.group_id = group_id
        self.pg = pg
        self.backend = backend
        self.peer = peer  # the other rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.tags = itertools.count(1)
        self.exclusive = threading.Lock()  # held per transfer where the backend cannot tell transfers apart

    def send(self, t: torch.Tensor, tag: int) -> None:
        self.pg.send([t], self.peer, tag).wait(self.timeout)

    def recv(self, t: torch.Tensor, tag: int) -> None:
        self.pg.recv([t], self.peer, tag).wait(self.timeout)

    @contextlib.contextmanager
    def transfer(self) -> Iterator[None]:
        if self.backend != "nccl":
            yield
            return
        with self.exclusive:
            yield


class CollectiveGroups:
    def __init__(
        self, device: torch.device | str = "cpu", timeout_s: float = 30.0, max_groups: int = 8, host: str = "127.0.0.1"
    ) -> None:
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self.max_groups = max_groups
        self.host = host
        self._groups: OrderedDict[str, _Group] = OrderedDict()  # most recently used last
        self._by_target: dict[str, str] = {}
        self._lock = threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}

    def __len__(self) -> int:
        return len(self._groups)

    # -- prefill side ------------------------------------------------------------------------------

    def connect(self, target: str, stub, metadata=()) -> _Group:  # type: ignore[no-untyped-def]
        """The group with the decode worker at `target`, set up through `stub.JoinGroup` on first use."""
        with self._lock:
            gate = self._connecting.setdefault(target, threading.Lock())
        with gate:  # one rendezvous per target at a time
            with self._lock:
                group_id = self._by_target.get(target)
                if group_id in self._groups:
                    self._groups.move_to_end(group_id)
                    return self._groups[group_id]
            group_id = f"kv-{uuid.uuid4().hex}"
            timeout = datetime.timedelta(seconds=self.timeout_s)
            store = dist.TCPStore(self.host, 0, 2, True, timeout=timeout, wait_for_workers=False)
            built: dict[str, object] = {}
            builder = threading.Thread(target=self._build, args=(store, group_id, 0, built), daemon=True)
            builder.start()
            request = pb.JoinGroupRequest(
                group_id=group_id, store_host=self.host, store_port=store.port, backend=self.backend,
                timeout_s=self.timeout_s,
            )  # fmt: skip
            try:
                stub.JoinGroup(request, timeout=self.timeout_s, metadata=metadata)
            except grpc.RpcError as e:
                raise TransferError(e.code(), f"joining a KV group with {target}: {e.details()}") from None
            builder.join(self.timeout_s)
            if "group" not in built:
                raise TransferError(grpc.StatusCode.UNAVAILABLE, f"KV group with {target}: {built.get('error')}")
            group = _Group(group_id, built["group"], self.backend, 1, self.timeout_s)  # type: ignore[arg-type]
            group.store = store  # type: ignore[attr-defined]  # the store must outlive the group
            self._add(group)
            with self._lock:
                self._by_target[target] = group_id
            return group

    # -- decode side -------------------------------------------------------------------------------

    def join(self, request: pb.JoinGroupRequest) -> None:
        if request.backend != self.backend:
            raise TransferError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the sender's KV group uses {request.backend}, this worker's cache needs {self.backend}",
            )
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            store = dist.TCPStore(request.store_host, request.store_port, 2, False, timeout=timeout)
        except Exception as e:
            raise TransferError(grpc.StatusCode.UNAVAILABLE, f"reaching the sender's store: {e}") from None
        built: dict[str, object] = {}
        self._build(store, request.group_id, 1, built)
        if "group" not in built:
            raise TransferError(grpc.StatusCode.UNAVAILABLE, f"joining KV group: {built.get('error')}")
        group = _Group(request.group_id, built["group"], self.backend, 0, self.timeout_s)  # type: ignore[arg-type]
        group.store = store  # type: ignore[attr-defined]
        self._add(group)

    def receive(self, header: KVHeader, m: pb.KVChunk) -> KVChunk:
        """The tensors of the chunk `m` describes, received over the header's group."""
        group = self._get(header.group_id)
        shape = header.chunk_shape(m.layer_count)
        key = torch.empty(shape, dtype=DTYPES[header.dtype], device=self.device)
        value = torch.empty_like(key)
        try:
            group.recv(key, header.tag)
            group.recv(value, header.tag)
        except RuntimeError as e:
            self.drop(group.group_id)
            raise TransferError(grpc.StatusCode.UNAVAILABLE, f"receiving over KV group: {e}") from None
        return KVChunk(m.layer_start, key, value, m.checksum)

    # -- both sides --------------------------------------------------------------------------------

    def send(self, group: _Group, chunk: KVChunk, tag: int) -> None:
        try:
            group.send(chunk.key.to(self.device), tag)
            group.send(chunk.value.to(self.device), tag)
        except RuntimeError as e:
            self.drop(group.group_id)
            raise TransferError(grpc.StatusCode.UNAVAILABLE, f"sending over KV group: {e}") from None

    def drop(self, group_id: str) -> None:
        """Tears a group down; its pair sets up a new one on its next transfer."""
        with self._lock:
            group = self._groups.pop(group_id, None)
            for target, gid in list(self._by_target.items()):
                if gid == group_id:
                    del self._by_target[target]
        if group is not None and hasattr(group.pg, "abort"):
            with contextlib.suppress(Exception):
                group.pg.abort()

    def close(self) -> None:
        for group_id in list(self._groups):
            self.drop(group_id)

    def _get(self, group_id: str) -> _Group:
        with self._lock:
            group = self._groups.get(group_id)
            if group is None:
                # UNAVAILABLE, like a broken group: the sender drops its end and sets up a new one.
                raise TransferError(grpc.StatusCode.UNAVAILABLE, f"no KV group {group_id!r} on this worker")
            self._groups.move_to_end(group_id)
            return group

    def _add(self, group: _Group) -> None:
        with self._lock:
            self._groups[group.group_id] = group
            evict = list(self._groups)[: max(0, len(self._groups) - self.max_groups)]
        for group_id in evict:
            self.drop(group_id)

    def _build(self, store: dist.Store, group_id: str, rank: int, out: dict[str, object]) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        prefixed = dist.PrefixStore(group_id, store)
        try:
            if self.backend == "nccl":
                torch.cuda.set_device(self.device)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                out["group"] = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
            else:
                out["group"] = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        except Exception as e:
            out["error"] = repr(e)
