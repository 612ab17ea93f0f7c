"""The options of every command that talks to a running router (`--target`, `--api-key`,
`--tls-ca`), written once, and the gRPC channel and call metadata they make."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def add_client_options(
    parser: argparse.ArgumentParser,
    default: str | None = DEFAULT_TARGET,
    target_help: str = f"router address (default: {DEFAULT_TARGET})",
) -> None:
    parser.add_argument("--target", default=default, help=target_help)
    parser.add_argument("--api-key", default=None, help="the key the router expects, if it expects one")
    parser.add_argument("--tls-ca", default=None, help="CA (PEM) to trust: connect over TLS")


def channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to `--target`, over TLS when `--tls-ca` names a CA."""
    if args.tls_ca is None:
        return grpc.insecure_channel(args.target)
    ca = Path(args.tls_ca).read_bytes()
    return grpc.secure_channel(args.target, grpc.ssl_channel_credentials(root_certificates=ca))


def metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The call metadata that carries `--api-key`."""
    return [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
