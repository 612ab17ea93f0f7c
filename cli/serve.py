"""`tandem serve`, `tandem control` and `tandem router`: the processes that run a cluster.

tandem serve [--config FILE] [--model DIR] [--prompt TEXT] [--verbose]
        start the cluster on Ray (a local one by default) and its router (and router.replicas - 1
        more on its port); with --prompt, answer it through the client SDK and shut down (unless
        --keep-serving); no config: every default, on the bundled demo model or on --model;
        --verbose: once ready, where the start spent its time (Ray, each worker's parts, the router)
tandem control [--config FILE]
        start the cluster on Ray and hold it, no router
tandem router [--config FILE] [--port P] [--ray-address ADDR]
        one more router on a running cluster (stateless)

Each serves until SIGINT or SIGTERM, then drains; a lost Ray cluster stops it at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cli.generate import stream
from cluster import startup
from cluster.auth import api_keys
from cluster.config import ClusterConfig, serve_config
from cluster.cpu import auto_dtype
from cluster.lifeline import OK, ClusterUnavailable, Lifeline

if TYPE_CHECKING:
    from cluster.pools.ray_cluster import RayCluster
    from router.openai.app import HTTPServer
    from router.service.replicas import Replicas
    from router.service.server import Router

CONFIG_HELP = "cluster config (YAML or JSON; default: every default)"
PORT_HELP = "router port (default: router.port in the config)"
NUM_CPUS_HELP = "CPUs of a local Ray (default: all)"


def add_commands(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="start a cluster and its router")
    serve.add_argument("--config", default=None, help=CONFIG_HELP)
    serve.add_argument(
        "--model", default=None, help="model folder to serve (replaces the config's; default: the bundled demo model)"
    )
    serve.add_argument("--port", type=int, default=None, help=PORT_HELP)
    serve.add_argument("--prompt", default=None, help="answer this prompt through the client SDK, then stop")
    serve.add_argument("--chat", action="store_true", help="send --prompt as a user message of a chat")
    serve.add_argument("--max-tokens", type=int, default=48, help="tokens for --prompt (default: 48)")
    serve.add_argument("--keep-serving", action="store_true", help="with --prompt: keep serving afterwards")
    serve.add_argument("--num-cpus", type=int, default=None, help=NUM_CPUS_HELP)
    serve.add_argument("--verbose", action="store_true", help="once ready, print where the start spent its time")
    serve.set_defaults(run=_serve)

    control = commands.add_parser("control", help="start the cluster's registry and pools and hold them (no router)")
    control.add_argument("--config", default=None, help=CONFIG_HELP)
    control.add_argument("--num-cpus", type=int, default=None, help=NUM_CPUS_HELP)
    control.set_defaults(run=_control)

    router = commands.add_parser("router", help="serve one more router on a running cluster")
    router.add_argument("--config", default=None, help=CONFIG_HELP)
    router.add_argument("--port", type=int, default=None, help=PORT_HELP)
    router.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: ray_address in the config, else auto)"
    )
    router.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for Ray's GCS, the cluster's registry, pools and first worker (default: 600)",
    )
    router.set_defaults(run=_router)


def _serve(args: argparse.Namespace) -> int:
    from cluster.pools import ray_cluster
    from cluster.pools.ray_observe import ray_view
    from router.service.replicas import Replicas
    from router.service.server import from_config

    config = serve_config(args.config, args.model)
    port = args.port if args.port is not None else config.router.port
    started = time.perf_counter()
    print(f"starting Ray and the {config.model.served_name} pools in {dtype_note(config)} ...", file=sys.stderr)
    print(sampling_note(config), file=sys.stderr)
    cluster = ray_cluster.start(config, **({"num_cpus": args.num_cpus} if args.num_cpus else {}))
    router, http, replicas, lifeline = None, None, None, None
    try:
        with startup.phase("router"):
            router = from_config(config, cluster.discover, cluster)
            address = router.start(f"{config.router.host}:{port}")
            router.join(cluster)
        lifeline = _watch_ray(cluster, config, router)
        http = _start_http(config, router, address)
        workers = ", ".join(f"{n} at {a}" for n, a in sorted(cluster.discover().items()))
        ready = time.perf_counter() - started
        print(f"router at {address}; workers: {workers} ({ready:.1f} s)", file=sys.stderr)
        if args.verbose:
            print("\n".join([f"ready in {ready:.2f} s:", *startup.lines(startup.taken())]), file=sys.stderr)
        print("\n".join(ray_view().lines()), file=sys.stderr)
        if args.prompt is not None:
            _answer(args, config, address)
            if not args.keep_serving:
                return 0
        stop = _stop_on_signals()  # before the replicas start: a SIGTERM meanwhile stops them too
        if config.router.replicas > 1:  # on the port this router bound, which port 0 chose
            bound = int(address.rsplit(":", 1)[1])
            replicas = Replicas.start(config, bound, cluster.address(), config.router.replicas - 1)
            print("\n".join(replicas.lines), file=sys.stderr)
        _serve_until_stopped(router, config, stop, replicas.terminate if replicas else None, lifeline)
        return 0
    finally:
        _shut_down(cluster, lifeline, router, http, replicas, config.router.shutdown_timeout_s + 30)
        print("stopped", file=sys.stderr)


def _answer(args: argparse.Namespace, config: ClusterConfig, address: str) -> None:
    """`serve --prompt`: the prompt through the client SDK, with the cluster's first API key and CA."""
    keys = api_keys(config.auth)
    key = keys[0].decode() if keys else None
    ca = str(config.auth.tls_ca) if config.auth.tls_cert and config.auth.tls_ca else None
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    stream(address, prompt, api_key=key, tls_ca=ca, max_tokens=args.max_tokens, temperature=0.0)


