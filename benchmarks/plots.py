"""What the benchmarks' bar charts share: panels side by side over the same rows, written as a PNG."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    values: list[float]  # one bar a row
    ylabel: str
    title: str
    marks: list[float] | None = None  # a black tick a row (a goal, an ideal), labelled `marks_label`
    marks_label: str = ""
    beside: list[float] | None = None  # a second bar a row, next to the first: (first, second) labels
    labels: tuple[str, str] = ("", "")


def bar_panels(path: Path, rows: list[str], panels: list[Panel], title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel.beside is None:
            ax.bar(rows, panel.values)
        else:
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], panel.values, 0.4, label=panel.labels[0])
            ax.bar([x + 0.2 for x in xs], panel.beside, 0.4, label=panel.labels[1])
            ax.set_xticks(list(xs), rows)
        if panel.marks is not None:
            ax.plot(rows, panel.marks, "k_", markersize=30, label=panel.marks_label)
        if panel.marks is not None or panel.beside is not None:
            ax.legend(loc="lower right" if panel.marks is not None else "best")
        ax.set(ylabel=panel.ylabel, title=panel.title)
        ax.tick_params(axis="x", rotation=20)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
