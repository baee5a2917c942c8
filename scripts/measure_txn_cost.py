"""What journalling a step's codec state costs (transactional AQ-SGD buffers, `compression.buffers`).

Two LocalPipelines of the convergence experiment's shape and setting train on the same batches (the epoch's
first `--distinct` batches, cycled: the first pass sends first sights, every later step deltas, AQ-SGD's steady
state, where every buffer row a step writes is journalled), their steps interleaved (AB BA AB...), so machine
noise hits both alike: one journals every step's codec state (the runtime as it is), the other opens no journal
(as before transactions: `LinkEnds.begin_step` only notes the step). Prints the median step time of each in both
phases, their ratios, and checks that the losses agree bit for bit (a journal changes no math when no step
fails). Usage:
    python scripts/measure_txn_cost.py [--setting acsgd2+ch/gradq2+ef+rot+nr+cs] [--steps 60] [--distinct 10]
    [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import types

import torch

from swarm.experiments.convergence import DEFAULT_TARGET_SETTING, ExperimentConfig, _codec_defaults, _parse_setting
from swarm.model.data import build_datasets, epoch_batches
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import StageConfig


def _no_journal(pipe: LocalPipeline) -> None:
    for host in pipe.hosts:
        host.links.begin_step = types.MethodType(lambda self, step: setattr(self, "step", step), host.links)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setting", default=DEFAULT_TARGET_SETTING)
    ap.add_argument("--steps", type=int, default=60, help="steps of each pipeline (the first is left out)")
    ap.add_argument("--distinct", type=int, default=10, help="distinct batches, cycled")
    ap.add_argument("--quick", action="store_true", help="16 steps over 4 batches")
    args = ap.parse_args()
    steps, distinct = (16, 4) if args.quick else (args.steps, args.distinct)
    torch.set_num_threads(1)
    cfg = ExperimentConfig()
    setting = _parse_setting(args.setting, *_codec_defaults(cfg), cfg)
    train, _, _ = build_datasets(cfg.data)
    pipes = {
        name: LocalPipeline(
            cfg.model, cfg.n_stages, setting.forward, setting.backward, cfg.schedule, StageConfig(cfg.optim)
        )
        for name in ("journal", "none")
    }
    _no_journal(pipes["none"])
    times: dict[tuple[str, str], list[float]] = {(n, p): [] for n in pipes for p in ("first", "delta")}
    losses: dict[str, list[float]] = {name: [] for name in pipes}
    journalled = 0
    try:
        batches = list(itertools.islice(epoch_batches(train, cfg.batch_size, 0, cfg.data_seed), distinct))
        for i in range(steps):
            batch, phase = batches[i % distinct], "first" if i < distinct else "delta"
            order = list(pipes) if i % 2 == 0 else list(reversed(pipes))
            for name in order:
                pipe = pipes[name]
                start = time.perf_counter()
                loss = pipe.train_step(batch, cfg.n_micro).loss
                if i:
                    times[(name, phase)].append(time.perf_counter() - start)
                losses[name].append(loss)
            host = pipes["journal"].hosts[0]
            journalled = max(journalled, sum(len(end.buffers) for end in host.links.send_ends("fw")))
    finally:
        for pipe in pipes.values():
            pipe.close()
    print(f"setting {args.setting}, {steps} steps each over {distinct} batches, interleaved (first step left out)")
    for phase in ("first", "delta"):
        med = {name: statistics.median(times[(name, phase)]) for name in pipes}
        shown = ", ".join(f"{name} {med[name] * 1000:.1f} ms" for name in pipes)
        n = len(times[("journal", phase)])
        print(f"  {phase:5s} sights, {n} steps: median {shown}; journal / none {med['journal'] / med['none']:.3f}")
    print(f"  samples buffered on stage 0's sending end: {journalled}")
    same = losses["journal"] == losses["none"]
    print(f"  losses bit-identical: {same}")
    if not same:
        raise SystemExit("journalling changed the losses")


if __name__ == "__main__":
    main()
