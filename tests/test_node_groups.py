"""Placement across node groups on one machine: Ray's fake multi-node autoscaling cluster with a
`prefill` and a `decode` node type and no worker nodes at start. Tandem's pending workers make
Ray add a node of each type; every prefill worker lands on a `prefill` node and every decode
worker on a `decode` node; scaling the decode pool up adds `decode` nodes only."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
from ray._private import state as ray_state
from ray._private.authentication.authentication_token_setup import _enable_token_auth, ensure_token_if_auth_enabled
from ray.cluster_utils import AutoscalingCluster

from cluster.config import parse_config
from cluster.pools import ray_cluster
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"

pytestmark = [pytest.mark.slow, pytest.mark.ray]


class NodeGroups(AutoscalingCluster):
    """Ray's fake multi-node autoscaling cluster, with its base config written here (the wheel does
    not ship the example file the harness reads). Ray's own `start` and `shutdown` stop every Ray on
    the machine first (a forced stop of all its processes); these start the head in a temp dir of its
    own, on a port of its own, and stop only the processes of that dir (the fake nodes share it). The
    head runs no dashboard: the test reads nodes and actors from the GCS (a dashboard that registers
    late on a loaded machine made Ray's state API give up)."""

    def start(self, _system_config=None, override_env=None):  # type: ignore[no-untyped-def]
        self.temp_dir = tempfile.mkdtemp(prefix="tng-", dir="/tmp")  # short: Ray's socket paths are bounded
        self.gcs_address = f"{ray.util.get_node_ip_address()}:{free_port()}"  # where Ray's head binds
        self._config["provider"]["gcs_address"] = self.gcs_address
        config = Path(self.temp_dir) / "autoscaling.json"
        config.write_text(json.dumps(self._config))
        ray_bin = Path(sys.executable).parent / "ray"
        command = [str(ray_bin), "start", "--head", f"--autoscaling-config={config}", f"--temp-dir={self.temp_dir}"]
        command += [f"--port={self.gcs_address.split(':')[1]}", "--num-cpus=1", "--include-dashboard=false"]
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"}
        subprocess.run(command, env=env, check=True, capture_output=True)

    def shutdown(self) -> None:
        own = [pid for pid in _pids() if self.temp_dir in _cmdline(pid)]
        for sig, grace_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
            for pid in own:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while (own := [p for p in own if Path(f"/proc/{p}").exists()]) and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        return {
            "cluster_name": "tandem-node-groups",
            "max_workers": 8,
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
            },
            "available_node_types": {
                **worker_node_types,
                "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
            },
            "head_node_type": "ray.head.default",
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": 5,
            **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands")},
            **{k: [] for k in ("worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")},
            "auth": {},
            "docker": {},
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
            **config_kwargs,
        }


def _pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and int(d.name) != os.getpid()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def gcs_log_tail(temp_dir: str, lines: int = 40) -> str:
    logs = Path(temp_dir, "session_latest", "logs")
    text = "".join(logs.joinpath(name).read_text(errors="replace") for name in ("gcs_server.out", "gcs_server.err"))
    return "\n".join([line for line in text.splitlines() if "ctor" in line or "ERROR" in line][-lines:])


def node_type(resources: dict) -> str:
    return "prefill" if "prefill" in resources else "decode" if "decode" in resources else "head"


def alive_nodes() -> dict[str, str]:
    """Node id -> its type, for the live nodes of the Ray this process is connected to (from its GCS)."""
    return {n["NodeID"]: node_type(n["Resources"]) for n in ray.nodes() if n["Alive"]}


def placement() -> dict[str, str]:
    """Each live worker actor's name -> the type of the node it runs on."""
    nodes = alive_nodes()
    return {
        a["Name"]: nodes.get(a["Address"]["NodeID"], "?")
        for a in ray_state.actors(actor_state_name="ALIVE").values()
        if a["Name"].startswith(("prefill-", "decode-"))
    }


@pytest.fixture(scope="module")
def autoscaling_ray():
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # the `ray` command
    fake = NodeGroups(
        head_resources={"CPU": 1},
        worker_node_types={
            "prefill_group": {
                "resources": {"CPU": 1, "prefill": 1},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
            "decode_group": {
                "resources": {"CPU": 1, "decode": 1},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 3,
            },
        },
    )
    # Token auth on for the head, its fake nodes and this process alike: Ray's own local `ray.init` turns it
    # on in this process for good (another module may have run one), so both sides agree either way
    _enable_token_auth()
    ensure_token_if_auth_enabled(create_token_if_missing=True)
    fake.start()
    ray.init(fake.gcs_address, namespace="tandem-node-groups", log_to_driver=False)
    yield fake
    ray.shutdown()
    fake.shutdown()


def test_pools_land_on_their_node_groups_and_scale_only_theirs(autoscaling_ray):
    assert set(alive_nodes().values()) == {"head"}, "no worker nodes at start"
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"num_blocks": 64},
            "ray_address": "auto",  # joins the Ray this process is connected to
            "prefill": {"num_cpus": 1, "resource": "prefill"},
            "decode": {"num_cpus": 1, "resource": "decode", "autoscaling": {"min_replicas": 1, "max_replicas": 2}},
        }
    )
    try:
        cluster = ray_cluster.start(config, namespace="tandem-node-groups", timeout_s=240, bind_host="127.0.0.1")
    except ray.exceptions.RayError as e:  # what Ray's control store said about it, for whoever reads the failure
        raise AssertionError(
            f"the pools did not start; Ray's GCS log ends:\n{gcs_log_tail(autoscaling_ray.temp_dir)}"
        ) from e
    try:
        assert placement() == {"prefill-0": "prefill", "decode-0": "decode"}
        assert sorted(alive_nodes().values()) == ["decode", "head", "prefill"], "Ray added one node of each group"

        cluster.scale("decode", 2)
        deadline = time.monotonic() + 240
        while len(cluster.discover()) < 3 and time.monotonic() < deadline:
            time.sleep(1)
        assert placement() == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
        alive = list(alive_nodes().values())
        assert alive.count("decode") == 2 and alive.count("prefill") == 1, "scaling decode added decode nodes only"
    finally:
        cluster.shutdown()
