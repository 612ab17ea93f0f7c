"""The GPU check's dry run: `benchmarks/gpu_check.sh --dry-run` runs every step of the GPU machine's
check on the CPU with tiny shapes, importing only what that machine has or the check carries as
wheels, so the one-shot script cannot rot between the rare runs on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, json
verdict = {}
for name in %r:
    try:
        importlib.import_module(name)
        verdict[name] = True
    except ImportError:
        verdict[name] = False
print(json.dumps(verdict))
"""
BLOCKED = ("ray", "fastapi", "uvicorn", "opentelemetry", "grpc_tools", "cryptography")
IMPORTABLE = (
    "torch", "pydantic", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "tandem.v1.kv_transfer_pb2",
    "cluster.config", "cluster.kv.grpc_transport", "decode_worker.kv_intake", "prefill_worker.engine",
)  # fmt: skip


def test_the_dry_run_imports_only_what_the_gpu_machine_has_or_the_check_carries(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_dry_site.py"), str(tmp_path / "site")], check=True)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}:{ROOT / 'proto'}"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE % (BLOCKED + IMPORTABLE,)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert not any(verdict[name] for name in BLOCKED), verdict
    assert all(verdict[name] for name in IMPORTABLE), verdict


@pytest.mark.slow
def test_the_gpu_check_dry_run_passes(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", str(out)],
        capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 6 and {"gpu_check.json", "gpu_check.log"} <= set(files), files
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["status"] == "passed" and summary["dry_run"]
    assert not summary["environment"]["ray_importable"]
    steps = summary["steps"]
    assert list(steps) == ["cuda_tests", "decode", "prefill", "kv_overlap", "transports"]
    assert all(step["status"] == "passed" for step in steps.values()), steps
    decode = steps["decode"]["result"]["rows"]
    assert {(r["model"], r["context"], r["batch"]) for r in decode if r["engine"] == "tandem eager"} == {
        (m, c, b) for m in ("random", "real") for c in (32, 64) for b in (1, 2)
    }
    assert {r["engine"] for r in decode} == {"tandem eager", "transformers"}
    assert all(r["roofline_frac"] > 0 and r["read_GBps"] > 0 for r in decode if r["engine"] == "tandem eager")
    assert all(r["mfu"] > 0 for r in steps["prefill"]["result"]["rows"])
    overlap = steps["kv_overlap"]["result"]["rows"]
    assert [r["prompt_tokens"] for r in overlap] == [32, 64] and all("two streams" in r["hidden"] for r in overlap)
    transports = steps["transports"]["result"]
    for name in ("local", "grpc", "collective"):
        assert transports[name]["status"] == "passed", transports
        assert transports[name]["kv_bit_identical"] and transports[name]["tokens_equal_one_engine"]
    assert transports["collective"]["via"] == "gloo"
    assert summary["nccl"]["status"] == "not run" and "Gloo" in summary["nccl"]["reason"]
    assert summary["models"]["real"]["weights"].startswith("random, in its own shape")
