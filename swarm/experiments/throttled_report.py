"""The throttled experiment's outputs: the markdown report with its targets, the comparison with PyTorch's
pipeline, the plots, results.json and steps.csv (split from `swarm.experiments.throttled`, which runs the cells)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from swarm.experiments.throttled import Cell, _fmt, _link, check_targets

PHASE_ORDER = ["labels", "pipeline", "reduce", "grads", "commit", "step"]
"""The trainer's phases in a step's order (`swarm.train.trainer`'s phase clocks)."""


def torch_comparison(rows: list[dict]) -> list[str]:
    """Per rate, swarm's fp32 step time against PyTorch's own pipeline's (rows of setting torch-fp32)."""
    fp32 = {r["rate_mbit"]: r for r in rows if r["setting"].startswith("fp32/")}
    lines = []
    for t in (r for r in rows if r["setting"] == "torch-fp32"):
        ours = fp32.get(t["rate_mbit"])
        if ours is None:
            continue
        ratio = ours["mean_step_s"] / t["mean_step_s"]
        verdict = f"swarm's fp32 is {ratio:.2f}x slower" if ratio > 1 else f"swarm's fp32 is {1 / ratio:.2f}x faster"
        lines.append(
            f"- {_link(t['rate_mbit'])}: swarm fp32 {ours['mean_step_s']:.3f} s/step, torch fp32 "
            f"{t['mean_step_s']:.3f} s/step: {verdict}; wire MB per step {ours['wire_bytes'] / ours['steps'] / 1e6:.2f}"
            f" (swarm boundaries) vs {t['wire_bytes'] / max(t['steps'], 1) / 1e6:.2f} (torch)"
        )
    return lines


def machine_cpu_lines(rows: list[dict]) -> list[str]:
    """The report's section on the machine's CPU a step (rows with `cpu_ms_per_step`; none: no section)."""
    measured = [r for r in rows if r.get("cpu_ms_per_step") is not None]
    if not measured:
        return []
    lines = [
        "",
        "## The machine's CPU a step (measured)",
        "",
        "Every process's busy CPU on this machine (the cell's peers, trainer, DHT daemons, and anything else "
        "running) over the steps after the first epoch, per step; the floor is that over the machine's cores: no "
        "schedule of these processes could make a step shorter. A cell whose floor nears its step is CPU-bound "
        "here, whatever its links.",
        "",
        "| link | setting | mean step (ms) | wall a step, gaps included (ms) | CPU a step (ms) | busy cores | of | "
        "floor (ms) | floor / mean step |",
        "|" + " --- |" * 9,
    ]
    for r in measured:
        lines.append(
            f"| {_link(r['rate_mbit'])} | {r['setting']} | {1000 * r['mean_step_s']:.0f} | "
            f"{1000 * r['wall_s_per_step']:.0f} | {r['cpu_ms_per_step']:.0f} | {r['busy_cores']:.2f} | {r['cores']} | "
            f"{1000 * r['cpu_floor_step_s']:.0f} | {r['cpu_floor_step_s'] / r['mean_step_s']:.0%} |"
        )
    return lines


def write_outputs(
    out: Path, rows: list[dict], all_steps: dict[Cell, list[dict]], ratios: dict, slow_note: str = ""
) -> None:
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
    if any(r.get("total_wire_bytes") for r in rows):
        _bars(out / "wire_bytes.png", rows, "total_wire_bytes", "all bytes on the wire (total), whole run")
    else:  # a runtime without totals: the boundary bytes
        _bars(out / "wire_bytes.png", rows, "wire_bytes", "bytes across the stage boundaries, whole run")
    (out / "report.md").write_text(report_markdown(rows, ratios, slow_note))


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
            next((r.get(key) or 0 for r in rows if r["setting"] == setting and r["rate_mbit"] == rate), 0)
            for rate in rates
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


def report_markdown(rows: list[dict], ratios: dict, slow_note: str = "") -> str:
    lines = [
        "# Throttled experiment",
        "",
        "| link | setting | mean step (s) | predicted (s) | error | first plan (s) | first epoch step (s) |"
        " samples/s | boundary MB | total MB | state MB | x fewer total | final loss | speed-up vs fp32 | rho |"
        " share of min(ratio, 1+rho) | slowdown vs fp32 unshaped |",
        "|" + " --- |" * 17,
    ]
    for r in rows:
        lines.append(
            f"| {_link(r['rate_mbit'])} | {r['setting']} | {r['mean_step_s']:.3f} | "
            f"{_fmt(r.get('predicted_step_s'), '.3f')} | {_fmt(r.get('predicted_error_pct'), '+.1f')}% | "
            f"{_fmt(r.get('first_plan_step_s'), '.3f')} | {_fmt(r.get('first_epoch_step_s'), '.3f')} | "
            f"{r['throughput_samples_per_s']:.1f} | "
            f"{r['wire_bytes'] / 1e6:.2f} | {_fmt(r.get('total_wire_bytes') or None, '.2f', 1e6)} | "
            f"{_fmt(r.get('state_bytes'), '.2f', 1e6)} | "
            f"{_fmt(r.get('total_ratio_vs_fp32'), '.2f')} | {_fmt(r.get('final_loss'), '.3f')} | "
            f"{_fmt(r['speedup_vs_fp32'], '.2f')}x | {_fmt(r.get('rho'), '.2f')} | "
            f"{_fmt(r.get('speedup_share'), '.0%')} | "
            f"{_fmt(r['slowdown_vs_fp32_unshaped'], '.2f')}x |"
        )
    lines += ["", "fp32's time on the wire over its compute time per step (rho; compute = fp32's unshaped step):", ""]
    lines += [f"- {rate:g} Mbit/s: {ratio:.2f}" for rate, ratio in sorted(ratios.items())]
    lines += [
        "",
        "Predicted: the plan the planner published during the run from the peers' clocks over the steps after the "
        "first epoch (`swarm.daemon.calibrate`: in-pipeline compute per micro-batch, the bytes sent, and the step "
        "overhead their step clocks measured beyond the modelled pipeline); first plan: its prediction before, from "
        "one block timed alone and the codecs' synthetic bytes. Error: predicted against the mean step after the "
        "first epoch.",
        "",
        "Total bytes count everything a step moves (both boundary directions, the tied-embedding sync, replica",
        "averaging, control calls); x fewer total divides each cell's fp32 equivalent (the same tensors at fp32,",
        "the same control bytes) by them. The share divides the speed-up by min(total byte ratio after the first",
        "epoch, 1 + rho): the most any codec can give on that link. State MB: the stage state the cell's peers copied",
        "to each other over GetState (held copies, fp32), from their logs: no step's, not in the totals.",
    ]
    seen = {p for r in rows for p in r.get("phase_ms") or {}}
    phases = [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))
    if phases:
        lines += [
            "",
            "## Where a step's time went (measured)",
            "",
            "The trainer's phases, median milliseconds a step after the first epoch (steps.csv), "
            "beside the mean step; an epilogue-only cell also names its compressed tails and predicted split.",
            "",
            "| link | setting | mean step (ms) | " + " | ".join(phases) + " | epilogue tails | predicted compute + "
            "transfer (s) |",
            "|" + " --- |" * (len(phases) + 5),
        ]
        for r in rows:
            split = r.get("phase_ms") or {}
            predicted = (
                f"{r['predicted_compute_s']:.3f} + {r['predicted_transfer_s']:.3f}"
                if r.get("predicted_compute_s") is not None and r.get("predicted_transfer_s") is not None
                else "-"
            )
            lines.append(
                f"| {_link(r['rate_mbit'])} | {r['setting']} | {1000 * r['mean_step_s']:.0f} | "
                + " | ".join(_fmt(split.get(p), ".1f") for p in phases)
                + f" | {r.get('tails') or '-'} | {predicted} |"
            )
    lines += machine_cpu_lines(rows)
    if slow_note:
        lines += ["", slow_note]
    lines += ["", "## Targets", ""]
    for statement, met in check_targets(rows):
        lines.append(f"- [{'not judged' if met is None else 'met' if met else 'MISSED'}] {statement}")
    comparison = torch_comparison(rows)
    if comparison:
        lines += ["", "## Swarm's fp32 against PyTorch's pipeline (torch-fp32, same links)", "", *comparison]
    lines += ["", "Plots: loss_vs_time.png, step_time.png, wire_bytes.png; every step in steps.csv.", ""]
    return "\n".join(lines)
