"""The trainer's held-out evaluation: which windows, when, and where each result goes.

The held-out windows are the ones `swarm demo` and the convergence experiment hold out: `DataConfig.eval_samples`
windows of text held out of training (`swarm.model.data.build_datasets`: the default corpus's held-out files,
whatever `--train-samples` is, or a `--data` text's windows after the training ones). Every `--eval-every` steps
and after the last, the trainer runs them forward through one live route (`PipelineDriver.evaluate`,
`swarm.runtime.heldout`) and records the mean loss in the step's steps.csv row (`held_out_loss`), the
`swarm_held_out_loss` gauge, the loss plot and the summary. An evaluation that fails (a peer died, the plan moved
on) is logged and skipped: training goes on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.compression import WireError
from swarm.metrics import Metrics
from swarm.model.data import SampleSet
from swarm.net.stream import PLAN_MISMATCH, StageCallError

__all__ = ["HeldOut", "HeldOutPoint", "held_out_rows"]

log = logging.getLogger("swarm.train.heldout")


def held_out_rows(batch_size: int, micro_batches: int) -> int:
    """Windows per evaluation call: a training micro-batch's rows, which every stage's budget admits."""
    return max(1, batch_size // micro_batches)


@dataclass(frozen=True)
class HeldOutPoint:
    step: int
    """steps applied when it was measured (the steps.csv row it is in)"""
    loss: float
    """mean loss per token over the held-out windows"""


@dataclass
class HeldOut:
    """When the trainer evaluates and what it measured.

    Args:
        data: the held-out windows (empty: evaluation off).
        every: steps between evaluations (0: only after the last step).
        rows: windows per call.
        hidden: the model's width (the activations' last dimension).
        metrics: the trainer's registry (`held_out_loss` gauge).
    """

    data: SampleSet
    every: int
    rows: int
    hidden: int
    metrics: Metrics
    points: list[HeldOutPoint] = field(default_factory=list)
    """every successful evaluation, in order"""
    bytes: int = 0
    """serialized bytes of every evaluation's calls (not in the steps' byte counts)"""
    seconds: float = 0.0
    """wall-clock seconds spent evaluating"""

    @property
    def on(self) -> bool:
        return len(self.data) > 0

    def due(self, done: int, total: int) -> bool:
        """Whether to evaluate after `done` steps of `total`."""
        return self.on and done > 0 and ((self.every > 0 and done % self.every == 0) or done >= total)

    def run(self, driver, done: int, replan: Callable[[], object] | None = None) -> float | None:
        """Evaluates the weights after `done` steps through `driver`; the loss, or None when it failed (logged).
        `replan`: follows the newer plan the stages moved to and returns its driver; an evaluation refused as of
        an older plan (the planner republished between the step and the evaluation) runs once more on it."""
        try:
            try:
                result = driver.evaluate(self.data, self.rows, done, self.hidden)
            except StageCallError as e:
                if replan is None or PLAN_MISMATCH not in str(e):
                    raise
                log.info("held-out evaluation after step %d: the stages moved to a newer plan; evaluating there", done)
                result = replan().evaluate(self.data, self.rows, done, self.hidden)
        except (StageCallError, WireError) as e:
            log.warning("held-out evaluation after step %d skipped: %s", done, e)
            return None
        self.bytes += result.bytes
        self.seconds += result.seconds
        self.points.append(HeldOutPoint(done, result.loss))
        self.metrics.held_out_loss.set(result.loss)
        return result.loss

    def finish(self, driver, done: int, replan: Callable[[], object] | None = None) -> None:
        """After the loop: evaluates the final weights unless the last evaluation already was of them (a run
        stopped between two evaluations)."""
        if self.on and done > 0 and (not self.points or self.points[-1].step != done):
            self.run(driver, done, replan)

    @property
    def last(self) -> HeldOutPoint | None:
        return self.points[-1] if self.points else None

    def summary(self) -> dict[str, object]:
        """The summary's fields: the last evaluation's loss and step, the windows, the bytes."""
        last = self.last
        return {
            "held_out_loss": last.loss if last is not None and math.isfinite(last.loss) else None,
            "held_out_step": last.step if last is not None else None,
            "held_out_samples": len(self.data),
            "held_out_first_id": int(self.data.ids[0]) if self.on else None,
            "held_out_bytes": self.bytes,
        }
