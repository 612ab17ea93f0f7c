"""Every Ray call Tandem makes, in one thin module.

Lifecycle of a cluster (`start(config)` -> `RayCluster`):

    connect     join the Ray cluster at `config.ray_address`, or start a local one (the embedded
                default), in the `tandem` namespace
    controller  one detached-from-nothing actor, `controller`, holding the worker registry
    pools       per pool, a placement group of `replicas` bundles shaped by the pool's config (CPUs,
                GPUs, an optional custom resource naming its node group) with the pool's strategy,
                and one `WorkerActor` per bundle, named `prefill-0`, `decode-1`, ...; each builds
                its worker, starts its gRPC server and registers its address with the controller
    restart     Ray restarts a worker actor that dies; it registers its new address again
    shutdown    kill the actors, remove the placement groups, disconnect (stopping a local Ray)

Worker code is loaded by module name (`ROLES`): `cluster` does not import the worker packages,
the actors run them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.metrics import Gauge
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig, PoolConfig, dump_config

NAMESPACE = "tandem"
CONTROLLER = "controller"
ROLES = {"prefill": "prefill_worker.service", "decode": "decode_worker.service"}


@ray.remote(num_cpus=0)
class Controller:
    """The worker registry: name -> (role, gRPC address)."""

    def __init__(self) -> None:
        self._workers: dict[str, tuple[str, str]] = {}

    def register(self, name: str, role: str, address: str) -> None:
        self._workers[name] = (role, address)

    def unregister(self, name: str) -> None:
        self._workers.pop(name, None)

    def workers(self) -> dict[str, tuple[str, str]]:
        return dict(self._workers)


@ray.remote(max_restarts=-1)
class WorkerActor:
    """One prefill or decode worker: builds it from the config, serves gRPC, registers itself."""

    def __init__(self, role: str, name: str, config_json: str, host: str, namespace: str) -> None:
        config = ClusterConfig.model_validate_json(config_json)
        self.worker = importlib.import_module(ROLES[role]).from_config(config, name)
        node_ip = ray.util.get_node_ip_address() if host == "node" else host
        self.address = self.worker.start(f"{node_ip}:0").replace("127.0.0.1", node_ip)
        ray.get_actor(CONTROLLER, namespace=namespace).register.remote(name, role, self.address)
        threading.Thread(target=self._mirror_metrics, args=(name, role), daemon=True).start()

    def _mirror_metrics(self, name: str, role: str, interval_s: float = 2.0) -> None:
        """The worker's load gauges, also through Ray's metrics (the Ray dashboard shows them)."""
        tags = ("worker", "role")
        gauges = {
            "kv_cache_usage": Gauge("tandem_kv_cache_usage", "Share of KV blocks in use.", tags),
            "running_seqs": Gauge("tandem_running_seqs", "Sequences in the running batch.", tags),
            "waiting_seqs": Gauge("tandem_waiting_seqs", "Sequences waiting.", tags),
            "queued_prompt_tokens": Gauge("tandem_queued_prompt_tokens", "Prompt tokens waiting.", tags),
        }
        while True:
            load = self.worker.load()
            values = {
                "kv_cache_usage": 1 - load.free_kv_blocks / max(load.total_kv_blocks, 1),
                "running_seqs": load.running_seqs,
                "waiting_seqs": load.waiting_seqs,
                "queued_prompt_tokens": load.queued_prompt_tokens,
            }
            for key, gauge in gauges.items():
                gauge.set(values[key], tags={"worker": name, "role": role})
            time.sleep(interval_s)

    def get_address(self) -> str:
        return self.address

    def load(self) -> bytes:
        return self.worker.load().SerializeToString()

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.worker.stop()


@dataclass
class RayCluster:
    config: ClusterConfig
    namespace: str
    controller: Any
    actors: dict[str, Any] = field(default_factory=dict)
    groups: list[PlacementGroup] = field(default_factory=list)
    started_ray: bool = False

    def discover(self) -> dict[str, str]:
        """name -> gRPC address of every registered worker (for the router)."""
        return {name: address for name, (_, address) in ray.get(self.controller.workers.remote()).items()}

    def roles(self) -> dict[str, str]:
        return {name: role for name, (role, _) in ray.get(self.controller.workers.remote()).items()}

    def kill_worker(self, name: str) -> None:
        """Kills a worker's process as a crash would (Ray restarts it)."""
        ray.kill(self.actors[name], no_restart=False)

    def shutdown(self) -> None:
        for actor in reversed(self.actors.values()):  # prefill first: its KV channels close before decode stops
            with contextlib.suppress(Exception):  # a worker that is already gone has nothing to stop
                ray.get(actor.stop.remote(), timeout=10)
            ray.kill(actor, no_restart=True)
        for group in self.groups:
            remove_placement_group(group)
        ray.kill(self.controller, no_restart=True)
        if self.started_ray:
            ray.shutdown()


def start(config: ClusterConfig, namespace: str = NAMESPACE, timeout_s: float = 300.0, **ray_init: Any) -> RayCluster:
    """Connects to (or starts) Ray and brings up the controller and both pools in `namespace`
    (one cluster per namespace)."""
    started = not ray.is_initialized()
    if started:
        ray.init(address=config.ray_address, namespace=namespace, **ray_init)
    controller = Controller.options(name=CONTROLLER, namespace=namespace, get_if_exists=True).remote()
    cluster = RayCluster(config, namespace, controller, started_ray=started)
    host = "127.0.0.1" if config.ray_address is None else "node"
    try:
        for role, pool in (("decode", config.decode), ("prefill", config.prefill)):
            _start_pool(cluster, role, pool, host, timeout_s)
        ray.get([a.get_address.remote() for a in cluster.actors.values()], timeout=timeout_s)
    except Exception:
        cluster.shutdown()
        raise
    return cluster


def _start_pool(cluster: RayCluster, role: str, pool: PoolConfig, host: str, timeout_s: float) -> None:
    if pool.replicas == 0:
        return
    bundle: dict[str, float] = {"CPU": pool.num_cpus}
    if pool.num_gpus:
        bundle["GPU"] = pool.num_gpus
    if pool.resource:
        bundle[pool.resource] = 1
    group = placement_group([dict(bundle) for _ in range(pool.replicas)], strategy=pool.placement_strategy)
    cluster.groups.append(group)
    ray.get(group.ready(), timeout=timeout_s)
    config_json = dump_config(cluster.config)
    for i in range(pool.replicas):
        name = f"{role}-{i}"
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
        cluster.actors[name] = WorkerActor.options(
            name=name,
            namespace=cluster.namespace,
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
            resources={pool.resource: 1} if pool.resource else None,
            scheduling_strategy=strategy,
        ).remote(role, name, config_json, host, cluster.namespace)
