"""Every Ray call Tandem makes, in one thin module.

Lifecycle of a cluster (`start(config)` -> `RayCluster`):

    connect     join the Ray cluster at `config.ray_address`, or start a local one (the embedded
                default), in the `tandem` namespace
    registry    one actor, `controller` (`cluster.pools.registry.Registry`): the workers' and
                routers' addresses, and each live router's latest status report
    pools       one `PoolActor` per pool (`pool-prefill`, `pool-decode`) running that pool's
                `cluster.pools.controller.PoolController`: it starts the pool's workers, then every
                `autoscaling.interval_s` reads their load, decides, starts or drains workers
    workers     one `WorkerActor` each, named `prefill-0`, `decode-1`, ..., asking for its pool's
                shape (CPUs, GPUs, an optional custom resource naming its node group) and placed
                by the pool's strategy; a worker that Ray cannot place yet is pending resource
                demand, which Ray's autoscaler (KubeRay on Kubernetes) answers with a node of the
                right group. Each builds its worker, serves gRPC and registers its address.
    restart     Ray restarts a worker actor that dies; it registers its new address again
    probe       `probe()` asks Ray's GCS whether it is alive (`cluster.lifeline` watches it)
    shutdown    stop the pools (and their workers), the registry, and a local Ray; a cluster
                whose GCS is gone (`reachable=False`) only stops the local Ray

Any number of router processes join a running cluster with `attach(config)`: it finds the named
registry and pools and creates nothing, so its `shutdown` leaves them running.

Worker code is loaded by module name (`ROLES`): `cluster` does not import the worker packages,
the actors run them. A call to a named actor that Ray cannot make raises
`cluster.lifeline.ClusterUnavailable` with Tandem's message, never Ray's own exception.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from tandem.v1 import worker_pb2

from cluster import startup
from cluster.config import ClusterConfig, dump_config
from cluster.engine import core_process
from cluster.lifeline import ClusterUnavailable
from cluster.pools import ray_head
from cluster.pools.controller import PoolController
from cluster.pools.ray_observe import local_ray_options, mirror_load, ray_metric, zero
from cluster.pools.registry import REGISTER_EVERY_S, ROUTER, Registry, fleet_latency

NAMESPACE = "tandem"
CONTROLLER = "controller"
ROLES = {"prefill": "prefill_worker.service", "decode": "decode_worker.service"}
POOLS = ("decode", "prefill")
# The registry: the workers' and routers' addresses and the routers' status reports.
Controller = ray.remote(num_cpus=0, max_restarts=-1)(Registry)  # started again, the workers and routers refill it


WORKER_FATAL_EXIT = 70  # a worker process's exit status when its worker cannot go on (its engine core died)


def _exit_for_a_restart() -> None:
    """The worker cannot go on: its process exits, so Ray starts the actor again (the routers have
    moved its requests once their streams broke)."""
    logging.getLogger("tandem.cluster").error("this worker cannot go on; exiting so that Ray restarts it")
    logging.shutdown()
    os._exit(WORKER_FATAL_EXIT)


@ray.remote(max_restarts=-1)
class WorkerActor:
    """One prefill or decode worker: builds it from the config, serves gRPC, registers itself."""

    def __init__(self, role: str, name: str, config_json: str, host: str, namespace: str, asked_at: float) -> None:
        startup.note(startup.Phase("Ray: placed, process started", time.time() - asked_at))
        config = ClusterConfig.model_validate_json(config_json)
        with startup.phase("imports"):
            service = importlib.import_module(ROLES[role])
        if config.scheduler.engine_core == "process":  # its core forks from this process, which has only imported
            core_process.fork_next_core(getattr(ray._raylet, "setproctitle", lambda title: None))
        self.worker = service.from_config(config, name)
        self.worker.on_fatal = _exit_for_a_restart
        node_ip = ray.util.get_node_ip_address() if host == "node" else host
        with startup.phase("gRPC server"):
            self.address = self.worker.start(f"{node_ip}:0").replace("127.0.0.1", node_ip)
        registry = ray.get_actor(CONTROLLER, namespace=namespace)
        registry.register.remote(name, role, self.address)
        threading.Thread(target=mirror_load, args=(self.worker.load, name, role), daemon=True).start()
        threading.Thread(target=self._keep_registered, args=(registry, name, role), daemon=True).start()
        # Where this start spent its time, from the pool's ask (`asked_at`, the wall clock of the
        # pool's node: on another node the clocks' offset counts in the first part) to ready.
        self.startup = startup.Phase(name, time.time() - asked_at, startup.taken())

    def _keep_registered(self, registry: Any, name: str, role: str) -> None:
        """Registers again every `REGISTER_EVERY_S`: a registry that Ray started again learns of this
        worker (a call that cannot be made now is simply the next one's to make)."""
        while True:
            time.sleep(REGISTER_EVERY_S)
            with contextlib.suppress(Exception):
                registry.register.remote(name, role, self.address)

    def get_address(self) -> str:
        return self.address

    def started(self) -> startup.Phase:
        """Where this worker's start spent its time (after a restart, Ray's part counts from the first ask)."""
        return self.startup

    def load(self) -> bytes:
        return self.worker.load().SerializeToString()

    def drain(self) -> int:
        """Stops taking new work; returns the sequences and transfers still on this worker."""
        return self.worker.Drain(worker_pb2.DrainRequest(), None).remaining_seqs

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.worker.stop()


class _RayWorkers:
    """`cluster.pools.controller.WorkerOps` over Ray actors."""

    def __init__(self, role: str, config: ClusterConfig, namespace: str, host: str) -> None:
        self.role, self.config, self.namespace, self.host = role, config, namespace, host
        self.pool = config.decode if role == "decode" else config.prefill
        self.actors: dict[str, Any] = {}
        self._latency: tuple[float | None, float | None] = (None, None)
        self._config_json = dump_config(config)

    def start(self, name: str) -> None:
        pool = self.pool
        self.actors[name] = WorkerActor.options(
            name=name,
            namespace=self.namespace,
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
            resources={pool.resource: 1} if pool.resource else None,
            scheduling_strategy="SPREAD" if pool.placement_strategy == "SPREAD" else "DEFAULT",
        ).remote(self.role, name, self._config_json, self.host, self.namespace, time.time())

    def load(self, name: str) -> worker_pb2.WorkerLoad | None:
        try:
            return worker_pb2.WorkerLoad.FromString(ray.get(self.actors[name].load.remote(), timeout=5))
        except Exception:  # starting, pending placement, or restarting
            return None

    def drain(self, name: str) -> int:
        """What remains on the worker; -1 while it cannot answer (starting, restarting, pending)."""
        try:
            return int(ray.get(self.actors[name].drain.remote(), timeout=30))
        except Exception:
            return -1

    def stop(self, name: str) -> None:
        actor = self.actors.pop(name, None)
        if actor is None:
            return
        with contextlib.suppress(Exception):  # a worker that is already gone has nothing to stop
            ray.get(actor.stop.remote(), timeout=10)
        ray.kill(actor, no_restart=True)
        ray.get_actor(CONTROLLER, namespace=self.namespace).unregister.remote(name)

    def latency(self) -> tuple[float | None, float | None]:
        return self._latency

    def refresh_latency(self) -> None:
        """Reads the routers' recent TTFT and TPOT from their reports in the registry (outside the
        pool's lock, so a slow registry never holds up a scale or status call)."""
        try:
            registry = ray.get_actor(CONTROLLER, namespace=self.namespace)
            reports = ray.get(registry.router_reports.remote(), timeout=5)
        except Exception:  # the registry is restarting: no latency signal this round
            self._latency = (None, None)
            return
        self._latency = fleet_latency(report for _, report in reports)


@ray.remote(num_cpus=0, max_concurrency=4)
class PoolActor:
    """One pool's controller: starts its workers, then reconciles every `autoscaling.interval_s`."""

    def __init__(self, role: str, config_json: str, namespace: str, host: str) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        config = ClusterConfig.model_validate_json(config_json)
        self.ops = _RayWorkers(role, config, namespace, host)
        pool = config.decode if role == "decode" else config.prefill
        self.controller = PoolController(role, pool, config.slo, self.ops)
        self.interval_s = pool.autoscaling.interval_s
        self._decisions = ray_metric("tandem_scaling_decisions")
        for direction in ("up", "down"):
            zero(self._decisions, {"pool": role, "direction": direction})
        self._size = {key: ray_metric(f"tandem_pool_{key}") for key in ("workers", "target")}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self, timeout_s: float) -> list[startup.Phase]:
        """Starts the pool's first workers; returns where each one's start spent its time."""
        with self._lock:
            names = self.controller.start()
        started = ray.get([self.ops.actors[n].started.remote() for n in names], timeout=timeout_s)
        self._report_size()
        threading.Thread(target=self._loop, daemon=True).start()
        return started

    def scale(self, replicas: int | None) -> bytes:
        with self._lock:
            self.controller.set_override(replicas)
            self.controller.tick()
            return self.controller.status().SerializeToString()

    def plan(self, planned: int | None) -> bytes:
        with self._lock:
            self.controller.set_plan(planned)
            self.controller.tick()
            return self.controller.status().SerializeToString()

    def drain(self, name: str) -> None:
        with self._lock:
            self.controller.begin_drain(name)

    def status(self) -> bytes:
        with self._lock:
            return self.controller.status().SerializeToString()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self.controller.stop_all()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.ops.refresh_latency()
            with self._lock:
                before = (self.controller.scale_ups, self.controller.scale_downs)
                try:
                    self.controller.tick()
                except Exception:  # one bad tick must not end autoscaling
                    logging.getLogger("tandem.autoscaler").exception("%s pool: tick failed", self.controller.role)
                after = (self.controller.scale_ups, self.controller.scale_downs)
            for direction, b, a in (("up", before[0], after[0]), ("down", before[1], after[1])):
                if a > b:
                    self._decisions.inc(a - b, tags={"pool": self.controller.role, "direction": direction})
            self._report_size()

    def _report_size(self) -> None:
        with self._lock:
            status = self.controller.status()
        tags = {"pool": self.controller.role}
        self._size["workers"].set(len(status.workers), tags=tags)
        self._size["target"].set(status.target, tags=tags)


