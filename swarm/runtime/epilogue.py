"""Optimus-CC's epilogue-only compression: which backward messages of a schedule lie on the step's critical path.

In a pipeline most inter-stage gradient messages travel while the receiving stage still has other work (a forward
of a later micro-batch, in 1F1B's steady state): their transfer is hidden, and compressing them only adds error.
The ones sent while the pipeline drains (the epilogue) reach a stage that has nothing else to do: their transfer
shows in the step. Optimus-CC compresses only those, and carries each compressed message's error into the next
compressed one on the same link (lazy error propagation: `gradq`'s error feedback on the compressed codec's own
sending end, reset when the step ends).

Derivation. `step_timeline` plays a schedule's programs (`swarm.runtime.schedules`) on a clock: every action starts
when its stage finished the one before it and its input arrived (a forward: the previous stage's forward of that
micro-batch plus the forward message's transfer; a backward: the next stage's backward plus the backward message's
transfer), so the step's length is the longest path through that graph. `derive_tails` then asks, boundary by
boundary, how few of its backward messages must be compressed for the step to be no longer than with all of them
compressed: it leaves messages at the precise codec from the receiver's first backward on, and stops at the first
one whose transfer would show (the step grows by more than `tolerance`). What stays compressed is a tail of the
receiver's backward order, `EpiloguePlan.tails[b]` messages of boundary b (b: from stage b+1 to stage b). What it
gives (`tests/unit/runtime/test_epilogue.py` checks each):

- GPipe with equal stages: every backward message is exposed. Every stage runs its backwards back to back, each
  one waiting on the next stage's, and every path through the backward phase crosses each boundary once: a
  precise message anywhere lengthens some path by its extra transfer.
- 1F1B with equal stages: every message is exposed too. Stage s warms up with exactly the n_stages - 1 - s forwards
  that fill the round trip to the last stage and back when transfers are free, so in the steady state each
  backward waits on its gradient: the steady state has no slack for any transfer. (Optimus-CC's figure draws the
  steady state's transfers under compute; on this schedule they are not.)
- 1F1B or GPipe where the last stage is the slowest (it carries the LM head and the loss): every other stage
  waits on it, and that wait hides a precise transfer up to the slack. Then only the drain is exposed, the last
  micro-batch's message on each boundary (tail 1), as long as the precise transfer fits in the slack; past it
  the tail grows towards every micro-batch.

A stage finds its own tail by its call's `CallInfo` (`compress_backward`): the schedule, the stage, the micro-batch
and their counts are all it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.runtime.schedules import SCHEDULES, Action, Kind

__all__ = [
    "EpiloguePlan",
    "StageTimes",
    "backward_order",
    "derive_tails",
    "exposed_messages",
    "step_timeline",
    "step_time_s",
]


@dataclass(frozen=True)
class StageTimes:
    """What a step's timeline depends on, per stage and per boundary (seconds of one micro-batch)."""

    forward_s: tuple[float, ...]
    """Each stage's forward compute of one micro-batch."""
    backward_s: tuple[float, ...]
    """Each stage's backward compute of one micro-batch."""
    forward_send_s: tuple[float, ...]
    """Boundary b's forward message transfer (stage b to b+1), one per boundary."""
    precise_send_s: tuple[float, ...]
    """Boundary b's backward message transfer at the precise (hidden) codec."""
    compressed_send_s: tuple[float, ...]
    """Boundary b's backward message transfer at the compressed (exposed) codec."""

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n < 1 or len(self.backward_s) != n:
            raise ValueError("StageTimes: one forward and one backward time per stage")
        sends = (self.forward_send_s, self.precise_send_s, self.compressed_send_s)
        if any(len(s) != n - 1 for s in sends):
            raise ValueError(f"StageTimes: {n - 1} boundaries need one transfer time each way")
        values = (*self.forward_s, *self.backward_s, *(t for s in sends for t in s))
        if not all(0 <= v < float("inf") for v in values):
            raise ValueError("StageTimes: times must be finite and >= 0")

    @property
    def n_stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(
        cls, n_stages: int, forward_s: float, backward_s: float, forward_send_s: float, precise_s: float, compressed_s
    ) -> StageTimes:
        """Equal stages and equal boundaries."""
        b = n_stages - 1
        return cls(
            (forward_s,) * n_stages,
            (backward_s,) * n_stages,
            (forward_send_s,) * b,
            (precise_s,) * b,
            (compressed_s,) * b,
        )


def backward_order(schedule: str, n_stages: int, n_micro: int, stage: int) -> list[int]:
    """The micro-batches of `stage`'s backwards, in the order its program runs them."""
    program = SCHEDULES[schedule](n_stages, n_micro)[stage]
    return [a.mb for a in program if a.kind is Kind.BACKWARD]


def _compressed_set(schedule: str, n_stages: int, n_micro: int, tails: Sequence[int]) -> set[tuple[int, int]]:
    """(boundary, micro-batch) of every compressed backward message under `tails`."""
    out = set()
    for b, tail in enumerate(tails):
        order = backward_order(schedule, n_stages, n_micro, b)
        out.update((b, mb) for mb in order[len(order) - tail :] if tail > 0)
    return out


