"""Chunk framing without copies: the gRPC transport's request serializer and deserializer.

A chunk message is almost all tensor bytes. Protobuf's own serializer copies them several times
(tensor -> bytes -> message -> wire, and back); these two functions write and read the same wire
bytes (a `KVTransferMessage` holding a `KVChunk`, fields in order, zeros omitted) with one copy on
the way out and none on the way in. Any protobuf parser reads what `serialize` writes, and
`deserialize` reads any encoding of the message (fields in any order, unknown fields skipped).
"""

from __future__ import annotations

import grpc
from tandem.v1 import kv_transfer_pb2 as pb

from cluster.kv.wire import KVChunk, Message, TransferError, WireChunk, encode, tensor_bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def serialize(message: Message, inline: bool = True) -> bytes:
    """The wire bytes of `message` as a `KVTransferMessage` (the gRPC transport's request serializer)."""
    if not isinstance(message, KVChunk):
        return encode(message).SerializeToString()
    key = tensor_bytes(message.key) if inline else memoryview(b"")
    value = tensor_bytes(message.value) if inline else memoryview(b"")
    parts: list[bytes | memoryview] = []
    for number, n in ((1, message.layer_start), (2, message.layer_count)):
        if n:
            parts += [_field(number, 0), _varint(n)]
    for number, data in ((3, key), (4, value)):
        if len(data):
            parts += [_field(number, 2), _varint(len(data)), data]
    if message.checksum:
        parts += [_field(5, 5), message.checksum.to_bytes(4, "little")]
    size = sum(len(p) for p in parts)
    return b"".join([_field(2, 2), _varint(size), *parts])


def deserialize(data: bytes) -> pb.KVHeader | WireChunk | pb.KVCommit:
    """One `KVTransferMessage` off the wire (the gRPC transport's request deserializer): the header
    or commit as protobuf, a chunk as a `WireChunk` over `data` itself."""
    view = memoryview(data)
    fields = _fields(view)
    if 2 not in fields:
        m = pb.KVTransferMessage.FromString(data)
        kind = m.WhichOneof("payload")
        if kind is None:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "empty transfer message")
        return getattr(m, kind)
    chunk = _fields(fields[2])  # type: ignore[arg-type]
    return WireChunk(
        layer_start=int(chunk.get(1, 0)),  # type: ignore[arg-type]
        layer_count=int(chunk.get(2, 0)),  # type: ignore[arg-type]
        key=chunk.get(3, memoryview(b"")),  # type: ignore[arg-type]
        value=chunk.get(4, memoryview(b"")),  # type: ignore[arg-type]
        checksum=int(chunk.get(5, 0)),  # type: ignore[arg-type]
    )


def _fields(view: memoryview) -> dict[int, int | memoryview]:
    """Field number -> value (an int, or a view of a length-delimited field), last one winning."""
    out: dict[int, int | memoryview] = {}
    i = 0
    try:
        while i < len(view):
            tag, i = _read_varint(view, i)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                out[number], i = _read_varint(view, i)
            elif wire_type == 2:
                length, i = _read_varint(view, i)
                if i + length > len(view):
                    raise IndexError
                out[number], i = view[i : i + length], i + length
            elif wire_type == 5:
                out[number], i = int.from_bytes(view[i : i + 4], "little"), i + 4
            elif wire_type == 1:
                out[number], i = int.from_bytes(view[i : i + 8], "little"), i + 8
            else:
                raise IndexError
    except IndexError:
        raise TransferError(grpc.StatusCode.DATA_LOSS, "malformed transfer message") from None
    return out


def _read_varint(view: memoryview, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = view[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


# -- the model fingerprint -----------------------------------------------------------------------
