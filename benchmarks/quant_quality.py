"""What quantisation costs in quality, for every weight and KV setting, in one run.

    .venv/bin/python benchmarks/quant_quality.py

Models: the bundled demo model (`models/tandem-demo-code`) on its held-out text (16 windows of 256
tokens), and the `tiny` random-weight preset on random tokens (8 windows of 256), both in bfloat16.
For each setting: held-out loss (nats per token) against the unquantised model's, and top-1
agreement: the share of positions where both predict the same next token on the same text
(`cluster.model.quality`). Prints a table and writes `benchmarks/results/quant_quality.{json,png}`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cluster.model.builder import init_model_folder  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from cluster.model.quality import agreement, heldout_windows, random_windows, score  # noqa: E402
from cluster.model.tokenizer import Tokenizer  # noqa: E402

DEMO = ROOT / "models" / "tandem-demo-code"
OUT = ROOT / "benchmarks" / "results"
SETTINGS = (  # (label, weights, int4 group, KV cache)
    ("int8 weights", "int8", 128, "auto"),
    ("int4 weights, groups of 32", "int4", 32, "auto"),
    ("int4 weights, groups of 128", "int4", 128, "auto"),
    ("int8 KV cache", "auto", 128, "int8"),
    ("int8 weights + int8 KV", "int8", 128, "int8"),
)


def main() -> None:
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        random_folder = init_model_folder(Path(tmp) / "tiny", "tiny", dtype="bfloat16", seed=0)
        models = {
            "tandem-demo-code": (DEMO, heldout_windows(DEMO, Tokenizer(DEMO), length=256, count=16)),
            "tiny (random weights)": (random_folder, random_windows(512, length=256, count=8)),
        }
        for name, (folder, windows) in models.items():
            reference = score(load_model(folder, "bfloat16"), windows)
            rows.append({"model": name, "setting": "bfloat16", "loss": reference.loss, "agreement": 1.0})
            for label, weights, group, kv in SETTINGS:
                quantised = score(load_model(folder, "bfloat16", weight_dtype=weights, group_size=group), windows, kv)
                rows.append({"model": name, "setting": label, "loss": quantised.loss,
                             "loss_change": quantised.loss / reference.loss - 1,
                             "agreement": agreement(quantised, reference)})  # fmt: skip
    print(f"{'model':<24}{'setting':<30}{'loss':>8}{'change':>9}{'top-1 agreement':>17}")
    for r in rows:
        change = f"{100 * r['loss_change']:+.2f}%" if "loss_change" in r else ""
        print(f"{r['model']:<24}{r['setting']:<30}{r['loss']:>8.4f}{change:>9}{100 * r['agreement']:>16.1f}%")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "quant_quality.json").write_text(json.dumps(rows, indent=2))
    plot(rows, OUT / "quant_quality.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [label for label, *_ in SETTINGS]
    models = list(dict.fromkeys(r["model"] for r in rows))
    for j, model in enumerate(models):
        by = {r["setting"]: r for r in rows if r["model"] == model}
        xs = [i + (j - 0.5) * 0.4 for i in range(len(labels))]
        ax.bar(xs, [100 * by[label]["agreement"] for label in labels], 0.4, label=model)
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right")
    ax.set_ylim(50, 100)
    ax.set_ylabel("top-1 agreement with bfloat16 (%)")
    ax.set_title("What quantisation costs: next-token agreement over 256-token windows")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
