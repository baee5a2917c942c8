"""PNG line plots for experiments, drawn headless with matplotlib's Agg backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Panel", "save_line_plots", "moving_average"]


@dataclass
class Panel:
    """One subplot: named series of (x, y) points sharing axes."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    logy: bool = False


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points, so noisy per-step losses stay readable."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def save_line_plots(panels: list[Panel], path: Path, suptitle: str = "", ncols: int = 2) -> Path:
    """Draw the panels in a grid of `ncols` columns into `path` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for name, (xs, ys) in panel.series.items():
            ax.plot(xs, ys, label=name, linewidth=1.4, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        if panel.logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
