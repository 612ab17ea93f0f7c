"""`tandem bench` against the README's embedded default cluster: it starts the cluster, drives it,
prints the table and writes its JSON and PNG, within two minutes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_bench_runs_against_the_embedded_cluster(tmp_path):
    command = [
        str(Path(sys.executable).parent / "tandem"), "bench", "--config", "examples/local.yaml",
        "--num-prompts", "16", "--rate", "8", "--input-len", "48", "--output-len", "24",
        "--goodput", "ttft:2000", "tpot:500", "--no-progress", "--out", str(tmp_path),
    ]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s"
    out = result.stdout
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    for row in ("Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):", "Request goodput"):
        assert row in out, row
    record = json.loads((tmp_path / "serve_bench.json").read_text())
    assert record["summary"]["completed"] == 16 and record["summary"]["failed"] == 0
    assert all(sum(n for _, n in r["chunks"]) == r["max_tokens"] for r in record["requests"])
    assert (tmp_path / "serve_bench.png").stat().st_size > 0
