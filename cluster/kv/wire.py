"""The KV transfer wire format: pure, versioned encode/decode of a header, per-layer chunks and a commit.

One transfer is a header, then one chunk per group of layers, then a commit:

    header  request id, model fingerprint, dtype, layer count, KV heads, head dim, block size,
            the token ids [0, num_tokens) (the last num_output_tokens of them output a moved
            request already generated), the sampling parameters, format version
    chunk   layers [layer_start, layer_start + layer_count): key and value tensors shaped
            [layer_count, num_tokens - first_position, num_kv_heads, head_dim] as raw little-endian bytes (an int8
            cache's rows, values and scale, as they are: head_dim + 4 bytes), and the CRC32 of key
            followed by value
    commit  the first token, sampled by the prefill worker after the last layer

The tensors are the positions [first_position, num_tokens) gathered out of the paged cache's
`[num_blocks, block_size, num_kv_heads, head_dim]` layout, so either end may use any block size.
Nothing is pickled: protobuf for the fields, raw bytes with explicit dtype and shape for tensors.
Every error a receiver can report is a `TransferError` carrying the gRPC status code that names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import warnings
import zlib
from dataclasses import dataclass

import grpc
import torch
from tandem.v1 import api_pb2
from tandem.v1 import kv_transfer_pb2 as pb

from cluster.engine.request import SamplingParams, params_from_proto, params_to_proto
from cluster.model import weights
from cluster.model.attention import KV_SCALE_BYTES

FORMAT_VERSION = 1
# A header's dtype names the cache's element type: the model's (`cluster.model.weights.DTYPES`), "float16"
# (a float32 model's 16-bit cache, `cache.kv_dtype`), or "int8": a cache of quantised rows, each head_dim int8
# values and a float32 scale (`cluster.model.attention`), carried as uint8 rows of head_dim + 4 bytes.
DTYPES = {**weights.DTYPES, "float16": torch.float16, "int8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
assert sys.byteorder == "little", "the wire carries little-endian tensors"


class TransferError(Exception):
    """A transfer refused or broken; `code` is the gRPC status that names why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


@dataclass(frozen=True)
class KVHeader:
    request_id: str
    fingerprint: bytes
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    capability: bytes = b""
    group_id: str = ""  # collective transport: the group carrying the tensors
    tag: int = 0
    format_version: int = FORMAT_VERSION
    num_output_tokens: int = 0  # of token_ids, the last ones that are output a moved request generated
    first_position: int = 0  # the chunks carry [first_position, num_tokens): the receiver holds the rest

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chunk_shape(self, layer_count: int) -> tuple[int, int, int, int]:
        row = self.head_dim + (KV_SCALE_BYTES if self.dtype == "int8" else 0)
        return (layer_count, self.num_tokens - self.first_position, self.num_kv_heads, row)


@dataclass(frozen=True)
class KVChunk:
    layer_start: int
    key: torch.Tensor  # [layer_count, num_tokens, num_kv_heads, head_dim], contiguous, on CPU or GPU
    value: torch.Tensor
    checksum: int

    @property
    def layer_count(self) -> int:
        return self.key.shape[0]

    @property
    def nbytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()


@dataclass(frozen=True)
class KVCommit:
    first_token: int
    logprob: float | None = None  # with the top alternatives, when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()