def _control(args: argparse.Namespace) -> int:
    """The cluster without a router: routers join it with `tandem router` (the Helm chart's controller)."""
    from cluster.pools import ray_cluster
    from cluster.pools.ray_observe import ray_view

    config = serve_config(args.config)
    print(f"starting Ray and the {config.model.served_name} pools in {dtype_note(config)} ...", file=sys.stderr)
    print(sampling_note(config), file=sys.stderr)
    cluster = ray_cluster.start(config, **({"num_cpus": args.num_cpus} if args.num_cpus else {}))
    lifeline = _watch_ray(cluster, config)
    try:
        stop = _stop_on_signals()
        workers = ", ".join(f"{n} at {a}" for n, a in sorted(cluster.discover().items()))
        where = f"Ray at {cluster.address()}, namespace {cluster.namespace}"
        print(f"pools up ({where}); workers: {workers}; routers join with `tandem router`", file=sys.stderr)
        print("\n".join(ray_view().lines()), file=sys.stderr, flush=True)
        _wait(stop, lifeline)
        return 0
    finally:
        cluster.shutdown(reachable=not lifeline.lost)
        print("stopped", file=sys.stderr)


def _router(args: argparse.Namespace) -> int:
    """A stateless router: it attaches to the cluster's actors, and leaves them running when it stops."""
    from cluster.pools import ray_cluster
    from router.service.server import from_config

    config = serve_config(args.config)
    port = args.port if args.port is not None else config.router.port
    deadline = time.monotonic() + args.timeout
    cluster = ray_cluster.attach(config, address=args.ray_address, timeout_s=args.timeout)
    router, http, lifeline = None, None, None
    try:
        _wait_for_workers(cluster.discover, deadline)
        router = from_config(config, cluster.discover, cluster)
        address = router.start(f"{config.router.host}:{port}")
        name = router.join(cluster)
        lifeline = _watch_ray(cluster, config, router)
        http = _start_http(config, router, address)
        stop = _stop_on_signals()  # before the line below: `tandem serve` may send SIGTERM once it reads it
        print(f"router {name} at {address}", flush=True)
        _serve_until_stopped(router, config, stop, lifeline=lifeline)
        return 0
    finally:
        _shut_down(cluster, lifeline, router, http)


def _shut_down(
    cluster: RayCluster,
    lifeline: Lifeline | None,
    router: Router | None,
    http: HTTPServer | None,
    replicas: Replicas | None = None,
    replicas_timeout_s: float = 0.0,
) -> None:
    """Stops what started, the router's processes before the cluster. A lost Ray goes first:
    meanwhile the router still answers, NOT_SERVING, with the reason."""
    lost = lifeline is not None and lifeline.lost
    if lost:
        cluster.shutdown(reachable=False)
    if replicas is not None:
        replicas.stop(replicas_timeout_s)
    if http is not None:
        http.stop()
    if router is not None:
        router.stop()
    if not lost:
        cluster.shutdown()


def _wait_for_workers(discover: Callable[[], dict[str, str]], deadline: float) -> None:
    """Returns once the registry lists a worker: a router serving before the pools have one
    would refuse every request it got."""
    while not discover():
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster's pools have registered no worker yet; is `tandem control` starting them?")
        time.sleep(0.5)


