"""The stores under a worker's paged KV pool, one per tier, each bounded, each a small contract:

    get_many(names) -> [bytes | None]   each entry's bytes (None where absent), most recent use noted
    put(name, blob) -> evicted          keeps it, evicting the least recently used past the budget;
                                        the names it evicted
    names()                             every entry held (a disk tier's, found at start)
    pin(names) / unpin(names)           entries being loaded: never evicted meanwhile
    holds(name) -> bool

`HostStore` keeps entries in this process's memory, `DiskStore` in files under a directory (they
outlive the process), `RedisStore` in a Redis every worker of the model reaches. Disk and Redis
entries are sealed (`cluster.kv.tiers.seal`): what is read back is verified before use. A store that
fails raises `StoreDown`; the tiers turn it off for a while and requests recompute.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol


class StoreDown(RuntimeError):
    """The store did not answer, or failed to keep an entry."""


class Store(Protocol):
    kind: str  # "host", "disk" or "shared"
    sealed: bool  # whether entries are kept sealed (checked on the way back)

    def get_many(self, names: Sequence[bytes]) -> list[bytes | None]: ...
    def put(self, name: bytes, blob: bytes) -> list[bytes]: ...
    def holds(self, name: bytes) -> bool: ...
    def names(self) -> list[bytes]: ...
    def pin(self, names: Sequence[bytes]) -> None: ...
    def unpin(self, names: Sequence[bytes]) -> None: ...


class _Bounded:
    """Least-recently-used bookkeeping by bytes, with pinned entries left in place: the part the
    host and disk stores share. Callers hold `lock`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("a store's budget must be positive")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self.lock = threading.Lock()
        self._sizes: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # least recent first
        self._pins: collections.Counter[bytes] = collections.Counter()

    def holds(self, name: bytes) -> bool:
        with self.lock:
            return name in self._sizes

    def names(self) -> list[bytes]:
        with self.lock:
            return list(self._sizes)

    def pin(self, names: Sequence[bytes]) -> None:
        with self.lock:
            self._pins.update(names)

    def unpin(self, names: Sequence[bytes]) -> None:
        with self.lock:
            self._pins.subtract(names)
            self._pins = +self._pins  # drop the zeros

    def _touch(self, name: bytes) -> bool:
        if name in self._sizes:
            self._sizes.move_to_end(name)
            return True
        return False

    def _add(self, name: bytes, size: int) -> list[bytes]:
        """Notes a new entry; returns the names evicted to make room (the caller drops them)."""
        self._sizes[name] = size
        self.bytes += size
        evicted = []
        for old in list(self._sizes):
            if self.bytes <= self.max_bytes:
                break
            if old == name or self._pins[old]:
                continue
            self.bytes -= self._sizes.pop(old)
            evicted.append(old)
        self.evictions += len(evicted)
        return evicted

    def _forget(self, name: bytes) -> None:
        self.bytes -= self._sizes.pop(name, 0)


class Codec(Protocol):
    """A smaller form of a block's bytes, kept in its place (`cluster.kv.tiering.Int8Rows`)."""

    def encode(self, payload: bytes) -> bytes: ...
    def decode(self, blob: bytes) -> bytes: ...


class HostStore(_Bounded):
    """Entries in this process's memory; with a `codec`, in its smaller form (the budget counts
    that), given back decoded."""

    kind, sealed = "host", False

    def __init__(self, max_bytes: int, codec: Codec | None = None) -> None:
        super().__init__(max_bytes)
        self.codec = codec
        self._entries: dict[bytes, bytes] = {}

    def get_many(self, names: Sequence[bytes]) -> list[bytes | None]:
        with self.lock:
            blobs = [self._entries[n] if self._touch(n) else None for n in names]
        if self.codec is None:
            return blobs
        return [None if b is None else self.codec.decode(b) for b in blobs]

    def put(self, name: bytes, blob: bytes) -> list[bytes]:
        with self.lock:
            if self._touch(name):
                return []
        if self.codec is not None:
            blob = self.codec.encode(blob)
        with self.lock:
            if self._touch(name) or len(blob) > self.max_bytes:
                return []
            self._entries[name] = blob
            evicted = self._add(name, len(blob))
            for old in evicted:
                del self._entries[old]
            return evicted


