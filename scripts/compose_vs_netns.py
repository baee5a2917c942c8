"""The compose testbed against the namespace testbed on one swarm: the same services, seed, data, steps and
tc rate, the peers on a fixed even split (`--assign even`) so that when a re-plan lands cannot change the
route. Runs the namespace testbed (prefix cmp-), then `swarm testbed compose-run`, and prints one JSON object:
each side's first and final loss, steps and shaped rate (namespaces: a veth pair shaped by tbf, as `swarm
testbed measure`; containers: compose-run's measurement), and the largest per-step loss difference.

    python scripts/compose_vs_netns.py --rate-mbit 100 --epochs 4 --run-dir runs/compose-vs-netns
Needs root, `ip netns` and a docker engine (or dockerd to start); minutes.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from swarm.testbed.compose_run import ComposeRunOptions, compose_run, find_repo
from swarm.testbed.lifecycle import bring_up, take_down, train_in
from swarm.testbed.netns import measure_rate, shaped_pair
from swarm.testbed.services import Egress, TestbedConfig


def _losses(steps_csv: Path) -> list[float]:
    with open(steps_csv) as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="tc egress of every service, Mbit/s")
    parser.add_argument("--epochs", type=int, default=4, help="passes over the 64 training samples (8 steps each)")
    parser.add_argument("--run-dir", default="runs/compose-vs-netns", help="both runs' outputs")
    args = parser.parse_args()
    run_dir = Path(args.run_dir).resolve()
    cfg = TestbedConfig(
        egress=Egress(args.rate_mbit), epochs=args.epochs, prefix="cmp-", peer_flags=("--assign", "even")
    )
    say = lambda line: print(f"[compare] {line}", flush=True)  # noqa: E731

    try:
        testbed = bring_up(cfg, run_dir / "netns", say)
        code = train_in(testbed, 3600.0, say)
    finally:
        take_down(run_dir / "netns", cfg.prefix, say=say)
    with shaped_pair(args.rate_mbit, "cmq-", qdisc="tbf") as (a, b):
        ns_rate = measure_rate(a, b, int(max(2e6, args.rate_mbit * 1e6 / 8 * 2))) * 8 / 1e6
    ns_losses = _losses(run_dir / "netns" / "train" / "steps.csv")

    result = compose_run(cfg, ComposeRunOptions(run_dir=str(run_dir / "compose")), find_repo(), say)
    compose_losses = _losses(Path(result.steps_csv)) if result.steps_csv else []
    diffs = [abs(x - y) for x, y in zip(ns_losses, compose_losses, strict=False)]
    print(json.dumps({
        "rate_mbit": args.rate_mbit,
        "netns": {"exit_code": code, "steps": len(ns_losses), "first_loss": ns_losses[0], "final_loss": ns_losses[-1],
                  "measured_rate_mbit": ns_rate},
        "compose": {"exit_code": result.exit_code, "steps": len(compose_losses),
                    "first_loss": compose_losses[0] if compose_losses else None,
                    "final_loss": compose_losses[-1] if compose_losses else None,
                    "measured_rate_mbit": result.measured_rate_mbit, "build_s": result.build_s,
                    "image_bytes": result.image_bytes},
        "max_step_loss_diff": max(diffs) if diffs else None,
    }))  # fmt: skip
    return 0 if code == 0 and result.exit_code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
