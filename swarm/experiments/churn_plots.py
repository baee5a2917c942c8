"""The churn experiment's plots: loss against step and time, throughput over time, leaves and joins marked."""

from __future__ import annotations

from pathlib import Path

from swarm.experiments.churn_report import completion_times, read_jsonl, read_steps

__all__ = ["save_plots", "throughput_series"]

MARKS = {"kill": ("tab:red", "kill (SIGKILL)"), "term": ("tab:orange", "term (SIGTERM)"), "join": ("tab:green", "join")}
WINDOW_S = 15.0
"""Throughput is counted over trailing windows of this many seconds."""


def throughput_series(
    done: list[float], batch_size: int, window_s: float = WINDOW_S
) -> tuple[list[float], list[float]]:
    """(seconds since the first step, samples/s over the trailing `window_s`) at each completed step."""
    if not done:
        return [], []
    t0, xs, ys = done[0], [], []
    for i, t in enumerate(done):
        n = sum(1 for u in done[: i + 1] if u > t - window_s)
        xs.append(t - t0)
        ys.append(n * batch_size / min(window_s, max(t - t0, 1e-9)) if t > t0 else 0.0)
    return xs, ys


def _load(out: Path, setting: str):
    d = out / setting
    rows = read_steps(d / "steps.csv")
    done = completion_times(rows, read_jsonl(d / "step_clock.jsonl"))
    return rows, done, read_jsonl(d / "events.jsonl")


def save_plots(out: Path, settings: list[str], batch_size: int = 8) -> list[Path]:
    """loss_vs_step.png, loss_vs_time.png, throughput.png in `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from swarm.plots import moving_average

    data = {s: _load(out, s) for s in settings}
    paths = []
    for name, title in (("loss_vs_step", "loss against step"), ("loss_vs_time", "loss against time"),
                        ("throughput", f"samples/s over the last {WINDOW_S:g} s")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(9, 4.5))
        marked: set[str] = set()  # one legend entry per kind of event
        for setting, (rows, done, events) in data.items():
            pairs = [(r, t) for r, t in zip(rows, done, strict=True) if t is not None]
            if not pairs:
                continue
            t0 = pairs[0][1]
            losses = moving_average([float(r["train_loss"]) for r, _ in pairs], 4)
            if name == "loss_vs_step":
                ax.plot([int(r["step"]) for r, _ in pairs], losses, label=setting)
            elif name == "loss_vs_time":
                ax.plot([t - t0 for _, t in pairs], losses, label=setting)
            else:
                ax.plot(*throughput_series([t for _, t in pairs], batch_size), label=setting)
            for e in events:
                color, label = MARKS.get(e.get("kind"), (None, None))
                if color is None:
                    continue
                x = sum(1 for t in done if t is not None and t <= e["t"]) if name == "loss_vs_step" else e["t"] - t0
                ax.axvline(x, color=color, alpha=0.5, lw=1, ls="--", label=None if e["kind"] in marked else label)
                marked.add(e["kind"])
        ax.set_xlabel("step" if name == "loss_vs_step" else "seconds since the first step")
        ax.set_ylabel("samples/s" if name == "throughput" else "training loss (moving average of 4)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
