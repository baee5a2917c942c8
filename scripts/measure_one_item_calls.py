"""What sending one-item streams as unary calls saves a step, A/B in one process.

    python scripts/measure_one_item_calls.py [--steps 100] [--setting FW/BW]

The default model's 2 stages as gRPC servers on the loopback (the integration tests' `loopback_stages`, calls
signed and checked), driven by a `PipelineDriver` with 4 micro-batches of 2 under 1F1B. Even steps send every
Forward and Backward whose stream holds one item as its unary twin (`swarm.net.stream.ONE_ITEM`: the trainer's token
batches and Backward starts, and every activation and gradient under one chunk), odd steps as client streams, so a
loaded machine's drift falls on both alike. Prints each mode's median and mean step time after 8 steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.integration's fixtures

import swarm.net.connect as connect  # noqa: E402
from swarm.compression import CodecConfig  # noqa: E402
from swarm.experiments.convergence import ExperimentConfig  # noqa: E402
from swarm.model.data import build_datasets, epoch_batches  # noqa: E402
from swarm.options import DEFAULT_MODEL  # noqa: E402
from tests.integration.swarm_fixtures import loopback_stages, remote  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps, half of them in each mode")
    parser.add_argument("--setting", default="fp32/fp32", help="FW/BW codec labels")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    twins = dict(connect.ONE_ITEM)
    fw, bw = (CodecConfig.parse(label) for label in args.setting.split("/"))
    train, _, _ = build_datasets(ExperimentConfig().data)
    batches = list(epoch_batches(train, 8, 0, 0))[:4]  # 4 batches again and again: AQ-SGD's deltas in steady state
    times: dict[bool, list[float]] = {True: [], False: []}
    with loopback_stages(2, fw, bw, model=DEFAULT_MODEL) as (_, _, addresses):
        driver = remote(addresses, "1f1b", n_micro=4)
        try:
            for step in range(args.steps):
                twin = step % 2 == 0
                connect.ONE_ITEM = twins if twin else {}
                start = time.perf_counter()
                driver.train_step(step, batches[step % len(batches)])
                if step >= 8:
                    times[twin].append(time.perf_counter() - start)
        finally:
            connect.ONE_ITEM = twins
            driver.close()
    for twin in (False, True):
        ms = [1000 * t for t in times[twin]]
        print(f"{args.setting} one-item calls as {'unary twins' if twin else 'streams    '}: median "
              f"{statistics.median(ms):.1f} ms, mean {statistics.mean(ms):.1f} ms ({len(ms)} steps)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
