"""How long a run trains, so that the learning-rate schedule ends where training does.

The stages own the schedule (warm-up, then a cosine over `total_steps`, `swarm.runtime.worker.lr_at`); the trainer
owns the run's length (`--steps`, or `--epochs` passes over `--train-samples`). They must agree, or the cosine ends
before training does (the rest runs at the floor) or never reaches its end. In an owned run the manifest's
`total_steps` is the run's length: a trainer told nothing trains that many steps, one told more is refused, one
told fewer is warned (it may resume later with `--resume`). A run whose peers a command starts itself (`swarm
demo`) gives them `run_steps` of its trainer as their `--total-steps`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.train.trainer import TrainConfig

__all__ = ["run_steps", "with_run_length"]

log = logging.getLogger("swarm.train.run_length")


def run_steps(cfg: TrainConfig) -> int:
    """The optimizer steps `cfg` trains: `steps`, else `epochs` x the full batches of `train_samples` (the trainer
    counts the windows the corpus holds; a corpus shorter than `train_samples` makes fewer)."""
    return cfg.steps or cfg.epochs * max(1, cfg.train_samples // cfg.batch_size)


def with_run_length(cfg: TrainConfig, given: Mapping[str, Any], total_steps: int, run_id: str) -> TrainConfig:
    """`cfg` training the owned run's `total_steps` (its manifest's): `steps` set to them unless `--steps` or
    `--epochs` was given (`given`: the flags given, `Flags.given`).

    Raises:
        ValueError: the flags given train past the run's schedule; the message names both and the way out.
    """
    if "steps" not in given and "epochs" not in given:
        return replace(cfg, steps=total_steps)
    told = "--steps" if "steps" in given else "--epochs"
    n = run_steps(cfg)
    if n > total_steps:
        raise ValueError(
            f"{told} {given['steps' if told == '--steps' else 'epochs']} trains {n} steps, past run {run_id}'s "
            f"schedule, whose cosine ends at step {total_steps} (its manifest's total_steps): drop {told} to train "
            f"the run's {total_steps} steps, or make the run with `swarm run init --total-steps {n}`"
        )
    if n < total_steps:
        log.warning(
            "training %d of run %s's %d steps (%s): the learning-rate schedule will not have ended; go on later "
            "with --resume and the same --out",
            n, run_id, total_steps, told,
        )  # fmt: skip
    return cfg
