"""The tied-embedding sum's bit floor against held-out loss and bytes: the convergence experiment (default
sizes) with `GradientAverager.tied_min_bits` set to each given value.

    python scripts/measure_tied_bits.py --bits 2,3,4,8 --settings acsgd2+ch/gradq2+ef+rot+nr+cs

prints one JSON row per (bits, setting): held-out vs fp32, total byte ratios, bytes per step by part.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from swarm.experiments.convergence import ExperimentConfig, run_experiment
from swarm.runtime.average import GradientAverager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", default="2,4,8", help="floors to try, comma-separated (default %(default)s)")
    parser.add_argument("--settings", default="acsgd2+ch/gradq2+ef+rot+nr+cs", help="convergence settings")
    parser.add_argument("--out", type=Path, default=Path("runs/tied-bits"), help="output folder")
    args = parser.parse_args()
    settings = tuple(s for s in args.settings.split(",") if s)
    for bits in (int(b) for b in args.bits.split(",")):
        GradientAverager.tied_min_bits = bits
        rows = run_experiment(ExperimentConfig(settings=settings), args.out / f"bits{bits}", show_progress=False)
        for r in rows[1:]:  # rows[0] is the fp32 baseline
            n = r["steps"]
            per_step = {k: r[k] // n for k in ("forward_bytes", "backward_bytes", "sync_bytes", "control_bytes")}
            print(json.dumps({"tied_bits": bits, "setting": r["setting"], "eval_vs_fp32_pct": r["eval_vs_fp32_pct"],
                              "total_ratio_vs_fp32": r["total_ratio_vs_fp32"],
                              "total_steady_ratio_vs_fp32": r["total_steady_ratio_vs_fp32"], **per_step}))  # fmt: skip


if __name__ == "__main__":
    main()
