"""What authentication costs: `swarm demo` with signed, authorized calls (the default) against `--no-auth`.

The two settings alternate, pair after pair, in one run of this command, so the machine's drift over the run
touches both alike. Each demo is a whole swarm of processes (bootstrap, peers, trainer) on 127.0.0.1; the
figure is its trainer's mean step time (`mean_step_s`, the first step left out). Reported: every run's
figure, the mean and median of each setting, and the ratio auth/no-auth of the means (target: < 1.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from swarm.report import print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=3, help="demo runs per setting, alternating (default 3)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of each demo (default 2: 32 steps)")
    parser.add_argument("--quick", action="store_true", help="one pair of one-epoch demos")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")


def _demo(auth: bool, epochs: int, out: Path) -> dict:
    argv = [sys.executable, "-m", "swarm.cli", "demo", "--json", "--epochs", str(epochs), "--out", str(out)]
    done = subprocess.run(argv + ([] if auth else ["--no-auth"]), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"swarm demo {'(auth)' if auth else '--no-auth'} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def run(args: argparse.Namespace) -> int:
    pairs, epochs = (1, 1) if args.quick else (args.pairs, args.epochs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-bench-auth-") as tmp:
        runs = [(i, auth) for i in range(pairs) for auth in (True, False)]
        for i, auth in tqdm(runs, desc="demo runs", file=sys.stderr):
            result = _demo(auth, epochs, Path(tmp) / f"{i}-{'auth' if auth else 'open'}")
            rows.append(
                {"run": i, "auth": auth, "steps": result["steps"], "mean_step_s": result["mean_step_s"],
                 "final_loss": result["final_loss"]}
            )  # fmt: skip
    on = [r["mean_step_s"] for r in rows if r["auth"]]
    off = [r["mean_step_s"] for r in rows if not r["auth"]]
    summary = {
        "run": "summary",
        "auth_mean_step_s": statistics.mean(on),
        "no_auth_mean_step_s": statistics.mean(off),
        "auth_median_step_s": statistics.median(on),
        "no_auth_median_step_s": statistics.median(off),
        "ratio": statistics.mean(on) / statistics.mean(off),
    }
    if args.json:
        for row in [*rows, summary]:
            print(json.dumps(row))
    else:
        print_table(rows, ["run", "auth", "steps", "mean_step_s", "final_loss"], "swarm demo, auth on and off")
        print(
            f"mean step: {summary['auth_mean_step_s']:.4f} s with auth, {summary['no_auth_mean_step_s']:.4f} s "
            f"without: ratio {summary['ratio']:.3f} (target < 1.05)"
        )
    return 0
