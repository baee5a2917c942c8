"""When the attacks experiment stops a setting's trainer: bounds that scale with the machine's own pace.

A fixed bound per setting (`--timeout-s` 300 + 120 s) stopped every setting of the fifth pass's full run on a
loaded machine (load 60-98 on 2 cores, steps of 10-18 s instead of 0.8 s): the harness killed trainers at step
28-30, or while they evaluated after the last step, and the judge counted each as a stopped run. The bounds here
follow the steps the trainer actually makes:

- **stall**: no step for `stall_s`, or for `stall_steps` times the run's median step interval if that is longer (a
  trainer at 15 s a step is not stalled after 60 s without one; one that waits for a plan that never comes is);
- **soft deadline** (`--timeout-s` + 120 s from the trainer's start): a trainer that still makes steps, or that
  finished its last step and is evaluating, goes on past it;
- **hard deadline** (`hard_factor` times the soft one): stops whatever the trainer is doing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["Patience"]


@dataclass
class Patience:
    """Decides, at each poll, whether a setting's trainer has to be stopped (and says why).

    Args:
        total_steps: the steps the trainer was asked for (after the last one it evaluates: no stall then).
        stall_s: the shortest stall that stops it, seconds.
        soft_deadline: monotonic time past which a trainer that is not progressing is stopped.
        hard_deadline: monotonic time past which it is stopped whatever it does.
        stall_steps: median step intervals without a step that count as a stall, where longer than `stall_s`.
    """

    total_steps: int
    stall_s: float
    soft_deadline: float
    hard_deadline: float
    stall_steps: float = 5.0
    steps: int = 0
    last_step_t: float | None = None
    intervals: list[float] = field(default_factory=list)
    """seconds between consecutive steps seen (a poll that saw several steps splits its interval)"""

    def observe(self, steps: int, now: float) -> None:
        """The trainer's completed steps at `now`."""
        if steps > self.steps:
            if self.last_step_t is not None and self.steps > 0:
                self.intervals += [(now - self.last_step_t) / (steps - self.steps)] * (steps - self.steps)
            self.steps, self.last_step_t = steps, now

    @property
    def stall_limit_s(self) -> float:
        """How long without a step is a stall now."""
        if not self.intervals:
            return self.stall_s
        return max(self.stall_s, self.stall_steps * statistics.median(self.intervals))

    def stop(self, now: float) -> str | None:
        """Why the trainer has to be stopped at `now` (None: let it run)."""
        if now > self.hard_deadline:
            return f"past the hard deadline ({self.steps} of {self.total_steps} steps)"
        finished = self.steps >= self.total_steps  # evaluating and writing its summary: never a stall
        quiet = self.last_step_t is not None and now - self.last_step_t > self.stall_limit_s
        if quiet and not finished:
            return f"no step for {now - self.last_step_t:.0f} s (limit {self.stall_limit_s:.0f} s)"
        if now > self.soft_deadline and self.last_step_t is None:
            return "no step by the deadline"
        return None
