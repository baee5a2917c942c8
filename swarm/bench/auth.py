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
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from swarm.flags import Flags
from swarm.report import print_table


@dataclass(frozen=True)
class AuthBench:
    """`swarm bench auth`: the demo's mean step time with authentication on and off, alternating."""

    pairs: int = 3
    """demo runs per setting, alternating"""
    epochs: int = 2
    """epochs of each demo (2: 32 steps)"""
    quick: bool = False
    """one pair of one-epoch demos"""
    json: bool = False
    """print one JSON object per row"""


_FLAGS = Flags(AuthBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def _demo(auth: bool, epochs: int, out: Path) -> dict:
    from swarm.testbed.demo import demo_flags

    flags = demo_flags()
    demo = replace(flags.base, out=str(out), peer=replace(flags.base.peer, auth=auth))
    demo = replace(demo, train=replace(demo.train, epochs=epochs))
    argv = [sys.executable, "-m", "swarm.cli", "demo", "--json", *flags.to_argv(demo, always=["--epochs"])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"swarm demo {'(auth)' if auth else '--no-auth'} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    pairs, epochs = (1, 1) if bench.quick else (bench.pairs, bench.epochs)
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
    if bench.json:
        for row in [*rows, summary]:
            print(json.dumps(row))
    else:
        print_table(rows, ["run", "auth", "steps", "mean_step_s", "final_loss"], "swarm demo, auth on and off")
        print(
            f"mean step: {summary['auth_mean_step_s']:.4f} s with auth, {summary['no_auth_mean_step_s']:.4f} s "
            f"without: ratio {summary['ratio']:.3f} (target < 1.05)"
        )
    return 0
