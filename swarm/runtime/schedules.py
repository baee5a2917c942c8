"""Pipeline schedules as data: per-stage lists of forward/backward actions, their builders and checks.

A schedule gives `Programs`: for each stage, the order in which it runs its micro-batches' forwards (F) and
backwards (B). Nothing here runs a model; every stage host interprets its own program, and `linearize`
turns the programs into one global order that respects the data dependencies
(a forward needs the previous stage's forward of that micro-batch, a backward the next stage's backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Kind",
    "Action",
    "Programs",
    "gpipe",
    "one_f_one_b",
    "SCHEDULES",
    "validate",
    "max_in_flight",
    "backward_follows_forward",
    "linearize",
    "format_programs",
]


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"


F = Kind.FORWARD
B = Kind.BACKWARD


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: `stage` runs the forward or backward of micro-batch `mb`."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str`: "1F0" -> Action(1, F, 0)."""
        for kind in Kind:
            stage, sep, mb = text.partition(kind.value)
            if sep:
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"not an action: {text!r}")


Programs = list[list[Action]]
"""programs[s] is stage s's program: its actions in the order it runs them."""


def gpipe(n_stages: int, n_micro: int) -> Programs:
    """GPipe: every stage runs all forwards, then all backwards (in the same micro-batch order).

    Holds all `n_micro` activations in flight on every stage; simplest, and the bubble is the same as
    1F1B's, so it is the reference schedule.
    """
    _check_sizes(n_stages, n_micro)
    return [
        [Action(s, F, m) for m in range(n_micro)] + [Action(s, B, m) for m in range(n_micro)] for s in range(n_stages)
    ]


def one_f_one_b(n_stages: int, n_micro: int) -> Programs:
    """1F1B (PipeDream-flush): a warm-up of forwards, then alternate one forward and one backward.

    Stage s warms up with `n_stages - s - 1` forwards, so it never holds more than `n_stages - s`
    micro-batches' activations, whatever the number of micro-batches.
    """
    _check_sizes(n_stages, n_micro)
    programs: Programs = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, n_micro)
        actions = [Action(s, F, m) for m in range(warmup)]
        for i in range(n_micro - warmup):
            actions += [Action(s, F, warmup + i), Action(s, B, i)]
        actions += [Action(s, B, m) for m in range(n_micro - warmup, n_micro)]
        programs.append(actions)
    return programs


SCHEDULES: dict[str, Callable[[int, int], Programs]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
"""The schedule registry: builders by their command-line name. Every `--schedule` flag takes its choices from
here and the stage hosts look schedules up here, so a new schedule is its builder, its tests and one entry."""


def _check_sizes(n_stages: int, n_micro: int) -> None:
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {n_stages} and {n_micro}")


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward has run and backward has not, over one stage's program."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind is F else -1
        peak = max(peak, live)
    return peak


def backward_follows_forward(schedule: str, n_stages: int, n_micro: int) -> bool:
    """Whether the last stage of `schedule` runs every micro-batch's backward right after its forward (1F1B; not
    GPipe, whose last stage runs every forward first): there the trainer's Backward start must already be waiting
    when the forward ends, so the driver sends it with the Forward (`PipelineDriver._micro_batch`)."""
    program = SCHEDULES[schedule](n_stages, n_micro)[n_stages - 1]
    return all(
        a.kind == Kind.FORWARD and b == Action(a.stage, Kind.BACKWARD, a.mb)
        for a, b in zip(program[::2], program[1::2], strict=True)
    )


def validate(programs: Programs, n_micro: int) -> None:
    """Raise ValueError unless `programs` is a complete, runnable schedule for `n_micro` micro-batches.

    Checks: stage s's program only holds stage-s actions; every micro-batch is run forward and backward
    exactly once per stage; each forward precedes its backward; and the stages together do not deadlock
    (`linearize` succeeds).
    """
    for s, actions in enumerate(programs):
        if any(a.stage != s for a in actions):
            raise ValueError(f"stage {s}'s program holds another stage's action: {actions}")
        for kind in Kind:
            mbs = sorted(a.mb for a in actions if a.kind is kind)
            if mbs != list(range(n_micro)):
                raise ValueError(f"stage {s} runs {kind.value} on micro-batches {mbs}, not 0..{n_micro - 1}")
        seen_forward: set[int] = set()
        for a in actions:
            if a.kind is F:
                seen_forward.add(a.mb)
            elif a.mb not in seen_forward:
                raise ValueError(f"{a} runs before its forward {s}F{a.mb}")
    linearize(programs)


def _ready(a: Action, done: set[Action], n_stages: int) -> bool:
    if a.kind is F:
        return a.stage == 0 or Action(a.stage - 1, F, a.mb) in done
    if a.stage == n_stages - 1:
        return Action(a.stage, F, a.mb) in done
    return Action(a.stage + 1, B, a.mb) in done


def linearize(programs: Programs) -> list[list[Action]]:
    """Run the programs on an idealised clock where every action takes one tick and transfers are free.

    Returns the actions grouped by tick (stages that work in the same tick run concurrently on a real
    pipeline); flattening the ticks gives an order the single-threaded runtime can execute. Raises
    ValueError if the stages would deadlock waiting on each other.
    """
    n_stages = len(programs)
    cursor = [0] * n_stages
    done: set[Action] = set()
    ticks: list[list[Action]] = []
    while any(cursor[s] < len(programs[s]) for s in range(n_stages)):
        tick = [
            programs[s][cursor[s]]
            for s in range(n_stages)
            if cursor[s] < len(programs[s]) and _ready(programs[s][cursor[s]], done, n_stages)
        ]
        if not tick:
            blocked = [str(programs[s][cursor[s]]) for s in range(n_stages) if cursor[s] < len(programs[s])]
            raise ValueError(f"schedule deadlocks: every stage waits ({', '.join(blocked)})")
        for a in tick:
            cursor[a.stage] += 1
        done.update(tick)
        ticks.append(tick)
    return ticks


def format_programs(programs: Programs) -> str:
    """The programs as a timeline, one row per stage and one column per tick ('.' = idle)."""
    ticks = linearize(programs)
    width = max((len(str(a)) for tick in ticks for a in tick), default=3)
    rows = []
    for s in range(len(programs)):
        cells = []
        for tick in ticks:
            hit = next((a for a in tick if a.stage == s), None)
            cells.append((str(hit) if hit else ".").ljust(width))
        rows.append(" ".join(cells).rstrip())
    return "\n".join(rows)