class Signalled:
    """Whether SIGINT or SIGTERM has come. Its handlers only assign a flag: a handler runs between two
    bytecodes of the main thread, whatever lock that holds then (one that set a `threading.Event`
    deadlocked on the event's own lock when a second signal came while the first was setting it)."""

    def __init__(self) -> None:
        self.came = False

    def __call__(self, *_: object) -> None:
        self.came = True


def _stop_on_signals() -> Signalled:
    stop = Signalled()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return stop


def _watch_ray(cluster: RayCluster, config: ClusterConfig, router: Router | None = None) -> Lifeline:
    """Watches Ray's GCS (`cluster.lifeline`): each change of state goes to stderr and to the router,
    if any; once Ray is lost, `_wait` raises ClusterUnavailable. With `ray_ha` the GCS comes back
    with its tables, so nothing is final; without, its raylets give up after reconnect_timeout_s."""
    ha = config.ray_ha

    def changed(state: str, reason: str) -> None:
        cluster.gcs_answers = state == OK
        print(f"tandem: Ray is {state}" + (f": {reason}" if reason else ""), file=sys.stderr, flush=True)
        if router is not None:
            router.ray_changed(state, reason)

    gives_up = None if ha.fault_tolerant else ha.reconnect_timeout_s
    lifeline = Lifeline(cluster.probe, changed, config.router.ray_lost_after_s, gives_up, ha.drain_s)
    if router is not None:
        router.ray_changed(OK, "")
    lifeline.start()
    return lifeline


def _wait(stop: Signalled, lifeline: Lifeline | None) -> None:
    """Returns once a signal came; raises ClusterUnavailable once the Ray cluster is lost."""
    while not stop.came:
        time.sleep(0.2)
        if lifeline is not None and lifeline.lost:
            raise ClusterUnavailable(lifeline.reason)


def _serve_until_stopped(
    router: Router,
    config: ClusterConfig,
    stop: Signalled,
    on_stop: Callable[[], None] | None = None,
    lifeline: Lifeline | None = None,
) -> None:
    """Serves until `stop` is set, then drains: new requests get UNAVAILABLE, those in flight run
    to their end (up to router.shutdown_timeout_s). `on_stop` runs first (the replicas' SIGTERM).
    A lost Ray cluster (`lifeline`) stops it at once, without draining."""
    print("serving; Ctrl-C or SIGTERM stops (requests in flight finish first)", file=sys.stderr, flush=True)
    try:
        _wait(stop, lifeline)
    finally:
        if on_stop is not None:
            on_stop()
    print("draining ...", file=sys.stderr, flush=True)
    if not router.drain(config.router.shutdown_timeout_s):
        print(f"{router.in_flight} requests still running after the timeout; stopping", file=sys.stderr)


def _start_http(config: ClusterConfig, router: Router, address: str) -> HTTPServer | None:
    """The OpenAI-compatible face, when `router.http_port` is set."""
    if config.router.http_port is None:
        return None
    from cluster.tls import channel_credentials
    from router.openai.app import HTTPServer, create_app

    with startup.phase("OpenAI face"):
        creds = channel_credentials(config.auth) if config.auth.tls_cert else None
        app = create_app(address, config.model.served_name, router.telemetry.metrics.registry, creds)
        http = HTTPServer(app, config.router.host, config.router.http_port)
        bound = http.start()
    print(f"OpenAI-compatible HTTP at http://{bound}/v1", file=sys.stderr)
    return http


def dtype_note(config: ClusterConfig) -> str:
    """The model's dtype, with why `auto` picks it on this machine where it is auto's pick."""
    picked, why = auto_dtype(config.model.device)
    return f"{config.model.dtype} ({why})" if config.model.dtype == picked else f"{config.model.dtype} (as configured)"


def sampling_note(config: ClusterConfig) -> str:
    """What a request that leaves a sampling field unset gets: the model's generation_config.json's, or Tandem's."""
    from cluster.model.tokenizer import Tokenizer

    if config.model.generation_config == "none":
        return "sampling defaults: Tandem's (model.generation_config: none)"
    found = Tokenizer(config.model.path).sampling_defaults
    if not found:
        return "sampling defaults: Tandem's (the model's generation_config.json sets none)"
    listed = ", ".join(f"{k} {v:g}" for k, v in found.items())
    off = "model.generation_config: none turns them off"
    return f"sampling defaults from the model's generation_config.json: {listed} ({off})"