Message = KVHeader | KVChunk | KVCommit


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (one copy to host memory for a GPU tensor)."""
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.cpu().numpy())


def checksum(key: torch.Tensor, value: torch.Tensor) -> int:
    """CRC32 of the key's bytes followed by the value's."""
    return zlib.crc32(tensor_bytes(value), zlib.crc32(tensor_bytes(key)))


def make_chunk(layer_start: int, key: torch.Tensor, value: torch.Tensor) -> KVChunk:
    key, value = key.contiguous(), value.contiguous()
    if key.shape != value.shape or key.dim() != 4:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be one [L, T, H, D] shape")
    return KVChunk(layer_start, key, value, checksum(key, value))


def verify_chunk(header: KVHeader, chunk: KVChunk) -> None:
    """Raises DATA_LOSS unless `chunk` has the header's shape and dtype and its checksum holds."""
    if not 0 <= chunk.layer_start < chunk.layer_start + chunk.layer_count <= header.num_layers:
        raise TransferError(
            grpc.StatusCode.DATA_LOSS,
            f"chunk layers [{chunk.layer_start}, {chunk.layer_start + chunk.layer_count}) "
            f"outside [0, {header.num_layers})",
        )
    shape = header.chunk_shape(chunk.layer_count)
    for name, t in (("key", chunk.key), ("value", chunk.value)):
        if tuple(t.shape) != shape or DTYPE_NAMES.get(t.dtype) != header.dtype:
            raise TransferError(
                grpc.StatusCode.DATA_LOSS,
                f"chunk {name} is {DTYPE_NAMES.get(t.dtype, t.dtype)} {tuple(t.shape)}, "
                f"header says {header.dtype} {shape}",
            )
    actual = checksum(chunk.key, chunk.value)
    if actual != chunk.checksum:
        raise TransferError(
            grpc.StatusCode.DATA_LOSS,
            f"checksum mismatch in layers [{chunk.layer_start}, {chunk.layer_start + chunk.layer_count}): "
            f"sent {chunk.checksum:#010x}, received {actual:#010x}",
        )


# -- protobuf ------------------------------------------------------------------------------------


def encode_header(h: KVHeader) -> pb.KVTransferMessage:
    return pb.KVTransferMessage(
        header=pb.KVHeader(
            format_version=h.format_version,
            request_id=h.request_id,
            model_fingerprint=h.fingerprint,
            dtype=h.dtype,
            num_layers=h.num_layers,
            num_kv_heads=h.num_kv_heads,
            head_dim=h.head_dim,
            block_size=h.block_size,
            num_tokens=h.num_tokens,
            capability=h.capability,
            token_ids=h.token_ids,
            sampling=params_to_proto(h.sampling),
            group_id=h.group_id,
            tag=h.tag,
            num_output_tokens=h.num_output_tokens,
            first_position=h.first_position,
        )
    )


def decode_header(m: pb.KVHeader) -> KVHeader:
    if m.format_version != FORMAT_VERSION:
        raise TransferError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"KV wire format {m.format_version} is not supported (this worker speaks {FORMAT_VERSION})",
        )
    if m.dtype not in DTYPES:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown KV dtype {m.dtype!r}")
    if m.num_tokens != len(m.token_ids) or m.num_tokens == 0:
        raise TransferError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"header carries {len(m.token_ids)} token ids for num_tokens={m.num_tokens}; needs at least one",
        )
    if m.num_output_tokens >= m.num_tokens:
        raise TransferError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"num_output_tokens={m.num_output_tokens} leaves no prompt among {m.num_tokens} tokens",
        )
    if m.first_position >= m.num_tokens or (m.block_size and m.first_position % m.block_size):
        raise TransferError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"first_position={m.first_position} must be a multiple of block_size={m.block_size} below "
            f"num_tokens={m.num_tokens}",
        )
    try:
        sampling = params_from_proto(m.sampling)
    except ValueError as e:
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}") from None
    return KVHeader(
        request_id=m.request_id,
        fingerprint=m.model_fingerprint,
        dtype=m.dtype,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        block_size=m.block_size,
        token_ids=tuple(m.token_ids),
        sampling=sampling,
        capability=m.capability,
        group_id=m.group_id,
        tag=m.tag,
        format_version=m.format_version,
        num_output_tokens=m.num_output_tokens,
        first_position=m.first_position,
    )


