"""Predicted against measured step time of a recorded throttled run: the cost model checked on real swarms.

`python -m swarm.scheduler.predict RUN_DIR` reads each cell of a `swarm experiment throttled --out RUN_DIR`
(its folder name gives the rate and the codecs, its peers' logs the compute speed they measured, its
steps.csv the measured step times) and prints, per cell, what the live planner's model (`model_spec`,
`FullCost`) predicts for that swarm beside the measured mean step after the first epoch.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.peers.shaper import LinkShape
from swarm.scheduler.cost import FullCost, Layout, even_layers
from swarm.scheduler.plans import Peer, PlanInput
from swarm.scheduler.sizes import model_spec

__all__ = ["predict_route", "main"]

_SPEED = re.compile(r"compute ([0-9.]+) layers/s")
_LOCAL_RTT_S = 1e-3


def predict_route(
    layers_per_s: list[float],
    rate_mbit: float | None,
    forward: str,
    backward: str,
    model: ModelConfig | None = None,
    micro_batch_size: int = 2,
    micro_batches: int = 4,
    delay_s: float = 0.0,
) -> float:
    """Predicted step time of one route (peer k holds stage k, layers split evenly), as the planner sees it."""
    model = model or ModelConfig()
    spec = model_spec(model, CodecConfig.parse(forward), CodecConfig.parse(backward), micro_batch_size, micro_batches)
    n = len(layers_per_s)
    rate = np.inf if rate_mbit is None else rate_mbit * 1e6 / 8
    eye = np.eye(n, dtype=bool)
    bandwidth = np.where(eye, np.inf, rate)
    delay = np.where(eye, 0.0, delay_s + _LOCAL_RTT_S / 2)
    # the application's shaper is a token bucket (`LinkShape.burst`): what the link probe measures
    burst = np.where(eye, 0.0, LinkShape.from_mbit(rate_mbit).burst if rate_mbit is not None else 0.0)
    peers = tuple(Peer(f"p{i}", s * spec.flops_per_layer, 1 << 40) for i, s in enumerate(layers_per_s))
    layout = Layout(np.arange(n)[:, None], even_layers(spec.layers, n))
    return FullCost(PlanInput(peers, delay, bandwidth, burst), spec).evaluate(layout).total_s


def _cell(folder: Path, steps_per_epoch: int) -> dict | None:
    steps_csv = folder / "steps.csv"
    if not steps_csv.exists():
        return None
    with open(steps_csv) as f:
        steps = list(csv.DictReader(f))
    forward, backward = steps[0]["setting"].split("/")
    rate_part = folder.name.split("-")[0]
    rate = None if rate_part == "unshaped" else float(rate_part.removesuffix("mbit"))
    speeds = [
        float(m.group(1))
        for log in sorted((folder / "logs").glob("peer*.log"))
        for m in _SPEED.finditer(log.read_text())
    ]
    times = [float(s["step_s"]) for s in steps]
    measured = statistics.mean(times[steps_per_epoch:] or times)
    predicted = predict_route(speeds, rate, forward, backward)
    return {
        "cell": folder.name,
        "layers_per_s": speeds,
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "error": predicted / measured - 1,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(
            "usage: python -m swarm.scheduler.predict RUN_DIR [STEPS_PER_EPOCH]\n"
            "(live cells with the plan's own prediction: swarm experiment throttled, columns predicted_step_s)",
            file=sys.stderr,
        )
        return 2
    run, per_epoch = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 2
    rows = [r for d in sorted(run.iterdir()) if d.is_dir() and (r := _cell(d, per_epoch))]
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
