"""What the runtime's step-path changes save, measured A/B in one run: local 2-peer swarms (the throttled
experiment's app-shaped cells, fp32) with each change off and on, interleaved round by round so that a loaded
machine's drift falls on both alike, and PyTorch's own pipeline (`torch_baseline`, loopback, unshaped) beside them.

    python scripts/measure_step_overhead.py --rates none,100 --steps 24 --rounds 2 [--json]

Prints, per rate and mode, the mean and median step time after the first epoch (each round's cell its own run)
and the ratio of the modes' medians. Modes set `PipelineDriver` switches that exist only to measure what the
change saves; the trainer runs in this process, so the switch reaches it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from swarm.experiments.throttled import Cell, ThrottledConfig, _rates, _run_cell
from swarm.runtime.driver import PipelineDriver

MODES = {
    "before": {"backward_early": False},
    "after": {"backward_early": True},
}


def _steady(steps: list[dict], per_epoch: int) -> list[float]:
    times = [float(s["step_s"]) for s in steps]
    return times[per_epoch:] or times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="none,100", help="link speeds, Mbit/s ('none': unshaped)")
    parser.add_argument("--setting", default="fp32/fp32", help="FW/BW codecs of every cell")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per cell")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every (rate, mode), interleaved")
    parser.add_argument("--no-torch", action="store_true", help="leave out PyTorch's loopback pipeline")
    parser.add_argument("--out", type=Path, default=None, help="output folder (none: runs/overhead-<time>)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    out = args.out or Path(f"runs/overhead-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = ThrottledConfig(rates=_rates(args.rates), settings=(args.setting,), steps=args.steps)
    per_epoch = cfg.train_samples // cfg.batch_size
    times: dict[tuple, list[float]] = {}
    for rnd in range(args.rounds):
        order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))
        for rate in cfg.rates:
            for mode in order:
                for name, value in MODES[mode].items():
                    setattr(PipelineDriver, name, value)
                cell = Cell(rate, args.setting)
                steps = _run_cell(cell, cfg, out / f"round{rnd}-{mode}")
                times.setdefault((rate, mode), []).extend(_steady(steps, per_epoch))
                print(f"round {rnd} {cell.label} {mode}: median {statistics.median(_steady(steps, per_epoch)):.4f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
    for name, value in MODES["after"].items():
        setattr(PipelineDriver, name, value)
    rows = []
    for (rate, mode), values in sorted(times.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        rows.append({"rate_mbit": rate, "mode": mode, "setting": args.setting, "steps": len(values),
                     "mean_step_s": statistics.mean(values), "median_step_s": statistics.median(values)})  # fmt: skip
    for rate in cfg.rates:
        before, after = times.get((rate, "before")), times.get((rate, "after"))
        if before and after:
            rows.append({"rate_mbit": rate, "mode": "after/before", "setting": args.setting,
                         "median_ratio": statistics.median(after) / statistics.median(before)})  # fmt: skip
    if not args.no_torch:
        from swarm.experiments.torch_baseline import run_torch_rows

        torch_cfg = replace(cfg, rates=(None,))
        for row in run_torch_rows(torch_cfg, [None], out, lambda line: print(line, file=sys.stderr)):
            rows.append({"rate_mbit": None, "mode": "torch-fp32 (loopback)", "setting": "torch-fp32",
                         "mean_step_s": row["mean_step_s"], "steps": row["steps"]})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
