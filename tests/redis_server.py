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
    def __init__(
        self,
        directory: Path,
        password: str = "test-secret",
        maxmemory: str = "64mb",
        tls: dict | None = None,
        policy: str = "allkeys-lru",
    ) -> None:
        """`tls`: {"ca", "cert", "key"} (`cluster.tls.generate_dev_certs`) serves TLS only; `policy`: what
        Redis does past `maxmemory` (a store of tables that must not lose a key: "noeviction")."""
        self.directory, self.password, self.maxmemory, self.tls = directory, password, maxmemory, tls
        self.policy = policy
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS is not None
        args = [REDIS, "--bind", "127.0.0.1", "--requirepass", self.password]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(self.tls["cert"]), "--tls-key-file", str(self.tls["key"])]
            args += ["--tls-ca-cert-file", str(self.tls["ca"])]
        else:
            args += ["--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        tls = {"ssl_ca_certs": str(self.tls["ca"])} if self.tls else {}
        client = redis.Redis.from_url(self.url, password=self.password, socket_timeout=1, **tls)
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
