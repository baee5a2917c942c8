"""What the runtime's step-path changes save, measured A/B in one run: a local 2-peer swarm (the throttled
experiment's app-shaped cell, fp32) whose trainer runs its steps alternately with the change off (odd steps) and
on (even steps), so that a loaded machine's drift falls on both alike, and PyTorch's own pipeline
(`torch_baseline`, loopback, unshaped) beside it.

    python scripts/measure_step_overhead.py --rates none,100 --steps 40 [--change grads-in-reduce] [--json]
    python scripts/measure_step_overhead.py --netns --rates 100,1000 --steps 120 --change labels-with-pipeline

Prints, per rate and mode, the mean and median step time after the first epoch and the ratio of the modes'
medians. A mode sets `PipelineDriver` switches that exist only to measure what a change saves. The app-shaped
cells' trainer runs in this process, so the switch reaches it; with `--netns` (root: the throttled experiment's
namespace cells, tc-shaped) the trainer is a process of the testbed, and a `sitecustomize` on its PYTHONPATH
alternates the switch there once `swarm.runtime.driver` is imported (nothing else is imported early: the peers
start as they always do).
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

CHANGES = {
    "backward-early": "backward_early",  # the Backward start sent with the Forward (1F1B)
    "grads-in-reduce": "grads_in_reduce",  # the gradient reports in the Reduce replies: no Grads round trip
    "labels-with-pipeline": "labels_with_pipeline",  # the labels beside the first Forwards: no PutLabels trip first
    "reduce-with-pipeline": "reduce_with_pipeline",  # the Reduces sent with the pipeline, held until the backwards ran
    "reuse-call-threads": "reuse_call_threads",  # the trainer's calls on reused threads, not a thread per call
    "ping-recent-peers-late": "ping_recent_peers_late",  # no heartbeat Ping of a peer heard within the interval
    "first-call-first": "first_call_first",  # each route's first Forward before the step's other calls
}
"""--change: the `PipelineDriver` switch a run measures, off in mode "before", on in "after"."""
MODES = {"before": {}, "after": {}}


def _alternate() -> None:
    """Makes every driver run odd steps in mode "before" and even ones in "after" (steps count from 0)."""
    train_step = PipelineDriver.train_step

    def alternating(self, step, batch):
        for name, value in MODES["after" if step % 2 == 0 else "before"].items():
            setattr(self, name, value)
        return train_step(self, step, batch)

    PipelineDriver.train_step = alternating


SITECUSTOMIZE = """
import importlib.abc, importlib.util, os, sys

class _Alternate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "swarm.runtime.driver":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            train_step, switch = module.PipelineDriver.train_step, os.environ["SWARM_MEASURE_SWITCH"]

            def alternating(self, step, batch):
                setattr(self, switch, step % 2 == 0)  # even steps: "after"
                return train_step(self, step, batch)

            module.PipelineDriver.train_step = alternating

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("SWARM_MEASURE_SWITCH"):
    sys.meta_path.insert(0, _Alternate())
"""
"""The trainer's alternation in a process of the namespace testbed (`--netns`): on PYTHONPATH as sitecustomize."""


def _alternate_in_processes(out: Path, switch: str) -> None:
    """Every process started from here on alternates `switch` in its `PipelineDriver` (`SITECUSTOMIZE`)."""
    import os

    hook = out / "sitecustomize"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    os.environ["SWARM_MEASURE_SWITCH"] = switch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="none,100", help="link speeds, Mbit/s ('none': unshaped)")
    parser.add_argument("--setting", default="fp32/fp32", help="FW/BW codecs of every cell")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per cell (half of them in each mode)")
    parser.add_argument("--no-torch", action="store_true", help="leave out PyTorch's loopback pipeline")
    parser.add_argument("--out", type=Path, default=None, help="output folder (none: runs/overhead-<time>)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--change", choices=sorted(CHANGES), default="backward-early", help="what to measure")
    parser.add_argument("--netns", action="store_true", help="the namespace cells (root; torch's then in them too)")
    args = parser.parse_args(argv)
    MODES["before"], MODES["after"] = {CHANGES[args.change]: False}, {CHANGES[args.change]: True}
    out = (args.out or Path(f"runs/overhead-{time.strftime('%Y%m%d-%H%M%S')}")).absolute()
    cfg = ThrottledConfig(rates=_rates(args.rates), settings=(args.setting,), steps=args.steps, netns=args.netns)
    per_epoch = cfg.train_samples // cfg.batch_size
    if args.netns:
        _alternate_in_processes(out, CHANGES[args.change])
    else:
        _alternate()
    rows = []
    for rate in cfg.rates:
        steps = _run_cell(Cell(rate, args.setting), cfg, out)[per_epoch:]
        times = {mode: [float(s["step_s"]) for s in steps if (int(s["step"]) - 1) % 2 == (mode == "before")]
                 for mode in MODES}  # fmt: skip
        for mode, values in times.items():
            mean, median = statistics.mean(values), statistics.median(values)
            rows.append({"rate_mbit": rate, "mode": mode, "change": args.change, "setting": args.setting,
                         "steps": len(values), "mean_step_s": mean, "median_step_s": median})  # fmt: skip
        ratio = statistics.median(times["after"]) / statistics.median(times["before"])
        rows.append({"rate_mbit": rate, "mode": "after/before", "setting": args.setting, "median_ratio": ratio})
        print(f"{rate}: after/before {ratio:.3f}", file=sys.stderr, flush=True)
    if not args.no_torch:
        from swarm.experiments.torch_baseline import run_torch_rows

        torch_cfg = cfg if args.netns else replace(cfg, rates=(None,))
        where = "namespaces" if args.netns else "loopback"
        for row in run_torch_rows(torch_cfg, list(torch_cfg.rates), out, lambda line: print(line, file=sys.stderr)):
            rows.append({"rate_mbit": row.get("rate_mbit"), "mode": f"torch-fp32 ({where})", "setting": "torch-fp32",
                         "mean_step_s": row["mean_step_s"], "steps": row["steps"]})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
