"""Every instruction set the CPU kernels are built for is checked on every machine that runs it.

The kernels' vector paths are chosen at run time by the CPU's flags (`cpu_kernels.VARIANTS`):
AVX-512 with AVX512-BF16, AVX-512 without, AVX2. A process loads one, so the suite's own run checks
the best this CPU runs (`test_cpu_kernels.py`), and this module runs that module again in a process
of its own for each other variant the CPU runs, and for the portable plain loops. On a CPU with AMX
tiles, where the AVX512-BF16 build runs its bfloat16 prompt products and attention on the tiles, those
tests run once more with the tiles turned off (`TANDEM_CPU_TILES=0`): the paths a CPU without tiles
takes. A variant this CPU lacks is skipped with its reason."""

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
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
        | {"avx512_vnni"}: "avx512_bf16",
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


OFF_THE_TILES = "avx512_bf16 off the tiles"
VARIANTS = [*cpu_kernels.VARIANTS, "portable", OFF_THE_TILES]
# name -> (the kernels' variant, more environment, the tests it runs: a pytest -k expression or all)
RUNS = {name: (name, {}, None) for name in VARIANTS} | {
    OFF_THE_TILES: ("avx512_bf16", {"TANDEM_CPU_TILES": "0"}, "prefill or tile or paged or the_kernels_run")
}


def why_not(name: str) -> str | None:
    """Why this process does not run `name`'s kernel tests again, or None if it does."""
    variant = RUNS[name][0]
    needs = cpu_kernels.VARIANTS[variant][0] if variant in cpu_kernels.VARIANTS else set()
    if name == OFF_THE_TILES:
        needs = needs | {"amx_bf16"}
    if not needs <= cpu_flags():
        return f"this CPU lacks {', '.join(sorted(needs - cpu_flags()))}"
    if name == cpu_kernels.variant():
        return f"{name} is this process's own: test_cpu_kernels.py checks it in the suite's run"
    return None


@pytest.fixture(scope="module")
def runs():
    """Every variant's run of the kernel tests, started at once, each on one thread: the vector code
    is what differs between variants; the threading around it is the same in all of them, and the
    suite's own run of test_cpu_kernels.py checks it on every core."""
    started = {}
    for name in VARIANTS:
        if why_not(name) is None:
            variant, more, only = RUNS[name]
            env = {**os.environ, "TANDEM_CPU_KERNELS": variant, "OMP_NUM_THREADS": "1", **more}
            select = ["-k", only] if only else []
            started[name] = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cpu_kernels.py", *select],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
    yield started
    for run in started.values():
        run.kill()


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_this_cpu_runs_passes_the_kernel_tests(name, runs):
    if (reason := why_not(name)) is not None:
        pytest.skip(reason)
    stdout, stderr = runs[name].communicate(timeout=900)
    assert runs[name].returncode == 0, stdout[-4000:] + stderr[-2000:]
    assert " passed" in stdout and " skipped" not in stdout.split("\n")[-2], stdout[-500:]
