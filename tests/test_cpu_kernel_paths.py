"""Every instruction set the CPU kernels are built for is checked on every machine that runs it.

The kernels' vector paths are chosen at run time by the CPU's flags (`cpu_kernels.VARIANTS`):
AVX-512 with AVX512-BF16, AVX-512 without, AVX2. A process loads one, so the suite's own run checks
the best this CPU runs (`test_cpu_kernels.py`), and this module runs that module again in a process
of its own for each other variant the CPU runs, and for the portable plain loops. A variant this
CPU lacks is skipped with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cpu import cpu_flags
from cluster.model import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_the_variant_is_chosen_by_the_cpus_flags(monkeypatch):
    from cluster import cpu

    cases = {
        frozenset({"avx2", "fma", "f16c"}): "avx2",
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}): "avx512",
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}): "avx512_bf16",
        frozenset({"sse4_2"}): "portable",
        frozenset({"avx2"}): "portable",  # without FMA and F16C: no vector path
    }
    monkeypatch.delenv("TANDEM_CPU_KERNELS", raising=False)
    for flags, expected in cases.items():
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: flags)
        assert cpu_kernels.variant() == expected, sorted(flags)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "avx512")
    with pytest.raises(ValueError, match="this CPU runs \\['avx2'\\]"):
        cpu_kernels.variant()  # never one the CPU cannot run, whatever built it
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert cpu_kernels.variant() is None


@pytest.mark.parametrize("name", [*cpu_kernels.VARIANTS, "portable"])
def test_each_variant_this_cpu_runs_passes_the_kernel_tests(name):
    needs = cpu_kernels.VARIANTS[name][0] if name in cpu_kernels.VARIANTS else set()
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(needs - cpu_flags()))}")
    if name == cpu_kernels.variant():
        pytest.skip(f"{name} is this process's own: test_cpu_kernels.py checks it in the suite's run")
    env = {**os.environ, "TANDEM_CPU_KERNELS": name}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cpu_kernels.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout.split("\n")[-2], run.stdout[-500:]
