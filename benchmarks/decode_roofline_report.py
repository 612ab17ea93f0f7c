"""The report of `decode_roofline.py`: one record and one printed row per decode step measured,
and the figure (fraction of the memory roofline against batch; section 4's speed-ups over bfloat16)."""

from __future__ import annotations

from pathlib import Path

from cluster.model.weights import DTYPES


def _record(engine: str, dtype: str, batch: int, t: float, nbytes: int, flops: int, bandwidth: float,
            matmul: float) -> dict:  # fmt: skip
    return {
        "engine": engine,
        "dtype": dtype,
        "batch": batch,
        "step_s": t,
        "bytes": nbytes,
        "flops": flops,
        "GBps": nbytes / t / 1e9,
        "bandwidth_GBps": bandwidth / 1e9,
        "roofline_frac": nbytes / t / bandwidth,
        "matmul_GFLOPs": matmul / 1e9,
        "compute_frac": flops / t / matmul,
    }


def _row(what: str, batch: int, t: float, nbytes: int, flops: int, bandwidth: float, matmul: float) -> None:
    print(f"{what:<28}{batch:>6}{t * 1e3:>10.2f}{nbytes / 1e6:>10.1f}{nbytes / t / 1e9:>8.1f}{bandwidth / 1e9:>8.1f}"
          f"{nbytes / t / bandwidth:>9.0%}{flops / t / 1e9:>9.1f}{matmul / 1e9:>8.0f}"
          f"{flops / t / matmul:>10.0%}")  # fmt: skip


def _plot_roofline(results: dict, ax) -> None:  # type: ignore[no-untyped-def]
    for engine, marker in (("tandem compiled", "o-"), ("tandem eager", "^:"), ("transformers", "s--")):
        for dtype in DTYPES:
            runs = [r for r in results["runs"] if r["engine"] == engine and r["dtype"] == dtype]
            if runs:
                ax.plot([r["batch"] for r in runs], [100 * r["roofline_frac"] for r in runs], marker,
                        label=f"{engine} {dtype}")  # fmt: skip
    ax.axhline(100, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences per decode step)")
    ax.set_ylabel("% of memory-bandwidth roofline")
    ax.set_title(f"{results['preset']} decode, {results['context']}-token context, {results['device']}")
    ax.legend()


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quant = results.get("quantised", [])
    panels = int(bool(results["runs"])) + int(bool(quant))
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4), squeeze=False)
    if results["runs"]:
        _plot_roofline(results, axes[0][0])
    if quant:
        qa = axes[0][-1]
        settings = list(dict.fromkeys(r["setting"] for r in quant))
        batches = sorted({r["batch"] for r in quant})
        for j, batch in enumerate(batches):
            runs = {r["setting"]: r for r in quant if r["batch"] == batch}
            xs = [i + (j - (len(batches) - 1) / 2) * 0.35 for i in range(len(settings))]
            qa.bar(xs, [runs[s]["speedup_vs_bf16"] for s in settings], 0.35, label=f"batch {batch}")
        qa.axhline(1.0, color="grey", lw=0.8)
        qa.set_xticks(range(len(settings)), settings, rotation=20, ha="right")
        qa.set_ylabel("decode step speed-up over bfloat16")
        qa.set_title(f"fewer bytes per token ({results.get('quantised_mode', 'compiled')} decode)")
        qa.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
