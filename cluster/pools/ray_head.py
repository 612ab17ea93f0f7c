"""The local Ray head that `tandem serve` (or `tandem control`) starts, with `ray_ha.redis_address`:
its GCS keeps its tables in Redis, and one that dies is started again here and reads them back.

Ray itself restarts no GCS: on Kubernetes KubeRay restarts the head pod; for a head that this process
started, this process is the only one that can. `GcsKeeper` looks at the GCS process every
`interval_s` and, once it has exited, runs its command line again (on the port the first one bound,
in the same session, on the same Redis prefix). Meanwhile the raylet, the actors and the workers run
on, and routers serve on, degraded if it takes long (`cluster.lifeline`); the raylet reconnects to the
new GCS, which finds every actor in Redis.

The new GCS is started without a Python step between fork and exec (Ray's own start runs one, which in
a process whose gRPC threads are running can crash the child before it execs): `setpriv` gives it
what Ray's step did, death with its parent (the keeper thread, which lives as long as this process),
and a session of its own keeps a terminal's Ctrl-C from reaching it.

`redis_options` is what the head needs before `ray.init` starts it (Ray reads `RAY_REDIS_ADDRESS` and its
key prefix from the environment); `forget` deletes its tables once it has shut down.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import uuid
from typing import Any

import ray
from ray._private import ray_constants

from cluster.config import RayHAConfig

log = logging.getLogger("tandem.ray_head")
PASSWORD_ENV = "TANDEM_RAY_REDIS_PASSWORD"


def redis_password(ha: RayHAConfig) -> str:
    return ha.redis_password.get_secret_value() if ha.redis_password else os.environ.get(PASSWORD_ENV, "")


def redis_options(ha: RayHAConfig) -> tuple[dict[str, Any], str]:
    """Sets the environment a local head reads its Redis from: its address, and a key prefix of this
    head's own (two heads on one Redis never share tables). Returns `ray.init`'s options, and the prefix."""
    assert ha.redis_address is not None
    prefix = f"tandem-{uuid.uuid4().hex[:12]}"
    os.environ["RAY_REDIS_ADDRESS"] = ha.redis_address
    os.environ["RAY_external_storage_namespace"] = prefix  # noqa: SIM112 (Ray's own spelling)
    password = redis_password(ha)
    return ({"_redis_password": password} if password else {}), prefix


def forget(ha: RayHAConfig, prefix: str) -> None:
    """Deletes a head's tables from Redis once it has shut down."""
    from ray._private.gcs_utils import cleanup_redis_storage

    assert ha.redis_address is not None
    host, port = ha.redis_address.rsplit(":", 1)
    try:
        cleanup_redis_storage(host, int(port), redis_password(ha), False, prefix)
    except Exception:  # Redis gone too: the keys stay, under a prefix no head will use again
        log.warning("could not delete Ray's tables (%s) from Redis at %s", prefix, ha.redis_address, exc_info=True)


class GcsKeeper:
    """Starts the GCS of the head this process started again whenever it has exited."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.node = ray._private.worker._global_node  # the head this process started
        (gcs,) = self.node.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER]
        port = self.node.gcs_address.rsplit(":", 1)[1]  # the one it bound (Ray starts it on port 0)
        self.command = [
            f"--gcs_server_port={port}" if str(arg).startswith("--gcs_server_port=") else str(arg)
            for arg in gcs.process.args
        ]
        self.interval_s = interval_s
        self._stopped = threading.Event()

    def check(self) -> bool:
        """Starts the GCS again if it has exited; True if it did."""
        processes = self.node.all_processes
        (gcs,) = processes[ray_constants.PROCESS_TYPE_GCS_SERVER]
        if gcs.process.poll() is None:
            return False
        log.warning("Ray's GCS exited (status %s); starting it again from Redis", gcs.process.returncode)
        setpriv = shutil.which("setpriv")
        die_with_us = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        process = subprocess.Popen(
            die_with_us + self.command,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        processes[ray_constants.PROCESS_TYPE_GCS_SERVER] = [gcs._replace(process=process)]  # Ray's shutdown kills it
        return True

    def start(self) -> GcsKeeper:
        """Checks on a thread of its own, for as long as this process lives: the GCSes it starts die
        with that thread. After `stop` it only waits."""

        def loop() -> None:
            while True:
                self._stopped.wait(self.interval_s)
                if self._stopped.is_set():
                    threading.Event().wait()
                try:
                    self.check()
                except Exception:  # a failed start is tried again on the next round
                    log.exception("starting Ray's GCS again failed")

        threading.Thread(target=loop, daemon=True, name="gcs-keeper").start()
        return self

    def stop(self) -> None:
        self._stopped.set()
