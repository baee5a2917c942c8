"""The trainer's held-out evaluation: which windows, when, and where each result goes.

The held-out windows are the ones `swarm demo` and the convergence experiment hold out: `DataConfig.eval_samples`
windows of text held out of training (`swarm.model.data.build_datasets`: the default corpus's held-out files,
whatever `--train-samples` is, or a `--data` text's windows after the training ones). Every `--eval-every` steps
and after the last, the trainer runs them forward through one live route (`PipelineDriver.evaluate`,
`swarm.runtime.heldout`) and records the mean loss in the step's steps.csv row (`held_out_loss`), the
`swarm_held_out_loss` gauge, the loss plot and the summary. An evaluation that fails (a peer died, the plan moved
on) is logged and skipped: training goes on.

An evaluation sends its windows' fp32 activations through every boundary: over a 1 Mbit/s link 48 windows took
about 57 s, against under a second a step, so every 20 steps it held the run three quarters of its time. With
`max_share` below 1, an evaluation that took E seconds (at least `DEFERRABLE_S`) puts the next periodic one off
until the run has trained E (1 - share) / share seconds since, at the next multiple of `every` after that; the one
after the last step always runs. Quicker evaluations are never put off, so on fast links the rows are every
`every` steps as before.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.compression import WireError
from swarm.metrics import Metrics
from swarm.model.data import SampleSet
from swarm.net.stream import PLAN_MISMATCH, StageCallError

__all__ = ["DEFERRABLE_S", "HeldOut", "HeldOutPoint", "held_out_rows"]

log = logging.getLogger("swarm.train.heldout")

DEFERRABLE_S = 5.0
"""An evaluation quicker than this never puts the next one off, whatever its share of the run."""


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
        max_share: the most of the run's time periodic evaluations may take (1: every `every` steps, whatever they
            cost); see the module's docstring.
        clock: seconds, for the spacing (tests give their own).
    """

    data: SampleSet
    every: int
    rows: int
    hidden: int
    metrics: Metrics
    max_share: float = 1.0
    clock: Callable[[], float] = time.monotonic
    points: list[HeldOutPoint] = field(default_factory=list)
    """every successful evaluation, in order"""
    bytes: int = 0
    """serialized bytes of every evaluation's calls (not in the steps' byte counts)"""
    seconds: float = 0.0
    """wall-clock seconds spent evaluating"""
    deferred: int = 0
    """periodic evaluations put off to keep to `max_share`"""
    _last: tuple[float, float] | None = field(default=None, init=False, repr=False)
    """(when the last evaluation ended, how long it took) on `clock`"""
    _announced: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_share <= 1:
            raise ValueError(f"HeldOut: max_share must be in (0, 1], not {self.max_share}")

    @property
    def on(self) -> bool:
        return len(self.data) > 0

    def due(self, done: int, total: int) -> bool:
        """Whether to evaluate after `done` steps of `total`."""
        if not self.on or done <= 0:
            return False
        if done >= total:
            return True
        if self.every <= 0 or done % self.every:
            return False
        if self.wait_s() > 0:
            ended, took = self._last
            if self._announced != ended:  # once per evaluation that puts others off
                self._announced = ended
                log.info(
                    "held-out evaluation after step %d put off: the last one took %.1f s, so the next comes after "
                    "%.0f s of training since (at most %.0f%% of the run's time: --eval-max-share)",
                    done, took, self._owed(took), 100 * self.max_share,
                )  # fmt: skip
            self.deferred += 1
            return False
        return True

    def wait_s(self) -> float:
        """Seconds of training still owed before the next periodic evaluation (0: none)."""
        if self._last is None or self.max_share >= 1:
            return 0.0
        ended, took = self._last
        if took < DEFERRABLE_S:
            return 0.0
        return max(0.0, self._owed(took) - (self.clock() - ended))

    def _owed(self, took: float) -> float:
        """Seconds of training an evaluation that took `took` seconds owes the run before the next one."""
        return took * (1 - self.max_share) / self.max_share

    def run(self, driver, done: int, replan: Callable[[], object] | None = None) -> float | None:
        """Evaluates the weights after `done` steps through `driver`; the loss, or None when it failed (logged).
        `replan`: follows the newer plan the stages moved to and returns its driver; an evaluation refused as of
        an older plan (the planner republished between the step and the evaluation) runs once more on it."""
        started = self.clock()
        try:
            return self._run(driver, done, replan)
        finally:  # a failed evaluation's time counts too (it may have waited out a deadline)
            ended = self.clock()
            self._last = (ended, ended - started)

    def _run(self, driver, done: int, replan: Callable[[], object] | None) -> float | None:
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
            "held_out_deferred": self.deferred,
        }
