"""The `tandem` command line.

tandem serve [--config FILE] [--model DIR] [--prompt TEXT]
                                              start the cluster on Ray (a local one by default) and
                                              its router (and router.replicas - 1 more on its port);
                                              with --prompt, answer it through the client SDK and
                                              shut down (unless --keep-serving); no config: every
                                              default, on the bundled demo model or on --model
tandem control [--config FILE]                start the cluster on Ray and hold it, no router
tandem router [--config FILE] [--port P] [--ray-address ADDR]
                                              one more router on a running cluster (stateless)
tandem generate PROMPT [--target HOST:PORT]   stream a completion from a running cluster
tandem generate --model DIR --prompt TEXT     complete a prompt in this process, no cluster
tandem status [--target HOST:PORT]            pools, workers, KV use, queues, placement counters
tandem bench [--target HOST:PORT | --config FILE] [--rate R]   serving metrics (TTFT, TPOT, ITL, goodput)
tandem scale POOL N|auto [--target HOST:PORT] hold a pool at N workers by hand / hand it back
tandem certs --out DIR                        a development CA and certificate for TLS
tandem dashboards --out DIR [--target HOST:PORT]   a Prometheus scrape config and Grafana dashboards
tandem model init --preset tiny --out DIR     write a random-weight model folder
tandem config check FILE                      validate a cluster config file

The entry point lives with the router because `serve` composes it with `cluster`'s Ray side
(`cluster` does not import the router).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cli.model import add_commands, add_generate_options, offline_generate
from cli.plan import add_commands as add_planner_commands
from cluster.auth import api_keys
from cluster.config import ConfigError, serve_config
from cluster.lifeline import ClusterUnavailable, Lifeline
from cluster.model.arch import ModelFormatError
from router.client import Client, TandemError
from router.replicas import ReplicaFailed

DEFAULT_TARGET = "127.0.0.1:50051"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ConfigError, ModelFormatError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except (TandemError, ReplicaFailed, TimeoutError, ClusterUnavailable) as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving on Ray.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="start a cluster and its router")
    serve.add_argument("--config", default=None, help="cluster config (YAML or JSON; default: every default)")
    serve.add_argument(
        "--model", default=None, help="model folder to serve (replaces the config's; default: the bundled demo model)"
    )
    serve.add_argument("--port", type=int, default=None, help="router port (default: router.port in the config)")
    serve.add_argument("--prompt", default=None, help="answer this prompt through the client SDK, then stop")
    serve.add_argument("--chat", action="store_true", help="send --prompt as a user message of a chat")
    serve.add_argument("--max-tokens", type=int, default=48, help="tokens for --prompt (default: 48)")
    serve.add_argument("--keep-serving", action="store_true", help="with --prompt: keep serving afterwards")
    serve.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray (default: all)")
    serve.set_defaults(run=_serve)

    control = commands.add_parser("control", help="start the cluster's registry and pools and hold them (no router)")
    control.add_argument("--config", default=None, help="cluster config (YAML or JSON; default: every default)")
    control.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray (default: all)")
    control.set_defaults(run=_control)

    router = commands.add_parser("router", help="serve one more router on a running cluster")
    router.add_argument("--config", default=None, help="cluster config (YAML or JSON; default: every default)")
    router.add_argument("--port", type=int, default=None, help="router port (default: router.port in the config)")
    router.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: ray_address in the config, else auto)"
    )
    router.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the cluster's registry, pools and first worker (default: 600)",
    )
    router.set_defaults(run=_router)

    gen = commands.add_parser("generate", help="stream a completion from a running cluster (or --model: locally)")
    gen.add_argument("text", nargs="?", help="the prompt")
    gen.add_argument("--prompt", default=None, help="the prompt (same as the positional argument)")
    gen.add_argument("--target", default=DEFAULT_TARGET, help=f"router address (default: {DEFAULT_TARGET})")
    gen.add_argument("--model", default=None, help="run this model folder in this process instead")
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up (default: 120)")
    gen.add_argument("--api-key", default=None, help="the key the router expects, if it expects one")
    gen.add_argument("--tls-ca", default=None, help="CA (PEM) to trust: connect over TLS")
    add_generate_options(gen)
    gen.set_defaults(run=_generate)

    bench = commands.add_parser("bench", help="drive a running cluster and report serving metrics")
    from cli import bench as bench_module

    bench_module.add_arguments(bench)
    bench.set_defaults(run=lambda a: bench_module.run(a) and 0)

    scale = commands.add_parser(
        "scale", help="hold a pool at N workers by hand, give it back to its autoscaler, or set its planned target"
    )
    scale.add_argument("pool", choices=["prefill", "decode"], help="the pool")
    scale.add_argument("replicas", nargs="?", help="workers to hold the pool at, or 'auto' to clear the override")
    scale.add_argument(
        "--plan", default=None, help="the planner's target for the pool (predictive autoscaling), or 'none' to clear it"
    )
    scale.add_argument("--target", default=DEFAULT_TARGET, help=f"router address (default: {DEFAULT_TARGET})")
    scale.add_argument("--api-key", default=None, help="the key the router expects, if it expects one")
    scale.add_argument("--tls-ca", default=None, help="CA (PEM) to trust: connect over TLS")

    certs = commands.add_parser("certs", help="write a development CA and certificate for TLS (not for production)")
    certs.add_argument("--out", required=True, help="folder for ca.pem, cert.pem, key.pem")
    certs.add_argument("--days", type=int, default=30, help="validity (default: 30 days)")
    certs.set_defaults(run=_certs)
    scale.set_defaults(run=_scale)

    status = commands.add_parser("status", help="show pools, workers, KV use, queues and placement counters")
    status.add_argument("--target", default=DEFAULT_TARGET, help=f"router address (default: {DEFAULT_TARGET})")
    status.add_argument("--api-key", default=None, help="the key the router expects, if it expects one")
    status.add_argument("--tls-ca", default=None, help="CA (PEM) to trust: connect over TLS")
    status.set_defaults(run=_status)

    from cli import dashboards

    dashboards.add_command(commands)
    add_commands(commands)
    add_planner_commands(commands)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from cluster.pools import ray_cluster
    from cluster.pools.ray_observe import ray_view
    from router.replicas import Replicas
    from router.server import from_config

    config = serve_config(args.config, args.model)
    port = args.port if args.port is not None else config.router.port
    started = time.perf_counter()
    print(f"starting Ray and the {config.model.served_name} pools ...", file=sys.stderr)
    cluster = ray_cluster.start(config, **({"num_cpus": args.num_cpus} if args.num_cpus else {}))
    router, http, replicas, lifeline = None, None, None, None
    try:
        router = from_config(config, cluster.discover, cluster)
        address = router.start(f"{config.router.host}:{port}")
        router.join(cluster)
        lifeline = _watch_ray(cluster, config, router)
        http = _start_http(config, router, address)
        workers = ", ".join(f"{n} at {a}" for n, a in sorted(cluster.discover().items()))
        print(f"router at {address}; workers: {workers} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
        print("\n".join(ray_view().lines()), file=sys.stderr)
        if args.prompt is not None:
            keys = api_keys(config.auth)
            key = keys[0].decode() if keys else None
            ca = str(config.auth.tls_ca) if config.auth.tls_cert and config.auth.tls_ca else None
            prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
            _stream(address, prompt, api_key=key, tls_ca=ca, max_tokens=args.max_tokens, temperature=0.0)
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
        lost = lifeline is not None and lifeline.lost
        if lost:  # Ray first: meanwhile the router still answers, NOT_SERVING, with the reason
            cluster.shutdown(reachable=False)
        if replicas is not None:
            replicas.stop(config.router.shutdown_timeout_s + 30)
        if http is not None:
            http.stop()
        if router is not None:
            router.stop()
        if not lost:
            cluster.shutdown()
        print("stopped", file=sys.stderr)


def _control(args: argparse.Namespace) -> int:
    """The cluster without a router: routers join it with `tandem router` (the Helm chart's controller)."""
    from cluster.pools import ray_cluster
    from cluster.pools.ray_observe import ray_view

    config = serve_config(args.config)
    print(f"starting Ray and the {config.model.served_name} pools ...", file=sys.stderr)
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
    from router.server import from_config

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
        lost = lifeline is not None and lifeline.lost
        if lost:  # Ray first: meanwhile the router still answers, NOT_SERVING, with the reason
            cluster.shutdown(reachable=False)
        if http is not None:
            http.stop()
        if router is not None:
            router.stop()
        if not lost:
            cluster.shutdown()


def _wait_for_workers(discover, deadline: float) -> None:  # type: ignore[no-untyped-def]
    """Returns once the registry lists a worker: a router serving before the pools have one
    would refuse every request it got."""
    while not discover():
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster's pools have registered no worker yet; is `tandem control` starting them?")
        time.sleep(0.5)


def _stop_on_signals() -> threading.Event:
    """An event that SIGINT or SIGTERM sets."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def _watch_ray(cluster, config, router=None) -> Lifeline:  # type: ignore[no-untyped-def]
    """Watches Ray's GCS: once it has not answered for router.ray_lost_after_s, the router (if
    any) refuses everything with UNAVAILABLE and `_wait` raises ClusterUnavailable."""

    def lost(reason: str) -> None:
        print(f"tandem: {reason}; refusing requests and stopping", file=sys.stderr, flush=True)
        if router is not None:
            router.lose_cluster(reason)

    lifeline = Lifeline(cluster.probe, lost, config.router.ray_lost_after_s)
    lifeline.start()
    return lifeline


def _wait(stop: threading.Event, lifeline: Lifeline | None) -> None:
    """Returns once `stop` is set; raises ClusterUnavailable once the Ray cluster is lost."""
    while not stop.wait(0.2):
        if lifeline is not None and lifeline.lost:
            raise ClusterUnavailable(lifeline.reason)


def _serve_until_stopped(router, config, stop: threading.Event, on_stop=None, lifeline=None) -> None:  # type: ignore[no-untyped-def]
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


def _start_http(config, router, address):  # type: ignore[no-untyped-def]
    """The OpenAI-compatible face, when `router.http_port` is set."""
    if config.router.http_port is None:
        return None
    from cluster.tls import channel_credentials
    from router.http import HTTPServer, create_app

    creds = channel_credentials(config.auth) if config.auth.tls_cert else None
    app = create_app(address, config.model.served_name, router.telemetry.metrics.registry, creds)
    http = HTTPServer(app, config.router.host, config.router.http_port)
    print(f"OpenAI-compatible HTTP at http://{http.start()}/v1", file=sys.stderr)
    return http


def _generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else args.text
    if prompt is None:
        raise ValueError("give a prompt: tandem generate 'def add(a, b):'")
    if args.model is not None:
        args.prompt = prompt
        offline_generate(args)
        return 0
    messages = [{"role": "user", "content": prompt}] if args.chat else prompt
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    _stream(args.target, messages, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca, **sampling)
    return 0


def _stream(target: str, prompt, timeout=120.0, api_key=None, tls_ca=None, **sampling) -> None:  # type: ignore[no-untyped-def]
    with Client(target, api_key=api_key, timeout=timeout, tls_ca=tls_ca) as client:
        if isinstance(prompt, str):
            print(prompt, end="", flush=True)
        else:  # a chat: each message, then the assistant's answer
            print("".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: ", end="", flush=True)
        reason = None
        for delta in client.stream(prompt, **sampling):
            print(delta.text, end="", flush=True)
            reason = delta.finish_reason or reason
        print(f"\n[finish: {reason}]", file=sys.stderr)


def _certs(args: argparse.Namespace) -> int:
    from cluster.tls import generate_dev_certs

    paths = generate_dev_certs(args.out, args.days)
    print(f"wrote {paths['ca']}, {paths['cert']} and {paths['key']} (127.0.0.1 and localhost; development only)")
    print(f"config: auth: {{tls_cert: {paths['cert']}, tls_key: {paths['key']}, tls_ca: {paths['ca']}}}")
    return 0


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if args.tls_ca is None:
        return grpc.insecure_channel(args.target)
    with open(args.tls_ca, "rb") as f:
        return grpc.secure_channel(args.target, grpc.ssl_channel_credentials(root_certificates=f.read()))


def _key(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {args.api_key}")] if args.api_key else []


def _scale(args: argparse.Namespace) -> int:
    if (args.replicas is None) == (args.plan is None):
        raise ValueError("give the workers to hold the pool at (or 'auto'), or --plan N (or --plan none): one of them")
    request = worker_pb2.ScaleRequest(pool=args.pool)
    if args.plan == "none":
        request.clear_planned = True
    elif args.plan is not None:
        request.planned = _count(args.plan, "--plan")
    elif args.replicas != "auto":
        request.replicas = _count(args.replicas, "replicas")
    with _channel(args) as channel:
        try:
            pool = worker_pb2_grpc.AdminStub(channel).Scale(request, timeout=60, metadata=_key(args)).pool
        except grpc.RpcError as e:
            print(f"tandem: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    held = (
        f"held at {pool.override} by hand until `tandem scale {pool.role} auto`"
        if pool.HasField("override")
        else f"autoscaled, never below the plan's {pool.planned}"
        if pool.HasField("planned")
        else "autoscaled"
    )
    print(f"{pool.role} pool: target {pool.target} ({held}); serving {', '.join(pool.workers) or 'none'}")
    return 0


def _count(text: str, name: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{name} takes a number of workers, not {text!r}")
    return int(text)


def _status(args: argparse.Namespace) -> int:
    channel = _channel(args)
    try:
        status = worker_pb2_grpc.AdminStub(channel).GetStatus(
            worker_pb2.GetStatusRequest(), timeout=10, metadata=_key(args)
        )
    except grpc.RpcError as e:
        print(f"tandem: cannot reach the router at {args.target}: {e.code().name}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    routers = "router" if len(status.routers) == 1 else "routers"
    print(f"model {status.model}, {status.requests_in_flight} requests in flight over {len(status.routers)} {routers}")
    _print_routers(status.routers)
    print(
        f"{'worker':<12}{'role':<9}{'address':<22}{'health':<8}{'running':>8}{'waiting':>8}"
        f"{'queued tok':>11}{'KV used':>14}  metrics"
    )
    for w in status.workers:
        load = w.load
        used = load.total_kv_blocks - load.free_kv_blocks
        kv = f"{used}/{load.total_kv_blocks}" if load.total_kv_blocks else "-"
        health = "up" if w.healthy else "DOWN"
        role = load.role or "?"
        print(
            f"{w.name:<12}{role:<9}{w.address:<22}{health:<8}{load.running_seqs:>8}{load.waiting_seqs:>8}"
            f"{load.queued_prompt_tokens:>11}{kv:>14}  {load.metrics_address or '-'}"
        )
    if status.decisions:
        print("placement: " + ", ".join(f"{k} {v}" for k, v in sorted(status.decisions.items())))
    for pool in status.pools:
        held = f", held at {pool.override} by hand" if pool.HasField("override") else ""
        held += f", planned {pool.planned}" if pool.HasField("planned") else ""
        draining = f", draining {', '.join(pool.draining)}" if pool.draining else ""
        print(
            f"{pool.role} pool: {len(pool.workers)} serving, target {pool.target} "
            f"[{pool.min_replicas}, {pool.max_replicas}]{held}{draining}; {pool.reason} "
            f"(up {pool.scale_ups}, down {pool.scale_downs})"
        )
    return 0


def _print_routers(routers) -> None:  # type: ignore[no-untyped-def]
    """One line per live router: its requests in flight, its SLO window's attainment and p90
    latencies, how old its report is, and its Prometheus endpoint."""
    width = max(len("router"), *(len(r.name) for r in routers)) + 2

    def seconds(r, field: str) -> str:  # type: ignore[no-untyped-def]
        return f"{getattr(r, field):.3f}s" if r.HasField(field) else "-"

    print(
        f"{'router':<{width}}{'address':<22}{'in flight':>10}{'SLO':>6}{'TTFT p90':>10}{'TPOT p90':>10}"
        f"{'report':>8}  metrics"
    )
    for r in routers:
        slo = f"{r.slo_attainment:.0%}" if r.HasField("slo_attainment") else "-"
        print(
            f"{r.name:<{width}}{r.address:<22}{r.requests_in_flight:>10}{slo:>6}{seconds(r, 'ttft_p90_seconds'):>10}"
            f"{seconds(r, 'tpot_p90_seconds'):>10}{r.age_seconds:>7.1f}s  http://{r.metrics_address}/metrics"
        )


if __name__ == "__main__":
    sys.exit(main())
