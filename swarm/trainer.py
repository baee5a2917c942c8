"""`swarm train`: find the stages in the DHT, then drive training across them with a progress bar.

Writes the same per-step CSV as the convergence experiment (plus step time and fp32-equivalent bytes),
a loss plot, and a JSON summary. A stage that fails mid-step is reported by stage and peer, and the
trainer exits non-zero.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.options import add_dht_arguments, add_model_arguments, dht_config, model_config

log = logging.getLogger("swarm.trainer")

CSV_FIELDS = [
    "setting",
    "step",
    "epoch",
    "train_loss",
    "lr",
    "grad_norm",
    "forward_bytes",
    "backward_bytes",
    "fp32_wire_bytes",
    "step_s",
]


@dataclass(frozen=True)
class TrainSummary:
    final_loss: float
    first_loss: float
    steps: int
    wire_bytes: int
    fp32_wire_bytes: int
    mean_step_s: float
    seconds: float
    stages: int
    route: list[str]
    csv: str
    plot: str | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dht_arguments(parser)
    add_model_arguments(parser)
    g = parser.add_argument_group("training")
    g.add_argument("--num-stages", type=int, default=2, help="stages the pipeline has; waits until all are served")
    g.add_argument("--data", default=None, help="a text file or folder (default: Python's own docstrings)")
    g.add_argument("--train-samples", type=int, default=64, help="training samples (each seen once per epoch)")
    g.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step")
    g.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (must divide the batch)")
    g.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="pipeline schedule")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs worth)")
    g.add_argument("--epochs", type=int, default=4, help="passes over the training samples")
    g.add_argument("--seed", type=int, default=0, help="seed of the data order")
    g.add_argument("--setting", default="swarm", help="label of this run in the CSV")
    g.add_argument("--wait-timeout-s", type=float, default=120.0, help="give up if the stages are not all served")
    g.add_argument("--deadline-s", type=float, default=120.0, help="longest a micro-batch may take end to end")
    g.add_argument("--out", default=None, help="folder for steps.csv, loss.png, summary.json (default runs/train-*)")
    g.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def discover_route(dht, n_stages: int, timeout_s: float, show=print) -> tuple[list[str], list[str]]:
    """Waits until every stage is announced; returns (addresses, peer ids) in pipeline order."""
    deadline = time.monotonic() + timeout_s
    last_line = None
    while True:
        by_stage = {}
        for ann in sorted(dht.peers(), key=lambda a: a.started_at):
            if ann.stage is not None and ann.stage < n_stages:
                by_stage.setdefault(ann.stage, ann)
        missing = [s for s in range(n_stages) if s not in by_stage]
        if not missing:
            return [by_stage[s].address for s in range(n_stages)], [by_stage[s].peer_id for s in range(n_stages)]
        line = f"waiting for stages {missing} ({n_stages - len(missing)}/{n_stages} served)"
        if line != last_line:
            show(line)
            last_line = line
        if time.monotonic() > deadline:
            raise TimeoutError(f"stages {missing} are not served after {timeout_s:.0f} s")
        time.sleep(0.5)


def train(args: argparse.Namespace, route: list[str], peers: list[str], quiet: bool = False) -> TrainSummary:
    """Trains over the stages at `route`; raises StageCallError if one fails."""
    from tqdm import tqdm

    from swarm.data import DataConfig, build_datasets, epoch_batches
    from swarm.plots import Panel, moving_average, save_line_plots
    from swarm.remote import RemotePipeline

    model = model_config(args)
    train_set, _, report = build_datasets(
        DataConfig(
            path=args.data, seq_len_tokens=model.seq_len_tokens, train_samples=args.train_samples, eval_samples=0
        )
    )
    if not quiet:
        print(report.describe(), file=sys.stderr)
    steps_per_epoch = len(train_set) // args.batch_size
    if steps_per_epoch < 1:
        raise SystemExit(f"--batch-size {args.batch_size} exceeds the {len(train_set)} training samples")
    total = args.steps or steps_per_epoch * args.epochs
    out = Path(args.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    pipe = RemotePipeline(route, peers, args.schedule, args.micro_batches, deadline_s=args.deadline_s)
    rows, started = [], time.perf_counter()
    try:
        with tqdm(total=total, desc="training", unit="step", disable=quiet, file=sys.stderr) as bar:
            step, epoch = 0, 0
            while step < total:
                for batch in epoch_batches(train_set, args.batch_size, epoch, args.seed):
                    if step >= total:
                        break
                    r = pipe.train_step(step, batch)
                    rows.append(
                        {
                            "setting": args.setting,
                            "step": step + 1,
                            "epoch": epoch,
                            "train_loss": r.loss,
                            "lr": r.lr,
                            "grad_norm": r.grad_norm,
                            "forward_bytes": r.forward_bytes,
                            "backward_bytes": r.backward_bytes,
                            "fp32_wire_bytes": r.fp32_wire_bytes,
                            "step_s": r.seconds,
                            **{f"link{k}_bytes": b for k, b in enumerate(r.link_bytes)},
                        }
                    )
                    step += 1
                    wire = sum(x["forward_bytes"] + x["backward_bytes"] for x in rows)
                    bar.set_postfix_str(f"loss {r.loss:.3f} | {r.seconds:.2f} s/step | wire {wire / 1e6:.1f} MB")
                    bar.update(1)
                epoch += 1
    finally:
        pipe.close()
        _write_csv(out / "steps.csv", rows)
    losses = [r["train_loss"] for r in rows]
    panel = Panel("training loss", "step", "loss")
    panel.series[args.setting] = ([r["step"] for r in rows], moving_average(losses, 5))
    plot = save_line_plots([panel], out / "loss.png", f"swarm train: {len(route)} stages") if rows else None
    times = [r["step_s"] for r in rows]
    summary = TrainSummary(
        final_loss=sum(losses[-5:]) / len(losses[-5:]),
        first_loss=losses[0],
        steps=len(rows),
        wire_bytes=sum(r["forward_bytes"] + r["backward_bytes"] for r in rows),
        fp32_wire_bytes=sum(r["fp32_wire_bytes"] for r in rows),
        mean_step_s=sum(times[1:] or times) / len(times[1:] or times),
        seconds=time.perf_counter() - started,
        stages=len(route),
        route=route,
        csv=str(out / "steps.csv"),
        plot=str(plot) if plot else None,
    )
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    return summary


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        links = sorted({k for r in rows for k in r if k.startswith("link")})
        writer = csv.DictWriter(f, CSV_FIELDS + links)
        writer.writeheader()
        writer.writerows(rows)


def run(args: argparse.Namespace) -> int:
    from swarm.calls import StageCallError
    from swarm.peers.dht import SwarmDHT

    logging.getLogger("hivemind").setLevel(logging.WARNING)
    with SwarmDHT(dht_config(args, client_mode=True)) as dht:
        try:
            route, peers = discover_route(
                dht, args.num_stages, args.wait_timeout_s, lambda s: print(s, file=sys.stderr)
            )
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        summary = train(args, route, peers)
    except StageCallError as e:
        print(f"error: training failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(summary)) if args.json else format_summary(summary))
    return 0


def format_summary(s: TrainSummary) -> str:
    ratio = s.fp32_wire_bytes / max(1, s.wire_bytes)
    return "\n".join(
        [
            f"steps:        {s.steps} in {s.seconds:.1f} s ({s.mean_step_s:.2f} s/step)",
            f"loss:         {s.first_loss:.3f} -> {s.final_loss:.3f} (mean of the last 5 steps)",
            f"wire bytes:   {s.wire_bytes / 1e6:.2f} MB; fp32: {s.fp32_wire_bytes / 1e6:.2f} MB ({ratio:.1f}x)",
            f"stages:       {s.stages} at {', '.join(s.route)}",
            f"outputs:      {s.csv}" + (f", {s.plot}" if s.plot else ""),
        ]
    )
