"""What Tandem's pods run besides `tandem control`, `tandem router` and `ray start` (the chart
ships this file in a ConfigMap, so it always matches the chart that renders the pods):

pod_helper.py config --in FILE --secrets DIR --out FILE   the Tandem config: the ConfigMap's file plus the
                                                          API keys and cluster secret from the mounted
                                                          Secret, validated by `cluster.config.parse_config`
pod_helper.py check-model DIR                             the model folder is complete (init container)
pod_helper.py health --target HOST:PORT [--tls-ca FILE]   grpc.health.v1 over TLS (the kubelet's own gRPC
                                                          probe speaks plaintext only)
pod_helper.py relay --listen HOST:PORT --to HOST:PORT     TCP relay: the router serves /metrics on loopback

The cluster secret has no file form in the config, and the workers receive the controller's
config through Ray, so the config must carry the keys themselves; they go into a memory-backed
volume, never into the ConfigMap.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import yaml


def compose(config_file: Path, secrets: Path, api_keys_key: str, cluster_secret_key: str) -> Any:
    """The validated `ClusterConfig`: `config_file` with the secrets found under `secrets` added."""
    from cluster.config import ConfigError, parse_config

    data = yaml.safe_load(config_file.read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"{config_file}: expected a mapping at the top level")
    auth = dict(data.get("auth") or {})
    keys_file, secret_file = secrets / api_keys_key, secrets / cluster_secret_key
    if keys_file.is_file():
        keys = [line.strip() for line in keys_file.read_text().splitlines() if line.strip()]
        auth["api_keys"] = [*auth.get("api_keys", []), *keys]
    if secret_file.is_file() and secret_file.read_text().strip():
        auth["cluster_secret"] = secret_file.read_text().strip()
    return parse_config({**data, "auth": auth}, source=str(config_file))


def _config(args: argparse.Namespace) -> int:
    from cluster.config import dump_config

    config = compose(Path(args.input), Path(args.secrets), args.api_keys_key, args.cluster_secret_key)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(dump_config(config))
    keys, secret = len(config.auth.api_keys), config.auth.cluster_secret is not None
    print(f"config for {config.model.served_name} written to {out}: {keys} API keys, cluster secret {secret}")
    return 0


def _check_model(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from cluster.model.arch import ModelArch
    from cluster.model.loader import weight_files
    from cluster.model.tokenizer import Tokenizer

    folder = Path(args.folder)
    arch = ModelArch.from_folder(folder)
    Tokenizer(folder)
    files = weight_files(folder)
    tensors = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            tensors += len(list(f.keys()))
    print(f"{folder}: {arch.architecture}, {arch.num_layers} layers, {tensors} tensors in {len(files)} files")
    return 0


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
        channel = grpc.secure_channel(args.target, creds)
    else:
        channel = grpc.insecure_channel(args.target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.target}: {e.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _relay(listen: str, to: str) -> None:
    to_host, to_port = to.rsplit(":", 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(to_host, int(to_port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pod_helper.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    config = commands.add_parser("config", help="compose and validate the Tandem config")
    config.add_argument("--in", dest="input", required=True, help="config file from the ConfigMap")
    config.add_argument("--secrets", required=True, help="folder where the Secret is mounted")
    config.add_argument("--api-keys-key", default="api-keys", help="Secret key holding API keys, one a line")
    config.add_argument("--cluster-secret-key", default="cluster-secret", help="Secret key holding the cluster secret")
    config.add_argument("--out", required=True, help="config file to write (JSON)")
    config.set_defaults(run=_config)
    check = commands.add_parser("check-model", help="check a model folder")
    check.add_argument("folder")
    check.set_defaults(run=_check_model)
    health = commands.add_parser("health", help="grpc.health.v1 check")
    health.add_argument("--target", required=True)
    health.add_argument("--tls-ca", default=None, help="CA (PEM) to trust: connect over TLS")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(run=_health)
    relay = commands.add_parser("relay", help="relay TCP connections")
    relay.add_argument("--listen", required=True)
    relay.add_argument("--to", required=True)
    relay.set_defaults(run=lambda a: asyncio.run(_relay(a.listen, a.to)))
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (OSError, ValueError) as e:  # ConfigError and ModelFormatError are ValueErrors
        print(f"pod_helper.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
