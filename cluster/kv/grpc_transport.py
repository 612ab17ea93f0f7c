"""The `grpc` KV transport: one client-streaming `KVTransfer.Push` call per transfer.

The prefill worker streams the header, one message per chunk of layers (sent as soon as those
layers finish) and a commit; the decode worker answers once the sequence is admitted, or aborts
the call with the status code of the `TransferError` that stopped it. HTTP/2 flow control and the
stream's bounded queue keep a slow receiver from filling the sender's memory; message size limits
are set explicitly on both ends from the largest chunk the model can produce.

The servicer also carries the collective transport's control messages: with a `group_id` in the
header, chunk messages carry only layers and checksum, and the tensors arrive over that group.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import grpc
from tandem.v1 import kv_transfer_pb2 as pb
from tandem.v1 import kv_transfer_pb2_grpc as pb_grpc

from cluster import tls
from cluster.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, message_options, start_server
from cluster.kv.collective import CollectiveGroups
from cluster.kv.framing import deserialize, serialize
from cluster.kv.transport import KVReceiver, SendStream
from cluster.kv.wire import (
    KVChunk,
    KVHeader,
    Message,
    TransferError,
    WireChunk,
    decode_chunk,
    decode_commit,
    decode_header,
)

# Read the socket in MiB-sized pieces rather than gRPC's default few KiB: transfer messages are
# megabytes of tensor bytes (measured on loopback: ~1.3x the throughput).
TCP_READ_OPTIONS = [
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [*message_options(max_message_bytes), *TCP_READ_OPTIONS]


class KVTransferService(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: KVReceiver, groups: CollectiveGroups | None = None) -> None:
        self.receiver = receiver
        self.groups = groups

    def Push(self, request_iterator: Iterator[pb.KVHeader | WireChunk | pb.KVCommit], context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        transfer, error = None, None
        try:
            header: KVHeader | None = None
            for message in request_iterator:
                if header is None:
                    if not isinstance(message, pb.KVHeader):
                        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "a transfer starts with its header")
                    header = decode_header(message)
                    transfer = self.receiver.reserve(header)
                elif isinstance(message, WireChunk):
                    self.receiver.write(transfer, self._chunk(header, message))
                elif isinstance(message, pb.KVCommit):
                    num_blocks = self.receiver.commit(transfer, decode_commit(message))
                    return pb.KVTransferResult(accepted=True, num_blocks=num_blocks)
                else:
                    raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "a second header in one transfer")
            error = TransferError(grpc.StatusCode.CANCELLED, "the stream ended before its commit")
        except TransferError as e:
            error = e
        except Exception as e:  # the client went away mid-stream (cancelled, crashed, deadline)
            error = TransferError(grpc.StatusCode.CANCELLED, f"the sender's stream broke: {e!r}")
        if transfer is not None:
            self.receiver.fail(transfer, error)
        _refuse(context, error)
        return pb.KVTransferResult(accepted=False)

    def JoinGroup(self, request: pb.JoinGroupRequest, context: grpc.ServicerContext) -> pb.JoinGroupResult:
        if self.groups is None:
            _refuse(context, TransferError(grpc.StatusCode.UNIMPLEMENTED, "this worker has no collective transport"))
            return pb.JoinGroupResult()
        try:
            self.groups.join(request)
        except TransferError as e:
            _refuse(context, e)
        return pb.JoinGroupResult()

    def _chunk(self, header: KVHeader, m: WireChunk):  # type: ignore[no-untyped-def]
        if not header.group_id:
            return decode_chunk(m, header)
        if self.groups is None:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no collective transport")
        return self.groups.receive(header, m)


def _refuse(context: grpc.ServicerContext, error: TransferError) -> None:
    """Ends the call with `error`'s status once the handler returns. Not `context.abort`: on a grpc.aio
    server these handlers run on a thread, and abort waits for the server's event loop, which is gone
    when a call fails because the worker is stopping, so the thread (and the process's exit) waits forever."""
    context.set_code(error.code)
    context.set_details(error.message)


def serve(
    receiver: KVReceiver,
    address: str = "127.0.0.1:0",
    groups: CollectiveGroups | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """Starts a KVTransfer server on its own (a decode worker serves it beside `Worker`); returns
    the gRPC server and the port it bound."""

    def add(server: grpc.Server) -> list[str]:
        server.add_generic_rpc_handlers((handlers(KVTransferService(receiver, groups)),))
        return ["tandem.v1.KVTransfer"]

    started = start_server(add, address, max_message_bytes, max_workers, extra_options=TCP_READ_OPTIONS)
    return started.server, started.port


def handlers(service: KVTransferService) -> grpc.GenericRpcHandler:
    """The KVTransfer service with `Push` read through `deserialize` (chunk tensors without a copy)."""
    return grpc.method_handlers_generic_handler(
        "tandem.v1.KVTransfer",
        {
            "Push": grpc.stream_unary_rpc_method_handler(
                service.Push, request_deserializer=deserialize,
                response_serializer=pb.KVTransferResult.SerializeToString,
            ),
            "JoinGroup": grpc.unary_unary_rpc_method_handler(
                service.JoinGroup, request_deserializer=pb.JoinGroupRequest.FromString,
                response_serializer=pb.JoinGroupResult.SerializeToString,
            ),
        },
    )  # fmt: skip


class GrpcSender:
    """Sends each transfer as one `Push` call to the decode worker at `target` ("host:port")."""

    def __init__(
        self,
        target: str,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_queued: int = 8,
        metadata: Sequence[tuple[str, str]] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target = target
        self.metadata = tuple(metadata)  # the cluster secret, when there is one
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.max_queued = max_queued
        self.channel = tls.channel(target, credentials, channel_options(max_message_bytes))
        self.stub = pb_grpc.KVTransferStub(self.channel)

    def open(self, header: KVHeader) -> SendStream:
        return _GrpcStream(self, header)

    def close(self) -> None:
        self.channel.close()


class _GrpcStream(SendStream):
    def __init__(self, sender: GrpcSender, header: KVHeader) -> None:
        self.sender = sender
        self._call: grpc.Future | None = None
        self._send_error: TransferError | None = None  # raised on gRPC's thread while sending
        super().__init__(header, sender.max_queued)

    def _requests(self) -> Iterator[Message]:
        try:
            yield from self._checked()
        except TransferError as e:
            self._send_error = e
            raise

    def _checked(self) -> Iterator[Message]:
        inline = not self.header.group_id
        for message in self._messages():
            if inline and isinstance(message, KVChunk) and message.nbytes + 64 > self.sender.max_message_bytes:
                raise TransferError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a {message.nbytes}-byte chunk exceeds the {self.sender.max_message_bytes}-byte message "
                    "limit; send fewer layers per chunk",
                )
            yield message
            self._after(message)

    def _after(self, message: object) -> None:
        """Runs once `message` has been handed to gRPC (the collective stream sends tensors here)."""

    def _run(self) -> int:
        push = self.sender.channel.stream_unary(
            "/tandem.v1.KVTransfer/Push",
            request_serializer=functools.partial(serialize, inline=not self.header.group_id),
            response_deserializer=pb.KVTransferResult.FromString,
        )
        self._call = push.future(self._requests(), timeout=self.sender.timeout_s, metadata=self.sender.metadata)
        try:
            return self._call.result().num_blocks
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            if self._send_error is not None:
                raise self._send_error from None
            if isinstance(e, grpc.FutureCancelledError):
                raise TransferError(grpc.StatusCode.CANCELLED, "the transfer was aborted") from None
            raise TransferError(e.code(), e.details() or "") from None

    def _cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()


class CollectiveSender(GrpcSender):
    """The `collective` transport's sending end: the `Push` stream carries control, a
    torch.distributed group with the decode worker (`cluster.kv.collective`) carries the tensors."""

    def __init__(
        self,
        target: str,
        groups: CollectiveGroups,
        timeout_s: float = 30.0,
        max_queued: int = 8,
        metadata: Sequence[tuple[str, str]] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        super().__init__(target, timeout_s, DEFAULT_MAX_MESSAGE_BYTES, max_queued, metadata, credentials)
        self.groups = groups

    def open(self, header: KVHeader) -> SendStream:
        try:
            group = self.groups.connect(self.target, self.stub, self.metadata)
        except TransferError as e:
            return _FailedStream(header, e)
        tagged = dataclasses.replace(header, group_id=group.group_id, tag=next(group.tags))
        return _CollectiveStream(self, group, tagged)


class _CollectiveStream(_GrpcStream):
    def __init__(self, sender: CollectiveSender, group, header: KVHeader) -> None:  # type: ignore[no-untyped-def]
        self.group = group
        self.groups = sender.groups
        super().__init__(sender, header)

    def _run(self) -> int:
        with self.group.transfer():
            try:
                return super()._run()
            except TransferError as e:
                if e.code is grpc.StatusCode.UNAVAILABLE:  # the group broke on either end
                    self.groups.drop(self.group.group_id)
                raise

    def _after(self, message: object) -> None:
        if isinstance(message, KVChunk):
            self.groups.send(self.group, message, self.header.tag)


class _FailedStream(SendStream):
    """A transfer that could not start (no group with the peer): fails at once with that error."""

    def __init__(self, header: KVHeader, error: TransferError) -> None:
        self._error = error
        super().__init__(header)

    def _run(self) -> int:
        raise self._error
