"""`tandem certs --out DIR`: a development CA and a certificate it signs, for trying TLS (not for
production)."""

from __future__ import annotations

import argparse


def add_commands(commands: argparse._SubParsersAction) -> None:
    certs = commands.add_parser("certs", help="write a development CA and certificate for TLS (not for production)")
    certs.add_argument("--out", required=True, help="folder for ca.pem, cert.pem, key.pem")
    certs.add_argument("--days", type=int, default=30, help="validity (default: 30 days)")
    certs.set_defaults(run=_certs)


def _certs(args: argparse.Namespace) -> int:
    from cluster.tls import generate_dev_certs

    paths = generate_dev_certs(args.out, args.days)
    print(f"wrote {paths['ca']}, {paths['cert']} and {paths['key']} (127.0.0.1 and localhost; development only)")
    print(f"config: auth: {{tls_cert: {paths['cert']}, tls_key: {paths['key']}, tls_ca: {paths['ca']}}}")
    return 0
