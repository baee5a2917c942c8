"""The trainer's journal (`trainer_state.json`) and how a restarted trainer settles the step its last life left.

Every step is written down twice, before it changes anything on the stages: `begin(k)` before its first call
(step k may be open on the stages), `commit(c)` before its first Step (some stages may have applied step k).
Each write replaces the file whole (a temporary file renamed into place), so a SIGKILL at any moment leaves one
complete record: the one before or the one after. Only the begin record of every `durable_every`-th step and the
last record are fsynced (an fsync costs ~20 ms on a plain disk): a SIGKILL loses nothing, a power cut the
records since.

`settle` reads the record against the stages: a committed step is finished where it is missing (its Step sent
again with the recorded norm: a stage that applied it changes nothing, one that holds it open applies it) and
the run goes on after it; an open, uncommitted step (no stage applied it) is abandoned on every stage and run
again. So every stage applies every step exactly once, however the trainer died.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.runtime.commit import StepCommit
from swarm.train.steplog import load_state, save_position

__all__ = ["Journal", "JournalError", "Settled", "settle"]

log = logging.getLogger("swarm.train.journal")

SETTLE_TIMEOUT_S = 15.0
"""longest the stages may keep a step open after it was abandoned (late calls of the killed trainer)"""


class JournalError(OSError):
    """The journal could not record a step's commit: the trainer stops before the step's Step."""


@dataclass(frozen=True)
class Settled:
    """Where a resumed run goes on, and the step it finished on the stages (its row may be missing)."""

    next_step: int
    """the step to run next (0-based)"""
    finished: StepCommit | None = None
    """the committed step finished now (or found applied everywhere): the trainer writes its row if missing"""
    lr: float = 0.0
    """the learning rate the finished step used"""
    lost: tuple[str, ...] = ()
    """peers that could not apply the finished step (they no longer held it open): named in the log"""


class Journal:
    """Writes the trainer's position and its open or committed step to `out`/trainer_state.json."""

    def __init__(self, out: Path, identity: dict, steps_per_epoch: int, durable_every: int = 50):
        self.out, self.identity, self.steps_per_epoch = out, identity, steps_per_epoch
        self.durable_every = durable_every

    def load(self) -> tuple[int, int | None, StepCommit | None] | None:
        """(next step, open step, commit) of the last life; None without a journal. Raises ValueError naming the
        file if it is another run's or malformed."""
        state = load_state(self.out, self.identity)
        if state is None:
            return None
        open_step, commit = state.get("open"), state.get("commit")
        if open_step is not None and (type(open_step) is not int or open_step < 0):
            raise ValueError(f"{self.out / 'trainer_state.json'}: open must be an integer >= 0, got {open_step!r}")
        try:
            commit = None if commit is None else StepCommit.from_dict(commit)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.out / 'trainer_state.json'}: commit: {e}") from None
        return state["step"], open_step, commit

    def begin(self, step: int) -> None:
        """Step `step` starts: its calls may open it on the stages from now on. Fsynced every `durable_every`
        steps."""
        self._write(step, durable=step % self.durable_every == 0, open=step)

    def commit(self, commit: StepCommit) -> None:
        """Step `commit.step`'s Steps go out next: from now on some stage may have applied it. Raises JournalError
        when the record cannot be written (a full disk): no Step may leave unrecorded, or a resume after a kill
        would run the step again where it was applied; the stages drop the open step when a trainer comes back."""
        if not self._write(commit.step, open=commit.step, commit=commit.to_dict()):
            raise JournalError(f"{self.out / 'trainer_state.json'}: step {commit.step + 1}'s commit record was not "
                               "written (see the error above); stopping before its Step")  # fmt: skip

    def close(self, next_step: int) -> None:
        """Between steps, for good (the run ended or stopped): nothing is open. Always fsynced."""
        self._write(next_step, durable=True)

    def _write(self, step: int, durable: bool = False, **extra) -> bool:
        """Whether the record was written (False: the disk refused it, logged; the previous record stays)."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        return save_position(self.out, step, epoch, batch, self.identity, durable=durable, **extra)


def settle(driver, record: tuple[int, int | None, StepCommit | None], say=lambda line: None) -> Settled:
    """Brings the stages of `driver` to the journal's record and returns where the run goes on.

    A committed step is sent again to its peers (`PipelineDriver.finish_step`): where any applied it, the run
    goes on after it (a peer that refuses no longer held it: named, its stage misses that one update); where none
    could (say a new plan closed the step everywhere), it is abandoned and run again. An uncommitted open step is
    abandoned everywhere. Either way no stage is left holding a step open (the killed trainer's late calls may
    open it again: it is abandoned until it stays closed, up to `SETTLE_TIMEOUT_S`)."""
    next_step, open_step, commit = record
    settled = Settled(next_step)
    if commit is not None:
        replies = driver.finish_step(commit)
        applied = {p: r for p, r in replies.items() if not isinstance(r, Exception)}
        applied.update(_applied_before(driver, commit, set(replies) - set(applied)))
        if applied:
            lost = tuple(sorted(set(replies) - set(applied)))
            for peer in lost:
                log.error("step %d: peer %s cannot apply it (%s): its stage misses that update", commit.step, peer,
                          replies[peer])  # fmt: skip
            settled = Settled(commit.step + 1, commit, max(applied.values()), lost)
            say(f"step {commit.step + 1} was committed before the stop: finished on the stages that missed it")
            open_step = None
        else:
            why = "; ".join(f"{p}: {e}" for p, e in replies.items())
            say(f"step {commit.step + 1} was committed but no stage can apply it ({why}): running it again")
            settled, open_step = Settled(commit.step), commit.step
    elif open_step is not None:
        say(f"step {open_step + 1} was open on the stages: abandoned, and run again")
        settled = Settled(open_step)
    if open_step is None and (ahead := _stages_ahead(driver, settled.next_step)) is not None:
        say(f"the stages applied step {ahead + 1} already, past the journal's step {settled.next_step} (its records "
            "since were lost: an older trainer's position, a power cut): going on after it")  # fmt: skip
        settled = Settled(ahead + 1)
    # the step the run goes on with may be open too where a begin record was not written (a full disk)
    _abandon(driver, settled.next_step if open_step is None else open_step)
    return settled


def _stages_ahead(driver, next_step: int) -> int | None:
    """The last step the stages applied, where it is at or past `next_step` (the journal lags them: running from
    it would apply those steps twice); None otherwise. A stage that reports no applied step of this run's (steps
    done 0, or a last step of 0: restored from a checkpoint, it knows its count, not its last step) is left out."""
    try:
        replies = [r for row in driver.replica_status() for r in row if r is not None]
    except Exception as e:
        log.warning("the stages' applied steps are not known (%s): going on from the journal's", e)
        return None
    applied = [r.last_step for r in replies if r.steps_done and r.last_step]
    if not applied or max(applied) < next_step:
        return None
    if min(applied) != max(applied):
        log.error("the stages applied different last steps (%s): the journal lost a step applied on only some of "
                  "them", sorted(set(applied)))  # fmt: skip
    return max(applied)


def _applied_before(driver, commit: StepCommit, refused: set[str]) -> dict[str, float]:
    """Those of `refused` whose status says they applied `commit.step` already: a stage that moved to a new plan
    since refuses the old plan's Step even as a retry, but its last applied step still counts (else the step would
    run again where it was applied). Their lr is not known (0)."""
    if not refused:
        return {}
    try:
        replies = [r for row in driver.replica_status() for r in row if r is not None]
    except Exception as e:
        log.warning("step %d: the refusing stages' status is not known (%s)", commit.step, e)
        return {}
    return {r.peer_id: 0.0 for r in replies if r.peer_id in refused and r.steps_done and r.last_step == commit.step}


def _abandon(driver, step: int) -> None:
    """Abandons `step` until no stage holds a step open (a late call of the killed trainer may open it again)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        try:
            replies = [r for row in driver.replica_status() for r in row if r is not None]
        except Exception as e:  # a stage gone: the first step finds it (and reroutes, or waits for a plan)
            log.warning("before step %d: a stage's status is not known (%s)", step, e)
            return
        if not any(r.step_open for r in replies):
            return
        if time.monotonic() > deadline:  # another step than ours? the first call of the run closes it (same key)
            busy = [r.peer_id for r in replies if r.step_open]
            log.warning("a step stays open on %s after %.0f s of abandons of step %d", busy, SETTLE_TIMEOUT_S, step)
            return
        driver.abandon(step)
        time.sleep(0.2)  # poll interval: the killed trainer's calls end within their deadline
