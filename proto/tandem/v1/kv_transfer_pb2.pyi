from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHeader(_message.Message):
    __slots__ = ("format_version", "request_id", "model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "num_tokens", "first_token", "capability")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    request_id: str
    model_fingerprint: bytes
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens: int
    first_token: int
    capability: bytes
    def __init__(self, format_version: _Optional[int] = ..., request_id: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., capability: _Optional[bytes] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer_start", "layer_count", "key", "value", "checksum")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_count: int
    key: bytes
    value: bytes
    checksum: int
    def __init__(self, layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class KVTransferMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ...) -> None: ...

class KVTransferResult(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
