"""How long a run trains, so that the learning-rate schedule ends where training does.

The stages own the schedule (warm-up, then a cosine over `total_steps`, `swarm.runtime.worker.lr_at`); the trainer
owns the run's length (`--steps`, or `--epochs` passes over `--train-samples`). They must agree, or the cosine ends
before training does (the rest runs at the floor) or never reaches its end. In an owned run the manifest's
`total_steps` is the run's length: a trainer told nothing trains that many steps, one told more is refused, one
told fewer is warned (it may resume later with `--resume`). A run whose peers a command starts itself (`swarm
demo`) gives them `run_steps` of its trainer as their `--total-steps`. In a swarm started by hand, without a
manifest, `ScheduleWatch` reads the stages' schedule back from the learning rates their Step replies report and
says once, early, when it does not end where this trainer stops.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.train.trainer import TrainConfig

__all__ = ["ScheduleWatch", "run_steps", "with_run_length"]

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


class ScheduleWatch:
    """Whether the stages' learning-rate schedule ends where this run does, judged from the rates they report.

    The stages' schedule is `lr_at` with a floor of `lr_min_ratio` x the peak (not a flag: the default's). The
    peak is the largest rate seen and the warm-up ends where it was last seen; once the rate decays, a step's rate
    is compared with what a cosine ending at `total_steps` gives there, and a difference of more than `tolerance`
    of the peak is reported once, with the end that rate implies.

    Args:
        total_steps: where this run's training ends (the trainer's `run_steps`, as a step count).
        warn: told the message once (default: this module's logger, as a warning).
        lr_min_ratio: the stages' floor, as a fraction of the peak.
        tolerance: the largest difference, as a fraction of the peak, that is not a mismatch.
    """

    def __init__(self, total_steps: int, warn=None, lr_min_ratio: float = 0.1, tolerance: float = 0.02):
        self.total_steps, self.floor, self.tolerance = total_steps, lr_min_ratio, tolerance
        self.warn = warn or (lambda message: log.warning("%s", message))
        self.peak, self.warmup = 0.0, 0
        self.warned = False

    def observe(self, step: int, lr: float) -> None:
        """Step `step` (0-based, as the stages count) ran at `lr` (0 or not finite: a skipped step, ignored)."""
        if self.warned or not (math.isfinite(lr) and lr > 0):
            return
        if lr >= self.peak * (1 - 1e-9):
            self.peak, self.warmup = max(lr, self.peak), step
            return
        if step >= self.total_steps:
            return
        x = (lr / self.peak - self.floor) / (1 - self.floor) if self.floor < 1 else 1.0
        progress = math.acos(min(1.0, max(-1.0, 2 * x - 1))) / math.pi
        span = max(self.total_steps - self.warmup, 1)
        wanted = self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * min((step - self.warmup) / span, 1.0)))
        if abs(lr / self.peak - wanted) <= self.tolerance:
            return
        self.warned = True
        ends = (
            "had reached its floor"
            if progress >= 1
            else f"ends near step {self.warmup + (step - self.warmup) / progress:.0f}"
        )
        self.warn(
            f"the stages' learning-rate schedule {ends}, but this run trains {self.total_steps} steps (step {step}: "
            f"lr {lr:.3g} of peak {self.peak:.3g}): start the peers with --total-steps {self.total_steps}, or make an "
            "owned run (`swarm run init --total-steps N`) whose manifest gives both sides the same length"
        )
