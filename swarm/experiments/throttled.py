"""`swarm experiment throttled`: link speed x codec setting, each cell a real local swarm on shaped links.

Every cell starts a bootstrap node and swarm-peer processes whose links are shaped (the application's token
bucket by default, kernel `tc` in network namespaces with `--netns`), trains a fixed number of steps from
the same seed on a data set small enough that every sample comes back several times, and records every
step. `mean_step_s` is taken over the steps after the first epoch (AQ-SGD's steady state: every sample
has been seen once); the first epoch's mean is reported beside it.

This CPU computes about a thousand times slower than a GPU, so at equal link speed it is far less bound by
the network than the AQ-SGD paper's GPUs were. The report gives, per link speed, fp32's time on the wire
over its compute time per step: that ratio is what makes results comparable across machines.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.train.trainer import TrainConfig

RATES = [10.0, 100.0, 1000.0, None]
SETTINGS = ["fp32/fp32", "directq2/gradq4", "directq4/gradq8", "aqsgd2/gradq4", "aqsgd4/gradq8"]
QUICK_RATES = [10.0, None]
QUICK_SETTINGS = ["fp32/fp32", "aqsgd2/gradq4"]
COLUMNS = [
    "rate_mbit",
    "setting",
    "fw_bits",
    "bw_bits",
    "mean_step_s",
    "first_epoch_step_s",
    "throughput_samples_per_s",
    "wire_bytes",
    "final_loss",
    "speedup_vs_fp32",
    "slowdown_vs_fp32_unshaped",
]


@dataclass(frozen=True)
class Cell:
    rate_mbit: float | None
    setting: str

    @property
    def label(self) -> str:
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g}mbit"
        return f"{rate}-{self.setting.replace('/', '-')}"


@dataclass(frozen=True)
class ThrottledConfig:
    """The matrix of `swarm experiment throttled`: every link speed with every codec setting."""

    rates: tuple[float | None, ...] = tuple(RATES)
    """Link speeds of the cells, Mbit/s; None: an unshaped link."""
    settings: tuple[str, ...] = tuple(SETTINGS)
    """FW/BW codec pairs of the cells; the fp32/* ones are the baseline of the comparisons."""
    steps: int = 40
    """Optimizer steps per cell."""
    train_samples: int = 32
    """Training samples, a multiple of `batch_size`."""
    batch_size: int = 8
    """Samples per step."""
    micro_batches: int = 4
    """Micro-batches per step."""
    peers: int = 2
    """swarm-peer processes, one stage each."""
    delay_ms: float = 0.0
    """One-way delay of every link, ms."""
    netns: bool = False
    """Shape with tc in network namespaces (needs root) instead of the application's shaper."""
    out: Path | None = None
    """Output folder (None: runs/throttled-<time>)."""

    def __post_init__(self) -> None:
        for name in ("steps", "train_samples", "batch_size", "micro_batches", "peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"ThrottledConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.train_samples % self.batch_size:
            raise ValueError("--train-samples must be a multiple of --batch-size")

    @property
    def cells(self) -> list[Cell]:
        return [Cell(rate, setting) for rate in self.rates for setting in self.settings]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rates",
        default=",".join("none" if r is None else f"{r:g}" for r in RATES),
        help="comma-separated link speeds in Mbit/s, 'none' for an unshaped link (default %(default)s)",
    )
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated FW/BW codec pairs")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per cell (default %(default)s)")
    parser.add_argument("--train-samples", type=int, default=32, help="training samples (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per step (default %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default %(default)s)")
    parser.add_argument("--peers", type=int, default=2, help="swarm-peer processes, one stage each")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of every link, ms")
    parser.add_argument("--netns", action="store_true", help="shape with tc in network namespaces (needs root)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/throttled-<time>)")
    parser.add_argument("--quick", action="store_true", help="a small matrix (10 Mbit/s and unshaped, 2 settings)")
    parser.add_argument("--json", action="store_true", help="print the table rows as JSON")


def config_from_args(args: argparse.Namespace) -> ThrottledConfig:
    """The ThrottledConfig of the flags; --quick shrinks the matrix, and an fp32 baseline is always run."""
    rates = [None if r.strip().lower() in ("none", "unshaped") else float(r) for r in args.rates.split(",")]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    steps, train_samples = args.steps, args.train_samples
    if args.quick:
        rates, settings = list(QUICK_RATES), list(QUICK_SETTINGS)
        steps, train_samples = min(steps, 8), min(train_samples, 16)
    if not any(s.startswith("fp32/") for s in settings):
        settings.insert(0, "fp32/fp32")
    return ThrottledConfig(
        rates=tuple(rates),
        settings=tuple(settings),
        steps=steps,
        train_samples=train_samples,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        peers=args.peers,
        delay_ms=args.delay_ms,
        netns=args.netns,
        out=args.out,
    )


def train_config(cell: Cell, cfg: ThrottledConfig, out: Path) -> TrainConfig:
    """The trainer of one cell: the entry points' default model, every cell from the same seed."""
    from swarm.train.trainer import TrainConfig

    return TrainConfig(
        train_samples=cfg.train_samples, batch_size=cfg.batch_size, micro_batches=cfg.micro_batches,
        schedule="1f1b", steps=cfg.steps, seed=0, setting=cell.setting, deadline_s=300.0, out=str(out / cell.label),
    )  # fmt: skip


def _bits(codec: str) -> int:
    digits = codec.removesuffix("+ef").lstrip("abcdefghijklmnopqrstuvwxyz")
    return int(digits) if codec[:2] not in ("fp", "bf") else int(codec[-2:])


def _run_cell(cell: Cell, cfg: ThrottledConfig, out: Path) -> list[dict]:
    from swarm.testbed.local import local_swarm
    from swarm.train.trainer import train

    fw, bw = cell.setting.split("/")
    # an even split, the same in every cell: the planner's split follows noisy compute measurements, and a
    # different stage boundary would change the training math between the cells being compared
    flags = ["--assign", "even", "--fw-codec", fw, "--bw-codec", bw, "--delay-ms", str(cfg.delay_ms)]
    flags += ["--total-steps", str(cfg.steps), "--warmup-steps", str(max(1, cfg.steps // 10))]
    if cell.rate_mbit is not None:
        flags += ["--rate-mbit", str(cell.rate_mbit)]
    train_cfg = train_config(cell, cfg, out)
    if cfg.netns:
        from swarm.testbed.cli import run_in_testbed

        return run_in_testbed(cell, flags, train_cfg, cfg.peers)
    with local_swarm(out / cell.label, cfg.peers, flags) as swarm:
        train(train_cfg, swarm.path, quiet=True, signer=swarm.signer)
    with open(out / cell.label / "steps.csv") as f:
        return list(csv.DictReader(f))


def summarize(cell: Cell, steps: list[dict], steps_per_epoch: int, batch_size: int) -> dict:
    times = [float(s["step_s"]) for s in steps]
    steady = times[steps_per_epoch:] or times
    first = times[:steps_per_epoch]
    fw, bw = cell.setting.split("/")
    wire = sum(int(s["forward_bytes"]) + int(s["backward_bytes"]) for s in steps)
    losses = [float(s["train_loss"]) for s in steps]
    return {
        "rate_mbit": cell.rate_mbit,
        "setting": cell.setting,
        "fw_bits": _bits(fw),
        "bw_bits": _bits(bw),
        "mean_step_s": statistics.mean(steady),
        "first_epoch_step_s": statistics.mean(first),
        "throughput_samples_per_s": batch_size / statistics.mean(steady),
        "wire_bytes": wire,
        "fp32_wire_bytes": sum(int(s["fp32_wire_bytes"]) for s in steps),
        "wire_bytes_per_step": wire / len(steps),
        # the tied embedding's gradient sync (through the trainer, fp32) is outside the stage links
        "sync_bytes": sum(int(s.get("sync_bytes") or 0) for s in steps),
        # links are full duplex: the busier direction bounds a step's time on the wire
        "busiest_direction_bytes_per_step": statistics.mean(
            max(int(s["forward_bytes"]), int(s["backward_bytes"])) for s in steps
        ),
        "final_loss": statistics.mean(losses[-steps_per_epoch:]),
        "steps": len(steps),
    }


def add_comparisons(rows: list[dict]) -> dict[float | None, float]:
    """Speed-ups against fp32 at the same rate and against fp32 unshaped; returns fp32's wire/compute ratio
    per rate (wire time = fp32's busier direction's bytes per step at that rate, since links are full
    duplex; compute = fp32's step time on the unshaped link)."""
    fp32 = {r["rate_mbit"]: r for r in rows if r["setting"].startswith("fp32/")}
    unshaped = fp32.get(None)
    for r in rows:
        base = fp32.get(r["rate_mbit"])
        r["speedup_vs_fp32"] = base["mean_step_s"] / r["mean_step_s"] if base else None
        r["slowdown_vs_fp32_unshaped"] = r["mean_step_s"] / unshaped["mean_step_s"] if unshaped else None
    ratios = {}
    if unshaped:
        for rate, r in fp32.items():
            if rate is not None:
                wire_s = r["busiest_direction_bytes_per_step"] * 8 / (rate * 1e6)
                ratios[rate] = wire_s / unshaped["mean_step_s"]
    return ratios


def write_outputs(out: Path, rows: list[dict], all_steps: dict[Cell, list[dict]], ratios: dict) -> None:
    from swarm.plots import Panel, moving_average, save_line_plots

    with open(out / "steps.csv", "w", newline="") as f:
        fields = ["rate_mbit", "setting", *next(iter(all_steps.values()))[0].keys()]
        writer = csv.DictWriter(f, fields, extrasaction="ignore")
        writer.writeheader()
        for cell, steps in all_steps.items():
            writer.writerows({"rate_mbit": cell.rate_mbit, **s, "setting": cell.setting} for s in steps)
    (out / "results.json").write_text(json.dumps({"rows": rows, "fp32_wire_over_compute": ratios}, indent=1))
    rates = sorted({c.rate_mbit for c in all_steps}, key=lambda r: (r is None, r or 0))
    panels = []
    for rate in rates:
        panel = Panel(f"{'unshaped' if rate is None else f'{rate:g} Mbit/s'}", "wall-clock time (s)", "loss")
        for cell, steps in all_steps.items():
            if cell.rate_mbit == rate:
                t, clock = [], 0.0
                for s in steps:
                    clock += float(s["step_s"])
                    t.append(clock)
                panel.series[cell.setting] = (t, moving_average([float(s["train_loss"]) for s in steps], 4))
        panels.append(panel)
    save_line_plots(panels, out / "loss_vs_time.png", "training loss against wall-clock time, per link speed")
    _bars(out / "step_time.png", rows, "mean_step_s", "mean step time (s), after the first epoch")
    _bars(out / "wire_bytes.png", rows, "wire_bytes", "bytes on the wire, whole run")
    (out / "report.md").write_text(_report(rows, ratios))


def _bars(path: Path, rows: list[dict], key: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in rows))
    rates = list(dict.fromkeys(r["rate_mbit"] for r in rows))
    width = 0.8 / len(settings)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, setting in enumerate(settings):
        values = [
            next((r[key] for r in rows if r["setting"] == setting and r["rate_mbit"] == rate), 0) for rate in rates
        ]
        ax.bar([x + i * width for x in range(len(rates))], values, width, label=setting)
    ax.set_xticks([x + width * (len(settings) - 1) / 2 for x in range(len(rates))])
    ax.set_xticklabels(["unshaped" if r is None else f"{r:g} Mbit/s" for r in rates])
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _report(rows: list[dict], ratios: dict) -> str:
    lines = [
        "# Throttled experiment",
        "",
        "| link | setting | mean step (s) | first epoch step (s) | samples/s | wire MB | final loss |"
        " speed-up vs fp32 | slowdown vs fp32 unshaped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        link = "unshaped" if r["rate_mbit"] is None else f"{r['rate_mbit']:g} Mbit/s"
        lines.append(
            f"| {link} | {r['setting']} | {r['mean_step_s']:.3f} | {r['first_epoch_step_s']:.3f} | "
            f"{r['throughput_samples_per_s']:.1f} | {r['wire_bytes'] / 1e6:.2f} | {r['final_loss']:.3f} | "
            f"{_fmt(r['speedup_vs_fp32'], '.2f')}x | {_fmt(r['slowdown_vs_fp32_unshaped'], '.2f')}x |"
        )
    lines += ["", "fp32's time on the wire over its compute time per step (compute = fp32's unshaped step):", ""]
    lines += [f"- {rate:g} Mbit/s: {ratio:.2f}" for rate, ratio in sorted(ratios.items())]
    sync = max((r["sync_bytes"] / r["steps"] for r in rows), default=0)
    if sync:
        lines += [
            "",
            f"Not in the wire bytes above: the tied embedding's gradient sync, {sync / 1e6:.2f} MB per step in every"
            " setting (fp32, stages to trainer and back). The application's shaper paces the stage links only, so"
            " it does not slow these steps; in the kernel testbed (--netns) every byte is shaped and it does.",
        ]
    lines += ["", "Plots: loss_vs_time.png, step_time.png, wire_bytes.png; every step in steps.csv.", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from swarm.bench.common import print_table

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = cfg.out or Path(f"runs/throttled-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    cells = cfg.cells
    steps_per_epoch = cfg.train_samples // cfg.batch_size
    all_steps, rows = {}, []
    with tqdm(cells, desc="cells", unit="cell", file=sys.stderr) as bar:  # stderr: --json stays clean
        for cell in bar:
            bar.set_postfix_str(cell.label)
            all_steps[cell] = _run_cell(cell, cfg, out)
            rows.append(summarize(cell, all_steps[cell], steps_per_epoch, cfg.batch_size))
    ratios = add_comparisons(rows)
    write_outputs(out, rows, all_steps, ratios)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, COLUMNS, f"throttled experiment ({len(cells)} cells, {cfg.steps} steps each)")
        print("fp32 wire/compute per step: " + ", ".join(f"{r:g} Mbit/s {v:.2f}" for r, v in sorted(ratios.items())))
        print(f"wrote {out}/report.md, steps.csv, results.json, loss_vs_time.png, step_time.png, wire_bytes.png")
    return 0