class DiskStore(_Bounded):
    """One file per entry, `<directory>/<first byte>/<name>.kv`, written to a temporary file and
    renamed into place, so a write that fails or is killed leaves no entry at all. What is there at
    start (a restarted worker's) is kept, oldest first out."""

    kind, sealed = "disk", True

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob("*/*.tmp"):  # a write killed before its rename
            leftover.unlink(missing_ok=True)
        found = sorted(self.directory.glob("*/*.kv"), key=lambda p: p.stat().st_mtime)
        with self.lock:
            for path in found:
                for old in self._add(bytes.fromhex(path.stem), path.stat().st_size):
                    self._path(old).unlink(missing_ok=True)

    def _path(self, name: bytes) -> Path:
        return self.directory / name[:1].hex() / f"{name.hex()}.kv"

    def get_many(self, names: Sequence[bytes]) -> list[bytes | None]:
        blobs: list[bytes | None] = []
        for name in names:
            with self.lock:
                known = self._touch(name)
            try:
                blobs.append(self._path(name).read_bytes() if known else None)
            except FileNotFoundError:
                with self.lock:
                    self._forget(name)
                blobs.append(None)
            except OSError as e:
                raise StoreDown(f"reading {self._path(name)}: {e}") from e
        return blobs

    def put(self, name: bytes, blob: bytes) -> list[bytes]:
        with self.lock:
            if self._touch(name) or len(blob) > self.max_bytes:
                return []
        path = self._path(name)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            temporary.write_bytes(blob)
            os.replace(temporary, path)
        except OSError as e:
            temporary.unlink(missing_ok=True)
            raise StoreDown(f"writing {path}: {e}") from e
        with self.lock:
            evicted = self._add(name, len(blob))
        for old in evicted:
            self._path(old).unlink(missing_ok=True)
        return evicted


class RedisStore:
    """Entries as Redis strings under `prefix` + name. Redis bounds them itself (`maxmemory` with an
    LRU policy, the server's own setting); `ttl_s` (0: none) ages them out. Nothing is pinned: an
    entry Redis evicts mid-load is a miss. Connections carry the cluster's secret as the password
    (Redis AUTH) and TLS where the URL says `rediss://`."""

    kind, sealed = "shared", True

    def __init__(
        self,
        url: str,
        password: str | None = None,
        timeout_s: float = 0.5,
        ttl_s: float = 0,
        tls_ca: str | os.PathLike[str] | None = None,
        prefix: bytes = b"tandem:kv:",
    ) -> None:
        import redis  # only a worker with the shared tier needs it

        self._redis = redis
        tls = {"ssl_ca_certs": str(tls_ca)} if tls_ca is not None else {}
        self._client = redis.Redis.from_url(
            url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **tls
        )
        self.prefix, self.ttl_s = prefix, ttl_s

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._redis.RedisError as e:
            raise StoreDown(f"redis: {e}") from e

    def get_many(self, names: Sequence[bytes]) -> list[bytes | None]:
        if not names:
            return []
        return list(self._call(lambda: self._client.mget([self.prefix + n for n in names])))

    def put(self, name: bytes, blob: bytes) -> list[bytes]:
        expiry = int(self.ttl_s * 1000) or None
        self._call(lambda: self._client.set(self.prefix + name, blob, px=expiry, nx=True))
        return []  # Redis evicts by itself, untold

    def names(self) -> list[bytes]:
        return []  # not listed: every worker's, and Redis evicts untold

    def holds(self, name: bytes) -> bool:
        return bool(self._call(lambda: self._client.exists(self.prefix + name)))

    def pin(self, names: Sequence[bytes]) -> None:
        pass

    def unpin(self, names: Sequence[bytes]) -> None:
        pass