@dataclass
class RayCluster:
    """Handles on one cluster's named actors ("controller", "pool-decode", "pool-prefill").
    `owned`: this process created them (`start`) and `shutdown` removes them; otherwise it joined
    them (`attach`) and `shutdown` leaves them running."""

    config: ClusterConfig
    namespace: str
    actors: dict[str, Any]
    owned: bool = True
    started_ray: bool = False
    known: dict[str, str] = field(default_factory=dict)  # the registry's last answer
    gcs_answers: bool = True  # as the lifeline last found it (`cli.serve._watch_ray`)
    keeper: Any = None  # the `ray_head.GcsKeeper` of a local head whose GCS keeps its tables in Redis
    redis_prefix: str | None = None  # those tables' key prefix
    gcs_address: str = field(default_factory=lambda: str(ray.get_runtime_context().gcs_address))

    def discover(self) -> dict[str, str]:
        """name -> gRPC address of every registered worker (for the router). While the registry is
        out of reach (its owner is starting it again), the last answer it gave: the workers' own
        Watch streams tell the router which of them are alive. While Ray's GCS is silent, the last
        answer without asking (a call could wait for Ray's own timeouts)."""
        if not self.gcs_answers:
            return dict(self.known)
        try:
            self.known = {name: address for name, (_, address) in self._ask(CONTROLLER, "workers").items()}
        except ClusterUnavailable:
            logging.getLogger("tandem.cluster").warning("the registry is out of reach", exc_info=True)
        return dict(self.known)

    def register_router(self, name: str, address: str) -> None:
        self._ask(CONTROLLER, "register", name, ROUTER, address)

    def unregister_router(self, name: str) -> None:
        self._ask(CONTROLLER, "unregister", name)

    def report_router(self, name: str, report: bytes) -> None:
        self._ask(CONTROLLER, "report", name, report)

    def router_reports(self) -> list[tuple[float, bytes]]:
        """(age in seconds, `RouterStatus` bytes) of every live router."""
        return list(self._ask(CONTROLLER, "router_reports"))

    def address(self) -> str:
        """Where another process joins this Ray cluster: the config's Ray Client address, or the
        address of the cluster's GCS."""
        if self.config.ray_address and self.config.ray_address.startswith("ray://"):
            return self.config.ray_address
        return str(ray.get_runtime_context().gcs_address)

    def scale(self, role: str, replicas: int | None) -> worker_pb2.PoolStatus:
        """Holds a pool at `replicas` workers (None gives it back to its autoscaler)."""
        if f"pool-{role}" not in self.actors:
            raise ValueError(f"no pool {role!r} (pools: {', '.join(POOLS)})")
        return worker_pb2.PoolStatus.FromString(self._ask(f"pool-{role}", "scale", replicas))

    def plan(self, role: str, planned: int | None) -> worker_pb2.PoolStatus:
        """Gives a pool the planner's target (None clears it): the predictive autoscaler."""
        if f"pool-{role}" not in self.actors:
            raise ValueError(f"no pool {role!r} (pools: {', '.join(POOLS)})")
        return worker_pb2.PoolStatus.FromString(self._ask(f"pool-{role}", "plan", planned))

    def pool_status(self) -> list[worker_pb2.PoolStatus]:
        return [worker_pb2.PoolStatus.FromString(self._ask(f"pool-{role}", "status")) for role in POOLS]

    def drain(self, name: str) -> None:
        self._ask(f"pool-{name.rsplit('-', 1)[0]}", "drain", name)

    def actor(self, name: str) -> Any:
        return ray.get_actor(name, namespace=self.namespace)

    def kill_worker(self, name: str) -> None:
        """Kills a worker's process as a crash would (Ray restarts it)."""
        ray.kill(self.actor(name), no_restart=False)

    def probe(self) -> None:
        """Returns when Ray's GCS answers within a second; raises ClusterUnavailable otherwise.
        (Ray's public calls that reach the GCS, such as `ray.nodes()`, retry for a minute; the GCS
        client's `check_alive` is the bounded call `ray symmetric-run` uses.)"""
        try:
            ray._private.worker.global_worker.gcs_client.check_alive([], timeout=1)
        except Exception as e:
            raise ClusterUnavailable(f"the Ray cluster is gone: its GCS at {self.gcs_address} does not answer") from e

    def shutdown(self, reachable: bool = True) -> None:
        """Stops what this handle owns. `reachable=False` (the GCS is gone): no actor can be
        stopped, so only a local Ray that this process started is shut down."""
        if self.owned and reachable:
            for role in ("prefill", "decode"):  # prefill first: its KV channels close before decode stops
                if (pool := self.actors.get(f"pool-{role}")) is not None:
                    with contextlib.suppress(Exception):
                        ray.get(pool.stop.remote(), timeout=60)
                    ray.kill(pool, no_restart=True)
            ray.kill(self.actors[CONTROLLER], no_restart=True)
        if self.keeper is not None:
            self.keeper.stop()
        if self.started_ray:
            ray.shutdown()
        if self.redis_prefix is not None:
            ray_head.forget(self.config.ray_ha, self.redis_prefix)

    def _ask(self, actor: str, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """Calls a method of one of the cluster's actors. An attached handle whose actor died (the
        process that owns the cluster started it again under its name) looks it up again, once.
        An error the method raised comes back as it is; Ray's failing to make the call is
        ClusterUnavailable."""
        if not ray.is_initialized():  # shut down: any Ray call would start a new local Ray (auto-init)
            raise ClusterUnavailable(f"the cluster's {actor} actor cannot be reached: this process left Ray")
        try:
            return self._call(actor, method, *args, timeout_s=timeout_s)
        except ray.exceptions.RayTaskError:
            raise
        except (ray.exceptions.RayError, ValueError) as e:  # ValueError: no actor under that name
            raise ClusterUnavailable(
                f"the cluster's {actor} actor cannot be reached ({type(e).__name__}); is the Ray cluster up?"
            ) from e

    def _call(self, actor: str, method: str, *args: Any, timeout_s: float) -> Any:
        try:
            return ray.get(getattr(self.actors[actor], method).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            if self.owned:
                raise
            self.actors[actor] = ray.get_actor(actor, namespace=self.namespace)
            return ray.get(getattr(self.actors[actor], method).remote(*args), timeout=timeout_s)


def start(
    config: ClusterConfig,
    namespace: str = NAMESPACE,
    timeout_s: float = 300.0,
    bind_host: str | None = None,
    **ray_init: Any,
) -> RayCluster:
    """Connects to (or starts) Ray and brings up the registry and both pools in `namespace`
    (one cluster per namespace). Workers serve on `bind_host`; by default loopback for a local
    Ray and their node's address on a multi-node cluster."""
    started = not ray.is_initialized()
    head_ha = started and config.ray_address is None and config.ray_ha.redis_address is not None
    prefix = None
    if started:
        local = local_ray_options(config.ray_ha.reconnect_timeout_s) if config.ray_address is None else {}
        if head_ha:  # the GCS keeps its tables in Redis, and is started again when it dies
            redis, prefix = ray_head.redis_options(config.ray_ha)
            local.update(redis)
        with startup.phase("Ray"):
            # "local": unset, a Ray of its own, never one `ray start` left running on this machine (which
            # `ray.init` would otherwise join, as it would an address in RAY_ADDRESS)
            address = config.ray_address or "local"
            ray.init(address=address, namespace=namespace, **{**local, **ray_init})
    controller = Controller.options(name=CONTROLLER, namespace=namespace, get_if_exists=True).remote()
    cluster = RayCluster(config, namespace, {CONTROLLER: controller}, started_ray=started)
    if head_ha:
        cluster.keeper, cluster.redis_prefix = ray_head.GcsKeeper().start(), prefix
    host = bind_host or ("127.0.0.1" if config.ray_address is None else "node")
    try:
        config_json = dump_config(config)
        pools = [
            PoolActor.options(name=f"pool-{role}", namespace=namespace).remote(role, config_json, namespace, host)
            for role in POOLS
        ]
        cluster.actors.update({f"pool-{role}": pool for role, pool in zip(POOLS, pools, strict=True)})
        began = time.perf_counter()
        workers = ray.get([pool.start.remote(timeout_s) for pool in pools], timeout=timeout_s)
        startup.note(startup.Phase("pools", time.perf_counter() - began, [w for pool in workers for w in pool]))
    except Exception:
        cluster.shutdown()
        raise
    return cluster


def attach(
    config: ClusterConfig, address: str | None = None, namespace: str = NAMESPACE, timeout_s: float = 60.0
) -> RayCluster:
    """Joins the cluster another process started in `namespace` (`tandem control` or `tandem
    serve`): connects to Ray at `address` (default: `config.ray_address`, else the local node's
    cluster) and waits up to `timeout_s` for the registry and both pools to exist. It creates
    nothing, so the returned handle's `shutdown` leaves them running."""
    started = not ray.is_initialized()
    deadline = time.monotonic() + timeout_s
    if started:
        _connect(address or config.ray_address or "auto", namespace, deadline)
    try:
        actors = _find([CONTROLLER, *(f"pool-{role}" for role in POOLS)], namespace, deadline - time.monotonic())
    except TimeoutError:
        if started:
            ray.shutdown()
        raise
    return RayCluster(config, namespace, actors, owned=False, started_ray=started)


def _connect(address: str, namespace: str, deadline: float) -> None:
    """Joins Ray at `address` once its GCS answers, waiting until `deadline` for one that does not yet
    (a head that is restarting) and saying so: `ray.init` itself would retry for minutes without a
    word. The workers' logs go to the process that owns the cluster, not to every router."""
    from ray._private.services import canonicalize_bootstrap_address

    gcs = canonicalize_bootstrap_address(address) if address == "auto" else address
    said = 0.0
    while not address.startswith("ray://") and (gcs is None or not _answers(gcs)):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterUnavailable(f"Ray's GCS at {gcs or 'this node'} did not answer: is its head running?")
        if time.monotonic() - said >= 5:
            said = time.monotonic()
            logging.getLogger("tandem.cluster").warning(
                "Ray's GCS at %s does not answer yet; waiting %.0f s more for it", gcs or "this node", left
            )
        time.sleep(min(1.0, left))
        gcs = gcs or canonicalize_bootstrap_address(address)
    # Ray asks a process that joins for its token (a local head made one: ~/.ray/auth_token) only where
    # RAY_AUTH_MODE says so; this user's token, where there is one, goes with every call
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    ray.init(address=address, namespace=namespace, log_to_driver=False)


def _answers(gcs: str, timeout_s: float = 5.0) -> bool:
    """Whether a gRPC server answers at `gcs` (a connection made and its first frames exchanged), on a
    connection of its own: never one in gRPC's backoff after an earlier try failed."""
    import grpc

    with grpc.insecure_channel(gcs, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            return True
        except grpc.FutureTimeoutError:
            return False


def _find(names: list[str], namespace: str, timeout_s: float) -> dict[str, Any]:
    """Handles on the named actors, waiting up to `timeout_s` for those not created yet."""
    actors: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for name in names:
            if name not in actors:
                with contextlib.suppress(ValueError):  # no such actor (yet)
                    actors[name] = ray.get_actor(name, namespace=namespace)
        lacking = [name for name in names if name not in actors]
        if not lacking:
            return actors
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no {', '.join(lacking)} in Ray namespace {namespace!r} after {timeout_s:.0f} s: "
                "start the cluster first (`tandem control` or `tandem serve`)"
            )
        time.sleep(0.5)
