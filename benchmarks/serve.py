"""The serving benchmark: `tandem bench` under another name (same arguments).

.venv/bin/python benchmarks/serve.py --config examples/local.yaml --num-prompts 32 --rate 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    bench.run(parser.parse_args())
