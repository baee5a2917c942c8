"""The early loss spike of the convergence run, one factor at a time.

Trains the convergence experiment's fp32 setting (same model, data, batches, seed, 8 epochs, warm-up 5% of
the run) through the swarm's own pipeline (`LocalPipeline`, fp32 both ways) once per variant, each variant
changing one thing (warm-up length, Adam's eps/betas, the init, clipping, the peak rate), and prints per
variant the largest train loss and gradient norm, the step they happened at, and the final held-out loss.
Writes `spike.csv` (per step), `spike.json` (the table) and `spike.png` (train loss and gradient norm per
step) into --out.

    python scripts/loss_spike.py --variants old,new --out runs/spike
    python scripts/loss_spike.py --list
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from swarm.compression import CodecConfig
from swarm.experiments.convergence import ExperimentConfig
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.model.gpt import ModelConfig
from swarm.plots import Panel, save_line_plots
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import OptimConfig, StageConfig

OLD_OPTIM = {"lr_peak": 2e-3, "betas": (0.9, 0.95), "eps": 1e-8}
"""The optimizer defaults before the fix (session 21), so `old` keeps reproducing the spike."""
OLD_MODEL: dict = {}

# name -> (description, OptimConfig overrides, ModelConfig overrides, warm-up fraction or None = the
# convergence experiment's default)
VARIANTS: dict[str, tuple[str, dict, dict, float | None]] = {
    "old": ("defaults before the fix", OLD_OPTIM, OLD_MODEL, 0.05),
    "new": ("today's defaults", {}, {}, None),
    "warmup10": ("old, warm-up 10% of the run", OLD_OPTIM, OLD_MODEL, 0.10),
    "warmup20": ("old, warm-up 20% of the run", OLD_OPTIM, OLD_MODEL, 0.20),
    "lr1e-3": ("old, peak lr 1e-3", {**OLD_OPTIM, "lr_peak": 1e-3}, OLD_MODEL, 0.05),
    "lr1.5e-3": ("old, peak lr 1.5e-3", {**OLD_OPTIM, "lr_peak": 1.5e-3}, OLD_MODEL, 0.05),
    "beta2-.99": ("old, Adam beta2 0.99", {**OLD_OPTIM, "betas": (0.9, 0.99)}, OLD_MODEL, 0.05),
    "beta2-.999": ("old, Adam beta2 0.999", {**OLD_OPTIM, "betas": (0.9, 0.999)}, OLD_MODEL, 0.05),
    "eps1e-6": ("old, Adam eps 1e-6", {**OLD_OPTIM, "eps": 1e-6}, OLD_MODEL, 0.05),
    "noclip": ("old, no clipping", {**OLD_OPTIM, "grad_clip_norm": None}, OLD_MODEL, 0.05),
    "init.01": ("old, init std 0.01", OLD_OPTIM, {**OLD_MODEL, "init_std": 0.01}, 0.05),
}


def summarize(name: str, rows: list[dict], warmup: int, eval_loss: float) -> dict:
    """The spike figures of one variant from its per-step rows."""
    after = [r for r in rows if r["step"] > warmup]
    # A spike is a loss above the previous step's (the first steps' high losses are the init's, not spikes).
    jumps = [(b["train_loss"] - a["train_loss"], b) for a, b in zip(rows, rows[1:], strict=False)]
    rise, worst = max(jumps, key=lambda j: j[0]) if jumps else (0.0, rows[0])
    summary = {
        "variant": name,
        "what": VARIANTS[name][0] if name in VARIANTS else name,
        "warmup_steps": warmup,
        "max_rise": rise,
        "loss_at_rise": worst["train_loss"],
        "at_step": worst["step"],
        "max_grad_norm": max(r["grad_norm"] for r in rows),
        "median_grad_norm_after_warmup": float(torch.tensor([r["grad_norm"] for r in after]).median()) if after else 0,
        "final_eval_loss": eval_loss,
    }
    return summary


def run_variant(name: str, args: argparse.Namespace, train, evals) -> tuple[dict, list[dict]]:
    desc, optim_over, model_over, warm = VARIANTS[name]
    model = replace(ModelConfig(init_seed=args.seed), **model_over)
    steps_per_epoch = len(train) // args.batch_size
    total = steps_per_epoch * args.epochs
    fraction = ExperimentConfig().warmup_fraction if warm is None else warm
    warmup = max(1, round(total * fraction))
    optim = replace(OptimConfig(), total_steps=total, warmup_steps=warmup, **optim_over)
    fp32 = CodecConfig(name="fp32", zstd_level=0)
    pipe = LocalPipeline(model, args.stages, fp32, fp32, schedule="1f1b", stage_cfg=StageConfig(optim))
    rows, step, start = [], 0, time.perf_counter()
    try:
        for epoch in range(args.epochs):
            for batch in epoch_batches(train, args.batch_size, epoch, args.seed):
                if args.max_steps and step >= args.max_steps:
                    break
                r = pipe.train_step(batch, args.micro_batches)
                step += 1
                rows.append({"variant": name, "step": step, "train_loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm})
        eval_loss = pipe.evaluate(evals, args.batch_size * 2) if step == total else float("nan")
    finally:
        pipe.close()
    summary = summarize(name, rows, warmup, eval_loss)
    summary["seconds"] = time.perf_counter() - start
    return summary, rows


def format_table(summaries: list[dict]) -> str:
    head = "| variant | what | warm-up | largest rise | to (step) | max grad norm | median grad norm | held-out |"
    lines = [head, "|" + " --- |" * 8]
    for s in summaries:
        lines.append(
            f"| {s['variant']} | {s['what']} | {s['warmup_steps']} | {s['max_rise']:+.2f} | "
            f"{s['loss_at_rise']:.2f} ({int(s['at_step'])}) | {s['max_grad_norm']:.2f} | "
            f"{s['median_grad_norm_after_warmup']:.2f} | {s['final_eval_loss']:.4f} |"
        )
    return "\n".join(lines)


def write_outputs(out: Path, names: list[str], summaries: list[dict], rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "spike.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "spike.json").write_text(json.dumps(summaries, indent=1))
    panels = [Panel("train loss", "step", "loss"), Panel("global gradient norm", "step", "norm", logy=True)]
    for name in names:
        steps = [r["step"] for r in rows if r["variant"] == name]
        panels[0].series[name] = (steps, [r["train_loss"] for r in rows if r["variant"] == name])
        panels[1].series[name] = (steps, [r["grad_norm"] for r in rows if r["variant"] == name])
    save_line_plots(panels, out / "spike.png", suptitle="fp32 convergence run, one factor at a time")
    print(format_table(summaries))
    print(f"wrote {out}/spike.csv, spike.json, spike.png", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="old,new", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many steps, same schedule (no held-out loss)"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/loss-spike"))
    p.add_argument(
        "--merge", type=Path, nargs="*", default=None, help="instead of training, merge earlier --out folders"
    )
    args = p.parse_args(argv)
    if args.merge:
        summaries, rows = [], []
        for folder in args.merge:
            with open(folder / "spike.csv", newline="") as f:
                part = [{k: (v if k == "variant" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]
            for old in json.loads((folder / "spike.json").read_text()):
                mine = [r for r in part if r["variant"] == old["variant"]]
                summaries.append(summarize(old["variant"], mine, old["warmup_steps"], old["final_eval_loss"]))
            rows += part
        write_outputs(args.out, [s["variant"] for s in summaries], summaries, rows)
        return 0
    if args.list:
        for name, (desc, *_rest) in VARIANTS.items():
            print(f"{name:12s} {desc}")
        return 0
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; --list shows them")
    torch.set_num_threads(1)
    train, evals, report = build_datasets(DataConfig())
    print(report.describe(), file=sys.stderr)
    summaries, rows = [], []
    for name in names:
        s, r = run_variant(name, args, train, evals)
        print(f"{name}: largest rise {s['max_rise']:+.2f} to {s['loss_at_rise']:.2f} at step {s['at_step']}, held-out "
              f"{s['final_eval_loss']:.4f} ({s['seconds']:.0f} s)", file=sys.stderr)  # fmt: skip
        summaries.append(s)
        rows += r
    write_outputs(args.out, names, summaries, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
