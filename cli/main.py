"""The `tandem` command: `main` builds one parser from each command module's `add_commands` and
runs the command it parses.

tandem serve | control | router               run a cluster, its registry and pools, one more router   (cli.serve)
tandem generate PROMPT [--target | --model]   a completion from a running cluster, or in this process  (cli.generate)
tandem bench [--target | --config] [--rate R] serving metrics: TTFT, TPOT, ITL, goodput               (cli.bench)
tandem status | scale POOL N|auto             the router's Admin service                              (cli.admin)
tandem adapters list | load | unload          LoRA adapters while serving                              (cli.adapters)
tandem certs --out DIR                        a development CA and certificate for TLS                 (cli.certs)
tandem dashboards --out DIR [--target]        a Prometheus scrape config and Grafana dashboards        (cli.dashboards)
tandem model init | quantize | import-gguf    model folders; tandem config check FILE                  (cli.model)
tandem profile | plan                         this machine's costs; layouts ranked by simulation       (cli.plan)

Bad input exits 2 with `tandem: error: ...`; a cluster or router that fails the command exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cli import adapters, admin, bench, certs, dashboards, generate, model, plan, serve
from cluster.config import ConfigError
from cluster.lifeline import ClusterUnavailable
from cluster.model.arch import ModelFormatError
from router.sdk.errors import TandemError
from router.service.replicas import ReplicaFailed

COMMANDS = (serve, generate, bench, admin, adapters, certs, dashboards, model, plan)  # in the order --help lists them


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ConfigError, ModelFormatError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except (TandemError, ReplicaFailed, TimeoutError, ClusterUnavailable) as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 1


def parser() -> argparse.ArgumentParser:
    tandem = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving on Ray.")
    commands = tandem.add_subparsers(required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_commands(commands)
    return tandem


if __name__ == "__main__":
    sys.exit(main())
