"""The router replicas `tandem serve` runs beside its own router when `router.replicas` > 1: one
`tandem router` process each, bound to the same host and port (gRPC servers set SO_REUSEPORT on
Linux, so the kernel spreads connections over them) and attached to the same Ray cluster.

Lifecycle (`Replicas`):

    start     write their config to a file only this user reads; start every process, then wait
              for each one's "router NAME at ADDRESS" line on its stdout (it has attached to the
              cluster, bound the port and joined the registry)
    stop      SIGTERM to each (each drains for up to `router.shutdown_timeout_s`), wait, kill any
              still running, remove the file

On one host the replicas share the gRPC port only: the OpenAI HTTP face stays in `tandem serve`
(its calls reach every router through the shared port), and each replica serves /metrics on a
free port of its own, which `tandem status` lists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cluster.config import ClusterConfig, dump_config

TANDEM = (sys.executable, "-m", "cli.main")  # the `tandem` command of this interpreter


class ReplicaFailed(RuntimeError):
    """A replica exited before it served."""


def replica_config(config: ClusterConfig) -> ClusterConfig:
    """`config` for a replica on the same host: no HTTP face, /metrics on a free port."""
    router = config.router.model_copy(update={"http_port": None})
    telemetry = config.telemetry.model_copy(update={"metrics_port": 0})
    return config.model_copy(update={"router": router, "telemetry": telemetry})


def command(config_file: Path, port: int, ray_address: str, program: Sequence[str] = TANDEM) -> list[str]:
    """The command line of one replica."""
    return [*program, "router", "--config", str(config_file), "--port", str(port), "--ray-address", ray_address]


class Replicas:
    def __init__(self, processes: list[subprocess.Popen], config_file: Path, lines: list[str]) -> None:  # type: ignore[type-arg]
        self.processes = processes
        self.config_file = config_file
        self.lines = lines  # each replica's "router NAME at ADDRESS"

    @classmethod
    def start(
        cls, config: ClusterConfig, port: int, ray_address: str, count: int, program: Sequence[str] = TANDEM
    ) -> Replicas:
        fd, name = tempfile.mkstemp(prefix="tandem-router-", suffix=".json")  # mode 0600: it holds the secrets
        with os.fdopen(fd, "w") as f:
            f.write(dump_config(replica_config(config)))
        argv = command(Path(name), port, ray_address, program)
        processes = [
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True) for _ in range(count)
        ]
        replicas = cls(processes, Path(name), [])
        for process in processes:
            line = process.stdout.readline().strip()  # type: ignore[union-attr]
            if not line.startswith("router "):
                replicas.stop(timeout_s=10)
                raise ReplicaFailed(f"a router replica exited before serving (exit status {process.poll()})")
            replicas.lines.append(line)
        return replicas

    def terminate(self) -> None:
        """Asks every replica still running to drain and stop (SIGTERM)."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float) -> None:
        """Terminates the replicas, waits up to `timeout_s` for each, and kills any still running."""
        self.terminate()
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stdout.close()  # type: ignore[union-attr]
        self.config_file.unlink(missing_ok=True)
