"""`tandem adapters`: LoRA adapters while serving, through the router's `Admin` service.

tandem adapters list [--target HOST:PORT]         each adapter, the workers serving it, those holding it in a slot
tandem adapters load NAME PATH [--target ...]      every worker reads PATH (a folder PEFT saved) and serves NAME
tandem adapters unload NAME [--target ...]         new requests through NAME are refused; running ones finish

Loading and unloading need `lora.runtime_loading: true` in the cluster's config.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cli.client_options import add_client_options, channel, metadata


def add_commands(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser("adapters", help="list, load or unload LoRA adapters while serving")
    actions = group.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="each adapter, the workers serving it and those holding it in a slot")
    listing.set_defaults(run=_list)
    load = actions.add_parser("load", help="load an adapter on every worker (needs lora.runtime_loading)")
    load.add_argument("name", help="the name requests use (SamplingParams.adapter, the OpenAI face's model)")
    load.add_argument("path", help="a folder PEFT saved, which every worker reaches")
    load.set_defaults(run=_load)
    unload = actions.add_parser("unload", help="stop serving an adapter (running requests finish)")
    unload.add_argument("name")
    unload.set_defaults(run=_unload)
    for parser in (listing, load, unload):
        add_client_options(parser)


def _list(args: argparse.Namespace) -> int:
    found = _call(args, "ListAdapters", worker_pb2.ListAdaptersRequest())
    if found is None:
        return 1
    if not found.adapters:
        print("no adapters")
    for a in found.adapters:
        slots = ", ".join(a.resident_on) or "none"
        print(f"{a.name}  {a.digest.hex()[:12]}  on {', '.join(a.workers)}; in a slot on {slots}")
    return 0


def _load(args: argparse.Namespace) -> int:
    done = _call(args, "LoadAdapter", worker_pb2.LoadAdapterRequest(name=args.name, path=args.path))
    if done is None:
        return 1
    print(f"loaded {args.name!r} on {', '.join(done.workers)}")
    return 0


def _unload(args: argparse.Namespace) -> int:
    done = _call(args, "UnloadAdapter", worker_pb2.UnloadAdapterRequest(name=args.name))
    if done is None:
        return 1
    print(f"unloaded {args.name!r} from {', '.join(done.workers)}")
    return 0


def _call(args: argparse.Namespace, method: str, request: object):  # type: ignore[no-untyped-def]
    """The router's answer, or None after printing why it refused."""
    with channel(args) as chan:
        try:
            return getattr(worker_pb2_grpc.AdminStub(chan), method)(request, timeout=120, metadata=metadata(args))
        except grpc.RpcError as e:
            print(f"tandem: {e.code().name}: {e.details()}", file=sys.stderr)
            return None
