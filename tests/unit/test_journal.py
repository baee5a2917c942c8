"""The trainer's journal and the settling of the step a killed trainer left (`swarm.train.journal`), and a
resumed steps.csv (`StepLog(resume_at=...)`): without processes; the kills themselves are
tests/integration/test_resume_kills.py."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pytest

from swarm.net.stream import CallRefused
from swarm.runtime.commit import StepCommit
from swarm.train import journal as journal_mod
from swarm.train.journal import Journal, settle
from swarm.train.steplog import StepLog

RUN = {"seed": 0, "batch_size": 4, "train_samples": 16}
COMMIT = StepCommit(step=6, grad_norm=1.5, loss_scale=0.0, plan_version=3, loss=4.2, peers=("a", "b"))


def test_begin_and_commit_records_round_trip_and_name_the_position(tmp_path):
    j = Journal(tmp_path, RUN, steps_per_epoch=4)
    assert j.load() is None
    j.begin(6)
    assert j.load() == (6, 6, None)
    j.commit(COMMIT)
    assert j.load() == (6, 6, COMMIT)
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert (state["epoch"], state["batch"]) == (1, 2)  # step 6 of 4 a epoch
    j.close(7)
    assert j.load() == (7, None, None) and not (tmp_path / "trainer_state.json.tmp").exists()


def test_a_non_finite_norm_commits_as_a_skip():
    assert StepCommit(1, math.inf, 1024.0, 0, math.nan, ("a",)).skip and not COMMIT.skip


@pytest.mark.parametrize(
    "commit, words",
    [
        ({"step": -1}, "lacks"),
        ({**COMMIT.to_dict(), "step": -1}, "step and plan_version"),
        ({**COMMIT.to_dict(), "peers": []}, "peers"),
        ({**COMMIT.to_dict(), "peers": "ab"}, "peers"),
        ({**COMMIT.to_dict(), "grad_norm": "1"}, "grad_norm"),
        ({**COMMIT.to_dict(), "loss_scale": -2.0}, "loss_scale"),
        ([1, 2], "object"),
    ],
)
def test_a_malformed_journal_is_refused_naming_the_file_and_field(tmp_path, commit, words):
    Journal(tmp_path, RUN, 4).commit(COMMIT)
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "commit": commit}))
    with pytest.raises(ValueError, match="trainer_state.json: commit") as err:
        Journal(tmp_path, RUN, 4).load()
    assert words in str(err.value)
    path.write_text(json.dumps({**json.loads(path.read_text()), "commit": None, "open": "3"}))
    with pytest.raises(ValueError, match="open must be an integer"):
        Journal(tmp_path, RUN, 4).load()


def test_another_runs_journal_is_refused(tmp_path):
    Journal(tmp_path, RUN, 4).begin(2)
    with pytest.raises(ValueError, match="another run's: seed 0 \\(now 1\\)"):
        Journal(tmp_path, {**RUN, "seed": 1}, 4).load()


class FakeDriver:
    """Stages as the settle sees them: which peers apply a finished step, and how long a step stays open."""

    def __init__(self, applies: dict[str, bool], open_for: int = 0):
        self.applies, self.open_for = applies, open_for
        self.abandoned: list[int] = []
        self.finished: list[StepCommit] = []

    def finish_step(self, commit):
        self.finished.append(commit)
        return {p: 0.01 if ok else CallRefused(9, f"step {commit.step} never ran") for p, ok in self.applies.items()}

    def abandon(self, step):
        self.abandoned.append(step)
        self.open_for -= 1  # closed, unless a late call of the killed trainer opens it once more

    def replica_status(self):
        return [[SimpleNamespace(step_open=self.open_for > 0, peer_id="a", steps_done=0, last_step=0)], [None]]


def test_a_committed_step_is_finished_and_the_run_goes_on_after_it():
    driver = FakeDriver({"a": True, "b": True})
    said = []
    settled = settle(driver, (6, 6, COMMIT), said.append)
    assert (settled.next_step, settled.finished, settled.lr, settled.lost) == (7, COMMIT, 0.01, ())
    assert driver.abandoned == [] and "step 7 was committed" in said[0]


def test_a_committed_step_no_stage_can_apply_is_abandoned_and_run_again():
    driver = FakeDriver({"a": False, "b": False}, open_for=1)
    settled = settle(driver, (6, 6, COMMIT))
    assert (settled.next_step, settled.finished) == (6, None) and driver.abandoned == [6]


def test_a_stage_that_applied_the_step_before_a_replan_counts_though_it_refuses_the_old_plans_step():
    driver = FakeDriver({"a": False, "b": False})
    driver.replica_status = lambda: [[SimpleNamespace(step_open=False, peer_id="a", steps_done=7, last_step=6)]]
    settled = settle(driver, (6, 6, COMMIT))  # a applied step 6, then followed a new plan; b never got its Step
    assert settled.next_step == 7 and settled.lost == ("b",) and driver.abandoned == []


def test_a_stage_that_lost_the_committed_step_is_named(caplog):
    settled = settle(FakeDriver({"a": True, "b": False}), (6, 6, COMMIT))
    assert settled.next_step == 7 and settled.lost == ("b",)
    assert "peer b cannot apply it" in caplog.text


def test_an_open_step_is_abandoned_until_no_stage_holds_it():
    driver = FakeDriver({}, open_for=2)  # a late call of the killed trainer opens it again once
    settled = settle(driver, (5, 5, None))
    assert settled.next_step == 5 and driver.abandoned == [5, 5] and driver.finished == []


def test_a_step_that_stays_open_is_left_to_the_first_call_after_a_bounded_wait(monkeypatch, caplog):
    monkeypatch.setattr(journal_mod, "SETTLE_TIMEOUT_S", 0.0)
    settled = settle(FakeDriver({}, open_for=100), (5, 5, None))
    assert settled.next_step == 5 and "stays open" in caplog.text


def test_between_steps_nothing_is_settled():
    driver = FakeDriver({})
    assert settle(driver, (9, None, None)).next_step == 9 and driver.abandoned == driver.finished == []


def test_the_next_step_is_abandoned_where_its_begin_record_was_not_written():
    driver = FakeDriver({"a": True}, open_for=1)  # the disk refused begin 9: the journal still says commit 8
    commit = StepCommit(8, 1.0, 0.0, 0, 3.0, ("a",))
    assert settle(driver, (8, 8, commit)).next_step == 9 and driver.abandoned == [9]


def test_no_step_leaves_without_its_commit_record(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "save_position", lambda *a, **k: False)  # a full disk (logged there)
    with pytest.raises(journal_mod.JournalError, match="step 7's commit record was not written"):
        Journal(tmp_path, RUN, 4).commit(COMMIT)
    Journal(tmp_path, RUN, 4).begin(7)  # a begin record may fail: the resume abandons the next step anyway


FIELDS = ["step", "train_loss", "step_s", "forward_bytes"]


def _row(step: int) -> dict:
    return {"step": step, "train_loss": 5.0 - step / 8, "step_s": 0.5, "forward_bytes": 10, "sample_ids": "1 2"}


def test_a_resumed_log_appends_to_every_earlier_life_each_step_once(tmp_path):
    first = StepLog(tmp_path, FIELDS)
    for step in (1, 2, 3):
        first.add(_row(step))
    first.close()  # life 1 stopped cleanly: steps.csv
    second = StepLog(tmp_path, FIELDS, resume_at=3)
    for step in (4, 5, 6):
        second.add(_row(step))
    # life 2 is SIGKILLed mid-write of row 7: its lines stay, the last one cut short
    second._lines.write(json.dumps(_row(7))[:20])
    second._lines.flush()
    third = StepLog(tmp_path, FIELDS, resume_at=5)  # the journal says step 6 (0-based 5) runs again
    assert third.count == 5 and third.has(5) and not third.has(6) and third.totals["forward_bytes"] == 50
    third.add(_row(6))
    with open(third.close()) as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "5", "6"]
    assert rows[0]["sample_ids"] == "1 2" and float(rows[2]["train_loss"]) == _row(3)["train_loss"]


def test_a_fresh_run_overwrites_and_a_resume_at_zero_keeps_nothing(tmp_path):
    log = StepLog(tmp_path, FIELDS)
    log.add(_row(1))
    log.close()
    assert StepLog(tmp_path, FIELDS, resume_at=0).count == 0
    assert StepLog(tmp_path, FIELDS).count == 0


def test_only_every_nth_begin_record_and_the_last_are_fsynced(tmp_path, monkeypatch):
    from swarm.train import steplog

    synced, write = [], steplog.write_state

    def write_state(tmp, text, durable):
        if durable:
            synced.append(json.loads(text))
        write(tmp, text, durable)

    monkeypatch.setattr(steplog, "write_state", write_state)
    j = Journal(tmp_path, RUN, 4, durable_every=2)
    for step in range(4):
        j.begin(step)
        j.commit(StepCommit(step, 1.0, 0.0, 0, 3.0, ("a",)))
    j.close(4)
    assert [(s["step"], s.get("open")) for s in synced] == [(0, 0), (2, 2), (4, None)]


def test_stages_ahead_of_a_lagging_journal_are_not_run_again(caplog):
    """A position written every N steps (an older trainer's) or records lost to a power cut: the stages applied
    steps the journal does not know of; the run goes on after the stages' last one."""
    driver = FakeDriver({})
    status = [SimpleNamespace(step_open=False, peer_id=p, steps_done=31, last_step=30) for p in "ab"]
    driver.replica_status = lambda: [status]
    said = []
    assert settle(driver, (20, None, None), said.append).next_step == 31 and "applied step 31 already" in said[0]
    status[1].last_step = 29  # applied on only some stages: named (nothing can make it whole)
    assert settle(driver, (20, None, None)).next_step == 31 and "different last steps" in caplog.text
    restored = [SimpleNamespace(step_open=False, peer_id="a", steps_done=31, last_step=0)]  # from a checkpoint
    driver.replica_status = lambda: [restored]
    assert settle(driver, (0, None, None)).next_step == 0