def encode_chunk(c: KVChunk, inline: bool = True) -> pb.KVTransferMessage:
    """The chunk as a message; without `inline` only its layers and checksum (the tensors go another way)."""
    key = tensor_bytes(c.key).tobytes() if inline else b""
    value = tensor_bytes(c.value).tobytes() if inline else b""
    return pb.KVTransferMessage(
        chunk=pb.KVChunk(
            layer_start=c.layer_start, layer_count=c.layer_count, key=key, value=value, checksum=c.checksum
        )
    )


def decode_chunk(m: pb.KVChunk | WireChunk, header: KVHeader) -> KVChunk:
    """Tensors over the message's bytes (no copy); shape and checksum are checked by `verify_chunk`."""
    if isinstance(m, pb.KVChunk):
        m = WireChunk(m.layer_start, m.layer_count, memoryview(m.key), memoryview(m.value), m.checksum)
    shape = header.chunk_shape(m.layer_count)
    dtype = DTYPES[header.dtype]
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(m.key) != expected or len(m.value) != expected:
        raise TransferError(
            grpc.StatusCode.DATA_LOSS,
            f"chunk at layer {m.layer_start} carries {len(m.key)} + {len(m.value)} bytes, expected {expected} each",
        )
    if expected == 0:
        return KVChunk(m.layer_start, torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype), m.checksum)
    with warnings.catch_warnings():  # the tensors only ever get read (copied into the cache)
        warnings.simplefilter("ignore", UserWarning)
        key = torch.frombuffer(m.key, dtype=dtype).view(shape)
        value = torch.frombuffer(m.value, dtype=dtype).view(shape)
    return KVChunk(m.layer_start, key, value, m.checksum)


def encode_commit(c: KVCommit) -> pb.KVTransferMessage:
    m = pb.KVCommit(
        first_token=c.first_token, top=[api_pb2.TopLogprob(token_id=t, logprob=v) for t, v in c.top_logprobs]
    )
    if c.logprob is not None:
        m.logprob = c.logprob
    return pb.KVTransferMessage(commit=m)


def decode_commit(m: pb.KVCommit) -> KVCommit:
    logprob = m.logprob if m.HasField("logprob") else None
    return KVCommit(m.first_token, logprob, tuple((t.token_id, t.logprob) for t in m.top))


def encode(message: Message, inline: bool = True) -> pb.KVTransferMessage:
    if isinstance(message, KVHeader):
        return encode_header(message)
    if isinstance(message, KVChunk):
        return encode_chunk(message, inline)
    return encode_commit(message)


# A chunk as the zero-copy framing (`cluster.kv.framing`) reads it off the wire.
@dataclass(frozen=True)
class WireChunk:
    """A chunk as it arrives: its fields, and views of the key and value bytes in the message."""

    layer_start: int
    layer_count: int
    key: memoryview
    value: memoryview
    checksum: int


def model_fingerprint(model: torch.nn.Module, arch: object) -> bytes:
    """SHA-256 over the architecture and every parameter's name, dtype, shape and bytes.

    Computed once at load; two workers agree only when they serve the same weights in the same dtype.
    """
    digest = hashlib.sha256()
    fields = dataclasses.asdict(arch) if dataclasses.is_dataclass(arch) else vars(arch)  # type: ignore[arg-type]
    digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict(keep_vars=False).items()):
        digest.update(f"{name}:{DTYPE_NAMES.get(tensor.dtype, tensor.dtype)}:{tuple(tensor.shape)}".encode())
        digest.update(tensor_bytes(tensor))
    return digest.digest()


def adapter_fingerprint(fingerprint: bytes, adapter: bytes) -> bytes:
    """What a transfer's header carries for KV computed through the LoRA adapter with digest `adapter`
    (b"": the base model, whose KV carries the model's own fingerprint): a receiver whose adapter of
    that name has other weights refuses it."""
    return hashlib.sha256(b"tandem.kv.adapter" + fingerprint + adapter).digest() if adapter else fingerprint
