"""What a full KV block is called, in every place that names one: the pool, the KV events, the routers'
prefix index and the KV tiers.

A block's name is 16 bytes of SHA-256 over its parent's name and its own token ids. The first block's
parent is the request's root: the model's root (SHA-256 of the model fingerprint, so two sets of
weights never share a name), or one derived from it and the request's `Scope`: the LoRA adapter it runs
through (by the digest of the adapter's files) and its `cache_salt`. Every input is a tagged,
length-prefixed field, so no field can pose as another and no salt as a token run. Equal names mean
equal weights, equal adapter, equal salt and equal tokens from the first: a prompt cannot be built to
take another's KV (a 64-bit non-cryptographic hash can be), requests through different adapters never
share KV, and requests with different salts share no block, so a shared prefix cache times nothing
across tenants.

    root = request_root(model_root(fingerprint), Scope(cache_salt, adapter_digest))
    names = chain(token_ids, block_size, root)     # one per full block, in order
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

NAME_BYTES = 16  # 128 bits: a collision takes about 2**64 tries, a chosen prefix's second name 2**128
UNNAMED_MODEL = bytes(NAME_BYTES)  # the root of a pool told no fingerprint (unit tests, the planner)


def _name(tag: bytes, *fields: bytes) -> bytes:
    digest = hashlib.sha256(tag)
    for field in fields:
        digest.update(len(field).to_bytes(4, "little"))
        digest.update(field)
    return digest.digest()[:NAME_BYTES]


def model_root(fingerprint: bytes) -> bytes:
    """The root of every unsalted request to the model whose weights have this fingerprint."""
    return _name(b"tandem.kv.model", fingerprint)


@dataclass(frozen=True)
class Scope:
    """What a request's KV depends on besides the model and its tokens."""

    cache_salt: str = ""  # "": shared with every request without one
    adapter: bytes = b""  # the LoRA adapter's digest (`cluster.model.lora.Adapter.digest`); b"": the base model


BASE = Scope()


def request_root(root: bytes, scope: Scope = BASE) -> bytes:
    """The root of a request in `scope` under the model's `root` (the base model unsalted keeps it)."""
    if scope.adapter:
        root = _name(b"tandem.kv.adapter", root, scope.adapter)
    return _name(b"tandem.kv.salt", root, scope.cache_salt.encode()) if scope.cache_salt else root


def child(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of the block holding `tokens` after the block (or root) named `parent`."""
    # One digest call: the parent's length is fixed and the tokens' is the block size, so the fields
    # need no length prefixes to stay apart.
    return hashlib.sha256(b"tandem.kv.block" + parent + _packer(len(tokens)).pack(*tokens)).digest()[:NAME_BYTES]


@functools.cache
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")  # token ids as little-endian uint64


def chain(tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """The name of each full block of `tokens`, in order."""
    names, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = child(parent, tokens[start : start + block_size])
        names.append(parent)
    return names
