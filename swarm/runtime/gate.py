"""Orders one stage's forwards and backwards within a step exactly as the pipeline schedule says.

Over the network, calls for different micro-batches arrive in whatever order the links deliver them; each
stage runs them in its own program order from `swarm.runtime.schedules` (GPipe or 1F1B), so the networked pipeline
computes what the in-process one does, and 1F1B's bound on activations in flight holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

from swarm.peers.routes import route_replicas
from swarm.runtime.schedules import SCHEDULES, Action, Kind


class GateError(RuntimeError):
    pass


class ScheduleGate:
    """Lets the action `(kind, mb)` of a step run only when it is next in this stage's program."""

    def __init__(self, stage: int, n_stages: int, max_micro_batches: int = 1024):
        self.stage, self.n_stages, self.max_micro_batches = stage, n_stages, max_micro_batches
        self._cond = threading.Condition()
        self._step: int | None = None
        self._program: list[Action] = []
        self._pos = 0
        self._running: Action | None = None
        """The action whose body runs now (a duplicate of it is refused, not run beside it)."""
        self._generation = 0
        """Bumped by every new step and reset: a body that outlives its step does not move the next one on."""
        self.forward_only = False
        """Every layer here and before is frozen (swarm.runtime.freeze): the program has no backward turns."""

    def _program_of(self, schedule: str, n_micro: int) -> list[Action]:
        if schedule not in SCHEDULES:
            raise GateError(f"schedule: unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
        if not 1 <= n_micro <= self.max_micro_batches:
            raise GateError(f"num_micro_batches: {n_micro} is outside 1..{self.max_micro_batches}")
        program = SCHEDULES[schedule](self.n_stages, n_micro)[self.stage]
        return [a for a in program if a.kind != Kind.BACKWARD] if self.forward_only else program

    def _begin(self, step: int, schedule: str, n_micro: int) -> None:
        self._program = self._program_of(schedule, n_micro)
        self._step = step
        self._pos, self._running = 0, None
        self._generation += 1

    def check(self, step: int, kind: Kind, mb: int, schedule: str, n_micro: int, replacing: bool = False) -> None:
        """Raises GateError if `kind mb` of `step` could never run here; changes nothing.

        Run before a call's message is decoded, so a call the schedule would refuse moves no codec state.
        `replacing`: the stage will abandon its unfinished step for this one (a stale step, or one its trainer
        left), so the call is checked against a fresh program.
        """
        want = Action(self.stage, kind, mb)
        with self._cond:
            if self._step == step:
                program, pos = self._program, self._pos
            else:
                if self._step is not None and self._pos < len(self._program) and not replacing:
                    raise GateError(f"step {step} arrived while step {self._step} is unfinished on this stage")
                program, pos = self._program_of(schedule, n_micro), 0
            if want not in program:
                raise GateError(f"micro_batch: {want} is not in stage {self.stage}'s program for step {step}")
            if want in program[:pos] or self._running == want and self._step == step:
                raise GateError(f"{want} of step {step} ran already or is running")

    @property
    def step_done(self) -> bool:
        with self._cond:
            return self._pos == len(self._program)

    def finished(self, step: int) -> bool:
        """Whether every action of `step`'s program ran here (not merely nothing left: a gate reset by an abandon
        has an empty program, which a step opened since has not begun)."""
        with self._cond:
            return self._finished(step)

    def _finished(self, step: int) -> bool:  # `_cond` held
        return self._step == step and self._pos == len(self._program) and self._running is None

    def wait_done(self, step: int, timeout_s: float, over: Callable[[], bool]) -> bool:
        """Waits until every action of `step`'s program here ran (True), or `over()` says to stop waiting, or
        `timeout_s` passed (False). A step not begun here yet is waited for too: a call that waits for the step's
        end (an early Reduce) may come before its first action does. `over` is asked whenever the gate moves or is
        woken (`wake`, `reset`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished(step) or over(), timeout=max(0.0, timeout_s))
            return self._finished(step)

    def wake(self) -> None:
        """Wakes every waiting call to look again (e.g. its caller gave up)."""
        with self._cond:
            self._cond.notify_all()

    @contextmanager
    def turn(
        self,
        step: int,
        kind: Kind,
        mb: int,
        schedule: str,
        n_micro: int,
        timeout_s: float,
        cancelled: threading.Event | None = None,
        open_step: Callable[[], int | None] | None = None,
    ):
        """Waits until `kind mb` of `step` is this stage's next action, runs the body, then moves on.

        The body gets a callable telling whether its step is still the gate's (no reset or new step since):
        check it under the compute lock before changing the worker's state. A set `cancelled` (the caller gave
        up; call `wake()` after setting it) ends the wait at once. `open_step()`: the stage's open step; a call
        whose step the stage closed after admitting it (an abandon in between) does not begin that step again
        here, where it would wait for micro-batches that never come.
        """
        want = Action(self.stage, kind, mb)
        with self._cond:
            if self._step != step:
                if self._step is not None and self._pos < len(self._program):
                    raise GateError(f"step {step} arrived while step {self._step} is unfinished on this stage")
                if open_step is not None and open_step() != step:
                    raise GateError(f"step {step} was abandoned on this stage before {want} reached its turn")
                self._begin(step, schedule, n_micro)
                self._cond.notify_all()  # whoever watches the gate sees the new step
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
                    or cancelled is not None
                    and cancelled.is_set()
                ),
                timeout=timeout_s,
            )
            if cancelled is not None and cancelled.is_set():
                raise GateError(f"{want} of step {step}: the caller gave up while it waited")
            if self._step != step:
                raise GateError(f"step {step} was abandoned while {want} waited")
            if want in self._program[: self._pos]:
                raise GateError(f"{want} of step {step} already ran")
            if not ok:
                raise GateError(f"{want} waited {timeout_s:.1f} s for {self._program[self._pos]} of step {step}")
            self._running, generation = want, self._generation
        try:
            yield lambda: generation == self._generation
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


def runs_through(schedule: str, counts: Sequence[int], numbering: Mapping[tuple[int, int], tuple]) -> bool:
    """Whether the replicas' programs of `schedule` finish for a step numbered by `routes.stage_numbering`
    (`numbering`: (route, k) -> (stage_micro, stage_micro_count)), or some replicas would wait on each other.

    With uneven replica counts a shared replica interleaves the micro-batches of several routes, so 1F1B can
    deadlock from three stages on: e.g. counts (1, 2, 3), routes 3, 4, 5 with 1, 2 and 1 micro-batches: stage 1's
    replica 1 holds its backward of route 3 behind its forward of route 5, which stage 0 runs only after that
    backward. GPipe (every forward first) always runs through. Plays the step out: each replica runs its next
    action once its input is there (the forward from the previous stage, the backward from the next one).
    """
    n_stages = len(counts)
    at: dict[tuple[int, int, int], tuple[int, int]] = {}  # (stage, replica, local index) -> (route, k)
    programs = {}  # (stage, replica) -> its program, for the micro-batch count the numbering gives it
    for (route, k), (index, count) in numbering.items():
        for s, r in enumerate(route_replicas(route, counts)):
            at[(s, r, index[s])] = (route, k)
            if (s, r) not in programs:
                programs[(s, r)] = SCHEDULES[schedule](n_stages, count[s])[s]
    done: set[tuple[Kind, int, tuple[int, int]]] = set()
    pos = dict.fromkeys(programs, 0)
    moved = True
    while moved:
        moved = False
        for (s, r), program in programs.items():
            while pos[(s, r)] < len(program):
                action = program[pos[(s, r)]]
                mb = at[(s, r, action.mb)]
                if action.kind == Kind.FORWARD:
                    ready = s == 0 or (Kind.FORWARD, s - 1, mb) in done
                else:
                    ready = (Kind.FORWARD if s == n_stages - 1 else Kind.BACKWARD, min(s + 1, n_stages - 1), mb) in done
                if not ready:
                    break
                done.add((action.kind, s, mb))
                pos[(s, r)] += 1
                moved = True
    return all(pos[key] == len(program) for key, program in programs.items())
