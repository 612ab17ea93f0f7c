"""A router in a process of its own, for tests that kill one: `python tests/router_process.py
CONFIG_JSON WORKERS_JSON ADDRESS` prints the address it serves and stops when stdin closes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "proto")]

from cluster.config import parse_config  # noqa: E402
from router.service.server import from_config  # noqa: E402

if __name__ == "__main__":
    config, workers, address = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    router = from_config(parse_config(config), lambda: workers)
    print(router.start(address), flush=True)
    sys.stdin.read()
    router.stop()