def step_timeline(
    schedule: str, n_micro: int, times: StageTimes, compressed: set[tuple[int, int]]
) -> dict[Action, tuple[float, float]]:
    """Each action's (start, end) on the clock described in the module docstring; the backward message of
    micro-batch mb on boundary b is compressed where (b, mb) is in `compressed`."""
    n = times.n_stages
    programs = SCHEDULES[schedule](n, n_micro)
    cursor, clock, when = [0] * n, [0.0] * n, {}
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for s in range(n):
            while cursor[s] < len(programs[s]):
                a = programs[s][cursor[s]]
                ready = _ready_at(a, when, times, compressed, n)
                if ready is None:
                    break
                start = max(clock[s], ready)
                cost = times.forward_s[s] if a.kind is Kind.FORWARD else times.backward_s[s]
                when[a] = (start, start + cost)
                clock[s], cursor[s], remaining, progressed = start + cost, cursor[s] + 1, remaining - 1, True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks on {n} stages")
    return when


def _ready_at(a: Action, when: dict, times: StageTimes, compressed: set, n: int) -> float | None:
    """When `a`'s input is at its stage (None: its producer has not run yet)."""
    if a.kind is Kind.FORWARD:
        if a.stage == 0:
            return 0.0
        done = when.get(Action(a.stage - 1, Kind.FORWARD, a.mb))
        return None if done is None else done[1] + times.forward_send_s[a.stage - 1]
    if a.stage == n - 1:
        done = when.get(Action(a.stage, Kind.FORWARD, a.mb))
        return None if done is None else done[1]
    done = when.get(Action(a.stage + 1, Kind.BACKWARD, a.mb))
    if done is None:
        return None
    b = a.stage
    send = times.compressed_send_s[b] if (b, a.mb) in compressed else times.precise_send_s[b]
    return done[1] + send


def step_time_s(schedule: str, n_micro: int, times: StageTimes, compressed: set[tuple[int, int]]) -> float:
    """The step's pipeline length (the last action's end) on that clock."""
    return max(end for _, end in step_timeline(schedule, n_micro, times, compressed).values())


def derive_tails(schedule: str, n_micro: int, times: StageTimes, tolerance: float = 1e-9) -> tuple[int, ...]:
    """Per boundary, how many backward messages (the last of the receiver's backward order) to compress so that the
    step is at most `tolerance` (a share) longer than with every backward message compressed. Boundaries are
    settled from the first stage's on (the drain ends there); on each, messages are left precise from the
    receiver's first backward on until one would lengthen the step."""
    n = times.n_stages
    everything = [n_micro] * (n - 1)
    bound = step_time_s(schedule, n_micro, times, _compressed_set(schedule, n, n_micro, everything)) * (1 + tolerance)
    tails = list(everything)
    for b in range(n - 1):
        while tails[b] > 0:
            trial = [*tails[:b], tails[b] - 1, *tails[b + 1 :]]
            if step_time_s(schedule, n_micro, times, _compressed_set(schedule, n, n_micro, trial)) > bound:
                break
            tails = trial
    return tuple(tails)


def exposed_messages(schedule: str, n_stages: int, n_micro: int, tails: Sequence[int]) -> list[tuple[int, int]]:
    """(boundary, micro-batch) of the compressed backward messages under `tails`, sorted: for reports and tests."""
    return sorted(_compressed_set(schedule, n_stages, n_micro, tails))


@dataclass(frozen=True)
class EpiloguePlan:
    """Epilogue-only compression of one pipeline: per boundary, how many of the receiver's last backwards get their
    gradient at the compressed codec; the others go at the precise one.

    `tails` were derived (`derive_tails`) for one schedule and micro-batch count; a step of another shape (or with
    `tails` None) compresses every message, what a run does without epilogue-only compression. `schedule` "" and
    `n_micro` 0 apply the tails to any shape (each capped at the step's micro-batches), e.g. `(1,)` for "only the
    drain's last message", what the derivation gives when the last stage is the slowest."""

    tails: tuple[int, ...] | None = None
    schedule: str = ""
    n_micro: int = 0

    def __post_init__(self) -> None:
        if self.tails is not None and (not self.tails or min(self.tails) < 0):
            raise ValueError(f"EpiloguePlan: tails must be >= 0, one per boundary, got {self.tails}")
        if self.schedule and self.schedule not in SCHEDULES:
            raise ValueError(f"EpiloguePlan: unknown schedule {self.schedule!r}")
        if self.n_micro < 0:
            raise ValueError("EpiloguePlan: n_micro must be >= 0")

    def tail(self, schedule: str, n_stages: int, n_micro: int, boundary: int) -> int:
        """How many of boundary `boundary`'s backward messages are compressed in a step of this shape."""
        fits = (
            self.tails is not None
            and len(self.tails) == n_stages - 1
            and self.schedule in ("", schedule)
            and self.n_micro in (0, n_micro)
        )
        return min(self.tails[boundary], n_micro) if fits else n_micro

    def compress_backward(self, schedule: str, n_stages: int, n_micro: int, sender: int, mb: int) -> bool:
        """Whether `sender`'s backward message of micro-batch `mb` goes compressed; ValueError for a message that
        no step of this shape sends."""
        if not 0 < sender < n_stages or not 0 <= mb < n_micro or schedule not in SCHEDULES:
            raise ValueError(
                f"no backward message from stage {sender} of {n_stages}, micro-batch {mb} of {n_micro} ({schedule})"
            )
        boundary = sender - 1
        tail = self.tail(schedule, n_stages, n_micro, boundary)
        order = backward_order(schedule, n_stages, n_micro, boundary)
        return order.index(mb) >= len(order) - tail

    def describe(self) -> str:
        """A short label: `all` (every message compressed) or the tails, e.g. `tails 1,1 (1f1b, 4 mb)`."""
        if self.tails is None:
            return "all"
        shape = f" ({self.schedule or 'any'}, {self.n_micro or 'any'} mb)"
        return "tails " + ",".join(map(str, self.tails)) + shape
