"""The GPU check's pictures, drawn from its summary (benchmarks/gpu_check.py calls these)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt


def _where(summary: dict) -> str:
    env = summary["environment"]
    return f"{env['device_name']}{' (dry run)' if summary['dry_run'] else ''}"


def plot_decode(result: dict, summary: dict, path: Path) -> None:
    rows = result["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for engine, style in (("tandem eager", "o-"), ("transformers", "s--")):
            for context in sorted({r["context"] for r in rows if r["model"] == model and r["engine"] == engine}):
                line = [r for r in rows if r["model"] == model and r["engine"] == engine and r["context"] == context]
                ax.plot([r["batch"] for r in line], [100 * r["roofline_frac"] for r in line], style,
                        label=f"{engine}, {context}-token context")  # fmt: skip
        ax.axhline(100, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences per decode step)")
        ax.set_ylabel("% of the measured memory bandwidth")
        ax.set_title(f"{model} bf16 decode, {_where(summary)}")
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_prefill(result: dict, summary: dict, path: Path) -> None:
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        line = [r for r in rows if r["model"] == model]
        ax.plot([r["prompt_tokens"] for r in line], [100 * r["mfu"] for r in line], "o-", label=model)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (one sequence)")
    ax.set_ylabel("% of the measured bf16 matmul rate (MFU)")
    ax.set_title(f"prefill MFU, {_where(summary)}")
    ax.legend()
    _save(fig, path)


def plot_overlap(result: dict, summary: dict, path: Path) -> None:
    rows, modes = result["rows"], result["modes"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r["median_s"][mode] * 1e3 for r in rows], width, label=mode)
    labels = [f"{r['prompt_tokens']} tokens\ntwo streams hide {r['hidden']['two streams']:.0%}" for r in rows]
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("ms from prefill start to KV admitted")
    ax.set_title(f"layer-wise KV shipping over gRPC, {_where(summary)}")
    ax.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: Path) -> None:  # type: ignore[no-untyped-def]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
