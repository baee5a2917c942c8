"""Orders one stage's forwards and backwards within a step exactly as the pipeline schedule says.

Over the network, calls for different micro-batches arrive in whatever order the links deliver them; each
stage runs them in its own program order from `swarm.runtime.schedules` (GPipe or 1F1B), so the networked pipeline
computes what the in-process one does, and 1F1B's bound on activations in flight holds.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from swarm.runtime.schedules import SCHEDULES, Action, Kind


class GateError(RuntimeError):
    pass


class ScheduleGate:
    """Lets the action `(kind, mb)` of a step run only when it is next in this stage's program."""

    def __init__(self, stage: int, n_stages: int):
        self.stage, self.n_stages = stage, n_stages
        self._cond = threading.Condition()
        self._step: int | None = None
        self._program: list[Action] = []
        self._pos = 0
        self._running: Action | None = None
        """The action whose body runs now (a duplicate of it is refused, not run beside it)."""
        self._generation = 0
        """Bumped by every new step and reset: a body that outlives its step does not move the next one on."""

    def _begin(self, step: int, schedule: str, n_micro: int) -> None:
        if schedule not in SCHEDULES:
            raise GateError(f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
        if not 1 <= n_micro <= 1024:
            raise GateError(f"num_micro_batches {n_micro} is outside 1..1024")
        self._step = step
        self._program = SCHEDULES[schedule](self.n_stages, n_micro)[self.stage]
        self._pos, self._running = 0, None
        self._generation += 1

    @property
    def step_done(self) -> bool:
        with self._cond:
            return self._pos == len(self._program)

    @contextmanager
    def turn(self, step: int, kind: Kind, mb: int, schedule: str, n_micro: int, timeout_s: float):
        """Waits until `kind mb` of `step` is this stage's next action, runs the body, then moves on."""
        want = Action(self.stage, kind, mb)
        with self._cond:
            if self._step != step:
                if self._step is not None and self._pos < len(self._program):
                    raise GateError(f"step {step} arrived while step {self._step} is unfinished on this stage")
                self._begin(step, schedule, n_micro)
            if want not in self._program:
                raise GateError(f"{want} is not in stage {self.stage}'s program for step {step}")
            if self._running == want:
                raise GateError(f"{want} of step {step} is running already")
            ok = self._cond.wait_for(
                lambda: (
                    self._pos < len(self._program)
                    and self._program[self._pos] == want
                    and self._running is None
                    or self._step != step
                    or want in self._program[: self._pos]
                ),
                timeout=timeout_s,
            )
            if self._step != step:
                raise GateError(f"step {step} was abandoned while {want} waited")
            if want in self._program[: self._pos]:
                raise GateError(f"{want} of step {step} already ran")
            if not ok:
                raise GateError(f"{want} waited {timeout_s:.1f} s for {self._program[self._pos]} of step {step}")
            self._running, generation = want, self._generation
        try:
            yield
        finally:
            with self._cond:
                if generation == self._generation:  # a reset or a new step since: this body moves nothing on
                    self._pos += 1
                    self._running = None
                self._cond.notify_all()

    def reset(self) -> None:
        """Abandons the current step (waiting calls fail) and accepts any next one."""
        with self._cond:
            self._step, self._program, self._pos, self._running = None, [], 0, None
            self._generation += 1
            self._cond.notify_all()
