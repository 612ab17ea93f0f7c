"""What this machine's CPU offers the model, read from its flags (`/proc/cpuinfo`, no torch).

    cpu_flags()         the CPU's feature flags (empty where they cannot be read)
    cpu_kind()          the kind every figure names: "AVX-512 with VNNI and BF16", "AVX2", ...
    results_suffix()    a benchmark's file suffix for this kind: "" (AVX-512), "_amx", "_avx2"
    auto_dtype(device)  the element type `model.dtype: auto` becomes here, and why

bfloat16 pays on a CPU that multiplies it natively (AVX512-BF16 pair products, or AMX tiles): half
the bytes read per decode step at float32's speed of arithmetic. Elsewhere torch emulates every
bfloat16 product through float32 conversions, and a SmolLM2 decode step measured several times
slower than in float32 on an AVX2 machine (docs/performance.md), so auto picks float32 there.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(next((line for line in lines if line.startswith("flags")), "").partition(":")[2].split())


def cpu_kind() -> str:
    flags = cpu_flags()
    if {"avx512f", "avx512_vnni", "avx512_bf16"} <= flags:
        return "AVX-512 with VNNI, BF16 and AMX" if "amx_bf16" in flags else "AVX-512 with VNNI and BF16"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "neither AVX2 nor AVX-512"


def results_suffix() -> str:
    """Each kind of CPU keeps its own benchmark files; AMX (Intel Xeon) apart from AVX-512 alone."""
    if "AVX-512" not in cpu_kind():
        return "_avx2"
    return "_amx" if "AMX" in cpu_kind() else ""


def auto_dtype(device: str) -> tuple[str, str]:
    """`model.dtype: auto` on `device`: the dtype, and the reason in words."""
    if device == "cuda":
        return "bfloat16", "a GPU multiplies bfloat16 natively"
    native = cpu_flags() & {"avx512_bf16", "amx_bf16"}
    if native:
        return "bfloat16", f"this CPU multiplies bfloat16 natively ({', '.join(sorted(native))})"
    return "float32", f"this CPU ({cpu_kind()}) has no native bfloat16 products; torch would emulate them"
