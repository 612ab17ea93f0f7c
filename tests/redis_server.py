"""A real Redis for tests: Debian's `redis-server` on loopback, with a password (the cluster's secret
in a worker's config), nothing persisted, LRU eviction past `maxmemory`. `make test` installs the
package where it is absent."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.net import free_port

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="no redis-server binary (apt-get install redis-server)")


class RedisServer:
    def __init__(self, directory: Path, password: str = "test-secret", maxmemory: str = "64mb") -> None:
        self.directory, self.password, self.maxmemory = directory, password, maxmemory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS is not None
        args = [REDIS, "--bind", "127.0.0.1", "--port", str(self.port), "--requirepass", self.password]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None
