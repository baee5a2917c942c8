"""A stage's step ledger: which step is open on it, who opened it, its calls in flight, and which step it applied.

The stage host asks the ledger whether a call may open or replace a step, and tells it when a call is admitted,
when one ends and when the step closes (applied or abandoned). The ledger holds no tensors and calls nothing:
the host does the work (dropping gradients, undoing codec state) under its compute lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import grpc

from swarm.net.stream import PLAN_MISMATCH, CallRefused
from swarm.runtime.gate import GateError

__all__ = ["StepLedger"]


class StepLedger:
    """The open step's bookkeeping and the record of applied steps (one per stage host).

    `open_step` and the applied record change under the host's compute lock; `_calls` guards the in-flight
    count and the last-touched time, so ending a call never waits for the compute lock."""

    def __init__(self) -> None:
        self.open_step: int | None = None
        """The step this stage has taken calls for and not yet stepped or abandoned (None between steps)."""
        self.owner: str | None = None
        """Who opened the step (the caller's peer id, when calls are authenticated)."""
        self.progressed = False
        """Whether the open step ran any schedule action or took labels."""
        self.opened_at = 0.0
        """perf_counter when the open step's first call was admitted"""
        self.inflight = 0
        """Calls admitted and not yet answered; a step with none in flight and no progress closes itself."""
        self._touched = time.monotonic()
        self._calls = threading.Lock()
        self._abandoned: deque[tuple[int, int]] = deque(maxlen=16)
        """(step, attempt id) of the attempts this stage was told to abandon: their late calls are refused"""
        self.steps_done = 0
        self.last_step: int | None = None
        """The last step this stage applied, and the lr it used: a retried Step for it changes nothing."""
        self.last_lr = 0.0

    # ---- calls ----------------------------------------------------------------------------------------------

    def may_close(self, step: int, caller: str | None, stale_s: float) -> bool:
        """Whether the open step may give way to `step`: it is stale (no call in flight and none for `stale_s`),
        or the trainer that opened it moved on to another step (a trainer runs one step at a time: calls for
        another step mean it gave this one up)."""
        if self.inflight:
            return False
        if time.monotonic() - self._touched > stale_s:
            return True
        return caller is not None and caller == self.owner

    def was_abandoned(self, step: int, attempt_id: int) -> bool:
        """Whether the trainer told this stage to abandon that attempt of `step`."""
        return bool(attempt_id) and (step, attempt_id) in self._abandoned

    def check_attempt(self, step: int, attempt_id: int) -> None:
        """Refuses a late call of an attempt this stage was told to abandon (it would open the step again)."""
        if self.was_abandoned(step, attempt_id):
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"that attempt of step {step} was abandoned")

    def abandoned(self, step: int, attempt_id: int) -> None:
        """The trainer abandoned that attempt of `step`: its late calls are refused from now on."""
        if attempt_id:
            self._abandoned.append((step, attempt_id))

    def open(self, step: int, caller: str | None) -> bool:
        """Marks `step` open (the caller closed any other first) and counts the admitted call; whether the step
        was newly opened (its first call: the step's clock starts)."""
        opened = self.open_step != step
        if opened:
            self.open_step, self.owner, self.progressed = step, caller, False
            self.opened_at = time.perf_counter()
        with self._calls:
            self._touched = time.monotonic()
            self.inflight += 1
        return opened

    def leave(self) -> bool:
        """Ends an admitted call; whether the open step made no progress and has no call left in flight (it
        should close again: the calls failed early)."""
        with self._calls:
            self.inflight -= 1
            self._touched = time.monotonic()
            idle = self.inflight == 0
        return self.idle_unused() if idle else False

    def idle_unused(self) -> bool:
        """Whether a step is open without progress and without a call in flight."""
        return self.inflight == 0 and self.open_step is not None and not self.progressed

    def orphaned(self, idle_s: float) -> bool:
        """Whether the open step has had no call in flight, and none admitted, for `idle_s` seconds."""
        return self.inflight == 0 and time.monotonic() - self._touched > idle_s

    def still(self, current: bool, step: int, mb: int) -> None:
        """Under the compute lock: the call's step is still the open one (not abandoned while it waited for its
        turn, `current` False), and the step now made progress."""
        if not current or self.open_step != step:
            raise GateError(f"step {step} was abandoned before micro-batch {mb} ran")
        self.progressed = True

    def close(self) -> None:
        self.open_step, self.owner, self.progressed = None, None, False

    # ---- applied steps --------------------------------------------------------------------------------------

    def applied(self, step: int, plan_version: int, own_version: int) -> bool:
        """Whether a Step for `step` is a retry of the step applied last (after a lost reply)."""
        return step == self.last_step and plan_version == own_version and self.open_step != step

    def check_apply(self, step: int, plan_version: int, own_version: int) -> None:
        """Refuses a Step of another plan, or of a step that is not the open one."""
        if plan_version != own_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the step follows plan {plan_version}, this peer follows plan {own_version}",
            )
        if self.open_step != step:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {step} never ran on this stage (open step: {self.open_step})",
            )

    def record(self, step: int, lr: float) -> None:
        """`step` was applied with learning rate `lr`."""
        self.steps_done += 1
        self.last_step, self.last_lr = step, lr

    def restore(self, steps_done: int) -> None:
        """Continues the count of applied steps from a checkpoint or a handed-over state (never backwards)."""
        self.steps_done = max(self.steps_done, steps_done)
