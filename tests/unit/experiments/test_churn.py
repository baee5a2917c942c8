"""The churn experiment's pure parts: the seeded schedule, sample accounting, recovery times, rows, report."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import threading
from pathlib import Path

import pytest

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
from swarm.experiments.churn import (
    KILL_EVERY_STEPS,
    QUICK_KILL_AT_S,
    ChurnConfig,
    ChurnRun,
    add_arguments,
    config_from_args,
    swarm_flags,
)
from swarm.experiments.churn_report import (
    ROW_KEYS,
    account_samples,
    completion_times,
    read_jsonl,
    read_steps,
    recovery_times,
    report_markdown,
    summarize,
    targets,
)
from swarm.flags import Flags
from swarm.testbed.churn_control import ChurnEvent, churn_schedule, churn_schedule_steps

EXPECTED = [(3, 1), (0, 2), (1, 0), (2, 3)]  # 4 steps of 2 samples (ids repeat across epochs)


def _rows(ids_per_step, t0=1000.0, dt=1.0, loss=2.0, time_column=True):
    rows = []
    for k, ids in ids_per_step:
        row = {"step": str(k), "train_loss": str(loss), "forward_bytes": "10", "backward_bytes": "5"}
        row["sample_ids"] = " ".join(map(str, ids))
        if time_column:
            row["time"] = str(t0 + dt * len(rows))
        rows.append(row)
    return rows


# --- schedule ---


def test_schedule_is_seeded_and_deterministic():
    a = churn_schedule(600, seed=7, mean_lifetime_s=120, serving_peers=6, graceful_fraction=0.5)
    b = churn_schedule(600, seed=7, mean_lifetime_s=120, serving_peers=6, graceful_fraction=0.5)
    c = churn_schedule(600, seed=8, mean_lifetime_s=120, serving_peers=6, graceful_fraction=0.5)
    assert a == b
    assert a != c
    assert [x.at_s for x in a] == sorted(x.at_s for x in a)


def test_kill_every_gives_regular_leaves_each_followed_by_a_join():
    actions = churn_schedule(185, seed=0, kill_every_s=60, join_delay_s=2)
    leaves = [a for a in actions if a.kind != "join"]
    joins = [a for a in actions if a.kind == "join"]
    assert [a.at_s for a in leaves] == [60, 120, 180]
    assert [a.at_s for a in joins] == [62, 122, 182]
    assert all(a.kind == "kill" for a in leaves)  # graceful_fraction 0: SIGKILL only


def test_graceful_fraction_one_makes_every_leave_a_term():
    actions = churn_schedule(300, seed=3, kill_every_s=30, graceful_fraction=1.0)
    assert {a.kind for a in actions} == {"term", "join"}


def test_mean_lifetime_rate_matches_the_poisson_process():
    # 6 peers, mean lifetime 60 s: a leave every 10 s on average
    actions = churn_schedule(20_000, seed=1, mean_lifetime_s=60, serving_peers=6)
    leaves = sum(1 for a in actions if a.kind != "join")
    assert 1800 < leaves < 2200


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"kill_every_s": 10, "mean_lifetime_s": 10},
        {"kill_every_s": 0},
        {"kill_every_s": 10, "graceful_fraction": 1.5},
    ],
)
def test_schedule_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        churn_schedule(100, seed=0, **kwargs)


def test_churn_event_validates_and_prints_compactly():
    assert str(ChurnEvent(60.0, "kill", 0.25)) == "kill@60.0#0.25"
    with pytest.raises(ValueError):
        ChurnEvent(1.0, "explode")
    with pytest.raises(ValueError):
        ChurnEvent(1.0, "kill", 1.0)


# --- sample accounting ---


def test_every_sample_once_is_zero_lost_and_zero_duplicated():
    account = account_samples(_rows(enumerate(EXPECTED, start=1)), EXPECTED)
    assert (account.lost, account.duplicated, account.unexpected) == (0, 0, 0)


def test_a_step_applied_twice_counts_its_samples_as_duplicated():
    rows = _rows([(1, EXPECTED[0]), (2, EXPECTED[1]), (2, EXPECTED[1]), (3, EXPECTED[2]), (4, EXPECTED[3])])
    account = account_samples(rows, EXPECTED)
    assert (account.lost, account.duplicated) == (0, 2)


def test_a_dropped_sample_and_a_missing_step_count_as_lost():
    rows = _rows([(1, EXPECTED[0]), (2, EXPECTED[1][:1]), (3, EXPECTED[2])])  # step 2 lost a sample, step 4 gone
    account = account_samples(rows, EXPECTED)
    assert (account.lost, account.duplicated) == (3, 0)


def test_a_sample_trained_in_another_steps_place_is_unexpected():
    rows = _rows([(1, (3, 2)), (2, EXPECTED[1]), (3, EXPECTED[2]), (4, EXPECTED[3])])
    account = account_samples(rows, EXPECTED)
    assert (account.lost, account.duplicated, account.unexpected) == (1, 0, 1)


def test_without_a_sample_ids_column_accounting_is_not_measured_not_zero():
    rows = [{k: v for k, v in r.items() if k != "sample_ids"} for r in _rows(enumerate(EXPECTED, start=1))]
    account = account_samples(rows, EXPECTED)
    assert not account.measured
    assert account.lost is None and account.duplicated is None
    assert "not measured" in account.why


def test_expected_batches_follow_the_trainers_data_order():
    from swarm.experiments.churn_report import expected_batches
    from swarm.model.data import DataConfig, build_datasets, epoch_batches

    got = expected_batches(5, batch_size=4, train_samples=8, seed=3, seq_len_tokens=16)
    train, _, _ = build_datasets(DataConfig(seq_len_tokens=16, train_samples=8, eval_samples=0))
    want = [tuple(b.sample_ids.tolist()) for e in range(3) for b in epoch_batches(train, 4, e, 3)][:5]
    assert got == want
    assert sorted(got[0] + got[1]) == list(range(8))  # one epoch: every sample once


# --- recovery and completion times ---


def test_recovery_is_kill_to_next_completed_step():
    assert recovery_times([10.0, 20.5, 99.0], [9.0, 11.5, 12.0, 25.0]) == [1.5, 4.5, None]


def test_completion_times_come_from_the_step_clock_without_a_time_column():
    rows = _rows(enumerate(EXPECTED, start=1), time_column=False)
    clock = [{"t": 5.0, "steps": 1}, {"t": 7.0, "steps": 3}, {"t": 8.0, "steps": 4}]
    assert completion_times(rows, clock) == [5.0, 7.0, 7.0, 8.0]
    assert completion_times(rows, clock[:1]) == [5.0, None, None, None]


def test_completion_times_prefer_the_rows_time_column():
    rows = _rows(enumerate(EXPECTED, start=1), t0=100.0, dt=2.0)
    assert completion_times(rows, [{"t": 1.0, "steps": 4}]) == [100.0, 102.0, 104.0, 106.0]


# --- rows, targets, report from files ---


def _write_setting(d: Path, rows: list[dict], events: list[dict]) -> None:
    d.mkdir(parents=True)
    with open(d / "steps.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_rows_and_targets_from_synthetic_files(tmp_path):
    base_rows = _rows(enumerate(EXPECTED, start=1), t0=1000.0, dt=1.0, loss=2.0)
    # churn: a kill at 1001.5 (a replica survived) -> next step at 1003.0 (1.5 s); a kill of a stage's last
    # peer at 1003.2 -> next step at 1040.0 (36.8 s), so the takeover target fails
    churn_rows = _rows(enumerate(EXPECTED, start=1), t0=1000.0, dt=1.0, loss=2.1)
    churn_rows[2]["time"], churn_rows[3]["time"] = "1003.0", "1040.0"
    events = [
        {"t": 1001.5, "kind": "kill", "peer": "peer1", "stage": 0, "replicas_left": 1},
        {"t": 1003.2, "kind": "term", "peer": "peer2", "stage": 1, "replicas_left": 0},
        {"t": 1005.0, "kind": "join", "peer": "peer7", "stage": None},
    ]
    _write_setting(tmp_path / "no-churn", base_rows, [])
    _write_setting(tmp_path / "churn", churn_rows, events)
    rows = []
    for setting in ("no-churn", "churn"):
        d = tmp_path / setting
        steps, evs = read_steps(d / "steps.csv"), read_jsonl(d / "events.jsonl")
        rows.append(summarize(setting, steps, evs, [], EXPECTED, batch_size=2, target_steps=4))
    base, churn = rows
    assert list(churn)[: len(ROW_KEYS)] == ROW_KEYS
    assert (churn["kills"], churn["terms"], churn["joins"]) == (1, 1, 1)
    assert churn["recovery_s_median"] == pytest.approx((1.5 + 36.8) / 2)
    assert churn["recovery_s_max"] == pytest.approx(36.8)
    assert churn["recovery_s_median_replica"] == pytest.approx(1.5)
    assert churn["recovery_s_median_takeover"] == pytest.approx(36.8)
    assert base["throughput_samples_s"] == pytest.approx(3 * 2 / 3.0)
    assert churn["throughput_samples_s"] == pytest.approx(3 * 2 / 40.0)
    assert base["wire_bytes"] == 4 * 15
    assert (churn["samples_lost"], churn["samples_duplicated"]) == (0, 0)
    verdicts = {c.name: c.passed for c in targets(rows, kill_every_s=60)}
    assert verdicts["churn: zero samples lost or duplicated"] is True
    assert verdicts["churn: median recovery while a replica survives < 10 s"] is True
    assert verdicts["churn: median recovery via standby + checkpoint < 30 s"] is False
    assert verdicts["throughput with a kill every 60 s >= 70% of no-churn"] is False
    assert verdicts["final loss within 2% of no-churn"] is False  # 2.1 vs 2.0: 5%
    text = report_markdown(rows, targets(rows, 60), {"steps": 4}, ["loss_vs_step.png"])
    assert "| churn | 4 | 0 | 0 | 1 | 1 |" in text
    assert "FAIL" in text and "PASS" in text


def test_a_leave_with_no_step_after_it_is_unrecovered_and_fails(tmp_path):
    rows = _rows([(1, EXPECTED[0]), (2, EXPECTED[1])], t0=1000.0)  # the trainer died after step 2
    events = [{"t": 1001.5, "kind": "kill", "peer": "peer1", "stage": 0, "replicas_left": 0}]
    row = summarize("churn", rows, events, [], EXPECTED, batch_size=2, target_steps=4)
    assert row["unrecovered"] == 1 and row["recovery_s_max"] is None
    # steps 3 and 4 never trained: not run, not lost (issue 28: lost samples are judged over the steps trained)
    assert (row["samples_lost"], row["samples_not_run"]) == (0, 4)
    base = summarize("no-churn", _rows(enumerate(EXPECTED, start=1), t0=1000.0), [], [], EXPECTED, 2, 4)
    verdicts = {c.name: c.passed for c in targets([base, row], kill_every_s=60)}
    assert verdicts["churn: every leave recovered"] is False
    assert verdicts["churn: all steps trained"] is False
    # as fast as no-churn while it lasted, but the run ended: no throughput PASS for a dead run
    assert verdicts["throughput with a kill every 60 s >= 70% of no-churn"] is False


def test_missing_sample_ids_reported_as_not_measured_in_the_report():
    rows = [{k: v for k, v in r.items() if k != "sample_ids"} for r in _rows(enumerate(EXPECTED, start=1))]
    row = summarize("no-churn", rows, [], [], EXPECTED, batch_size=2, target_steps=4)
    assert row["samples_lost"] is None and row["samples_duplicated"] is None
    check = next(c for c in targets([row], None) if "lost" in c.name)
    assert check.passed is None and check.verdict == "not measured"
    assert "| not measured | not measured |" in report_markdown([row], [check], {}, [])


def test_plots_are_written_from_synthetic_files(tmp_path):
    from swarm.experiments.churn_plots import save_plots, throughput_series

    _write_setting(tmp_path / "churn", _rows(enumerate(EXPECTED, start=1)), [{"t": 1001.5, "kind": "kill"}])
    paths = save_plots(tmp_path, ["churn"], batch_size=2)
    assert [p.name for p in paths] == ["loss_vs_step.png", "loss_vs_time.png", "throughput.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    xs, ys = throughput_series([0.0, 1.0, 2.0], batch_size=4, window_s=10)
    assert xs == [0.0, 1.0, 2.0] and ys[2] == pytest.approx(3 * 4 / 2.0)


# --- configuration ---


def test_default_config_is_issue_12s_swarm_with_its_churn_in_steps():
    """Issue 28: the default schedule is in steps (was a kill every 60 s, which a slower machine hit more often)."""
    cfg = ChurnRun().config()
    assert (cfg.stages, cfg.replicas, cfg.standby, cfg.peers) == (3, 2, 1, 7)
    assert (cfg.fw_codec, cfg.bw_codec) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC)
    assert (cfg.kill_every_s, cfg.kill_every_steps, cfg.in_steps) == (None, KILL_EVERY_STEPS, True)
    assert cfg.setting_timeout_s is None, "no wall-clock cap by default: only a stall stops a run"
    seconds = ChurnRun(kill_every=60.0).config()
    assert (seconds.kill_every_s, seconds.kill_every_steps, seconds.in_steps) == (60.0, None, False)
    assert ChurnRun(mean_lifetime=90.0).config().kill_every_s is None
    assert ChurnRun(mean_lifetime_steps=90.0).config().mean_lifetime_steps == 90.0
    for both in ({"kill_every": 30.0, "mean_lifetime": 90.0}, {"kill_every": 30.0, "kill_every_steps": 100}):
        with pytest.raises(ValueError):
            ChurnRun(**both).config()
    with pytest.raises(ValueError, match="exactly one"):
        ChurnConfig(kill_every_s=60.0)  # and kill_every_steps by default: two schedules
    with pytest.raises(ValueError, match="> 0"):
        ChurnConfig(kill_every_steps=0)
    with pytest.raises(ValueError, match="stall"):
        ChurnConfig(stall_timeout_s=0)


def test_flags_give_the_run_and_round_trip(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--mean-lifetime", "90"])) == ChurnRun(mean_lifetime=90.0).config()
    run = ChurnRun(ChurnConfig(stages=2, setting_timeout_s=100.0, identities=Path("keys")), kill_every=7.0, quick=True)
    argv = Flags(ChurnRun).to_argv(run)
    assert "--timeout-s" in argv and "--identities" in argv and "--quick" in argv
    assert Flags(ChurnRun).parse(argv) == run
    path = tmp_path / "churn.toml"
    path.write_text("stages = 4\nkill-every = 30.0\nseed = 3\n")
    cfg = config_from_args(parser.parse_args(["--config", str(path), "--seed", "5"]))
    assert (cfg.stages, cfg.kill_every_s, cfg.seed) == (4, 30.0, 5)


def test_quick_schedules_exactly_one_leave():
    cfg = ChurnRun(quick=True, kill_every=QUICK_KILL_AT_S).config()
    assert cfg.kill_every_s == QUICK_KILL_AT_S and cfg.churn_horizon_s == QUICK_KILL_AT_S
    actions = churn_schedule(cfg.churn_horizon_s, cfg.seed, cfg.kill_every_s, None, 4, 0.0, cfg.join_delay_s)
    assert sum(1 for a in actions if a.kind != "join") == 1
    cfg = ChurnRun(quick=True).config()  # by default in steps: the one leave after step 10
    assert (cfg.kill_every_s, cfg.kill_every_steps, cfg.churn_horizon_steps) == (None, 10, 10)
    horizon = min(cfg.steps, cfg.churn_horizon_steps + 1)
    actions = churn_schedule_steps(horizon, cfg.seed, cfg.kill_every_steps, None, 4, 0.0, cfg.join_delay_s)
    assert [(a.kind, a.at_step) for a in actions] == [("kill", 10), ("join", 10)]


# --- judged by steps (issue 28: a machine half as fast saw 6 kills instead of 2-3 and was cut at step 307) ---


def test_a_schedule_in_steps_is_the_same_on_any_machine_and_ends_before_the_last_step():
    actions = churn_schedule_steps(400, seed=0, kill_every_steps=150, join_delay_s=2.0)
    assert [(a.kind, a.at_step, a.at_s) for a in actions] == [
        ("kill", 150, 0.0), ("join", 150, 2.0), ("kill", 300, 0.0), ("join", 300, 2.0),
    ]  # fmt: skip
    assert str(actions[1]) == "join@step150+2.0#0.00"
    assert churn_schedule_steps(300, seed=0, kill_every_steps=150)[-1].at_step == 150, "no leave at the last step"
    poisson = churn_schedule_steps(100_000, seed=1, mean_lifetime_steps=600, serving_peers=6)
    leaves = [a for a in poisson if a.kind != "join"]
    assert 900 < len(leaves) < 1100  # a leave every 100 steps on average
    assert all(b.at_step > a.at_step for a, b in zip(leaves, leaves[1:], strict=False)), "one leave per step"
    assert poisson == churn_schedule_steps(100_000, seed=1, mean_lifetime_steps=600, serving_peers=6)
    for bad in ({}, {"kill_every_steps": 0}, {"kill_every_steps": 5, "mean_lifetime_steps": 5}):
        with pytest.raises(ValueError):
            churn_schedule_steps(100, 0, **bad)
    with pytest.raises(ValueError, match="at_step"):
        ChurnEvent(0.0, "kill", at_step=0)


class _StepsSwarm:
    """The controller's view of a swarm: two serving peers, leaves and joins recorded."""

    def __init__(self):
        from types import SimpleNamespace

        proc = SimpleNamespace(pid=1, poll=lambda: None)
        self.peers = [SimpleNamespace(name=f"peer{i}", peer_id=f"id{i}", proc=proc, left=None) for i in range(2)]
        self.done: list[tuple[str, str]] = []

    def stages(self):
        return {p.peer_id: i for i, p in enumerate(self.peers)}

    def live_peers(self):
        return [p for p in self.peers if p.left is None]

    def leave(self, peer, kind):
        peer.left = kind
        self.done.append((kind, peer.name))

    def start_peer(self):
        from types import SimpleNamespace

        peer = SimpleNamespace(name="peer9", peer_id="id9", proc=SimpleNamespace(pid=9, poll=lambda: None), left=None)
        self.done.append(("join", peer.name))
        return peer


def test_the_controller_plays_a_step_schedule_against_the_trainers_steps_however_slow(tmp_path):
    from swarm.testbed.churn_control import ChurnController

    step = [0]
    seen = threading.Event()

    def steps():
        seen.set()
        return step[0] or None

    swarm = _StepsSwarm()
    schedule = churn_schedule_steps(400, seed=0, kill_every_steps=150, join_delay_s=0.0)
    controller = ChurnController(swarm, schedule, tmp_path / "events.jsonl", steps=steps, poll_s=0.01)
    controller.start()
    controller.begin()
    for at in (10, 149):  # however long the steps take, nothing happens before step 150
        step[0] = at
        seen.clear()
        assert seen.wait(5) and seen.wait(5)
        seen.clear()
        assert seen.wait(5)
        assert swarm.done == []
    step[0] = 150
    deadline = threading.Event()
    for _ in range(500):
        if len(swarm.done) == 2:
            break
        deadline.wait(0.01)  # polling the fake swarm for the controller's actions, bounded
    assert [k for k, _ in swarm.done] == ["kill", "join"]
    controller.stop.set()
    controller.join(5)
    assert not controller.is_alive(), "the controller ends when the run ends, before step 300"
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["kind"] for e in events] == ["kill", "join"] and events[0]["action"].startswith("kill@step150")


class _Trainer:
    """A `Popen` stand-in that exits after `exit_after` polls (None: never)."""

    def __init__(self, exit_after=None):
        self.exit_after, self.polls = exit_after, 0

    def wait(self, timeout=None):
        import subprocess

        self.polls += 1
        threading.Event().wait(timeout)  # blocks like Popen.wait
        if self.exit_after is not None and self.polls >= self.exit_after:
            return 0
        raise subprocess.TimeoutExpired("swarm train", timeout)


def test_a_slow_run_is_waited_for_and_only_a_stalled_one_is_stopped():
    from swarm.experiments.churn import wait_for_steps

    progress = itertools.count(1)
    slow = _Trainer(exit_after=50)  # 50 polls, a new step each: slow but moving, never stopped
    assert wait_for_steps(slow, lambda: (next(progress), 0.0), stall_timeout_s=0.05, poll_s=0.002) == 0
    with pytest.raises(TimeoutError, match="no step completed"):
        wait_for_steps(_Trainer(), lambda: (7, 0.0), stall_timeout_s=0.05, poll_s=0.002)
    with pytest.raises(TimeoutError, match="no step completed"):
        wait_for_steps(_Trainer(), lambda: None, stall_timeout_s=0.05, poll_s=0.002)  # never a first step
    progress = itertools.count(1)
    with pytest.raises(TimeoutError, match="--timeout-s"):
        wait_for_steps(_Trainer(), lambda: (next(progress), 0.0), 10.0, timeout_s=0.05, poll_s=0.002)


def test_last_step_reads_the_clocks_last_complete_line(tmp_path):
    from swarm.testbed.churn_control import last_step

    path = tmp_path / "clock.jsonl"
    assert last_step(path) is None
    path.write_text("")
    assert last_step(path) is None
    path.write_text('{"t": 1.0, "steps": 1}\n{"t": 2.0, "steps": 2}\n{"t": 3.0, "st')  # a line being written
    assert last_step(path) == (2, 2.0)


def test_an_unfinished_run_counts_its_unrun_steps_apart_from_lost_samples():
    rows = _rows([(1, [3, 1]), (2, [0, 2])])
    row = summarize("churn", rows, [], [], EXPECTED, 2, target_steps=4)
    assert (row["samples_lost"], row["samples_not_run"]) == (0, 4)
    checks = {c.name: (c.value, c.passed) for c in targets([row], schedule="a kill every 150 steps")}
    assert checks["churn: all steps trained"] == ("2 of 4 (4 samples not run)", False)


def test_a_setting_ended_on_purpose_is_judged_on_the_steps_up_to_its_end():
    """`steps_after_churn`: the trainer asked to stop after step 2 trains the step in flight (3), and the
    setting is judged up to there: nothing lost, nothing "not run", the steps target met."""
    rows = _rows(enumerate(EXPECTED[:3], start=1))
    row = summarize("churn", rows, [], [], EXPECTED, 2, target_steps=2)
    assert (row["samples_lost"], row["samples_duplicated"], row["samples_not_run"]) == (0, 0, 0)
    assert not [c for c in targets([row]) if c.name == "churn: all steps trained"]
    # one that stopped short of its end all the same is not finished, and step 4 is outside its span
    short = summarize("churn", rows[:1], [], [], EXPECTED, 2, target_steps=2)
    assert (short["samples_lost"], short["samples_not_run"]) == (0, 2)
    # a sample dropped before the end is still lost
    rows[1]["sample_ids"] = "0"
    assert summarize("churn", rows, [], [], EXPECTED, 2, target_steps=2)["samples_lost"] == 1


class _Signalled(_Trainer):
    def __init__(self):
        super().__init__()
        self.signals = []

    def send_signal(self, sig):
        self.signals.append(sig)


def test_the_end_after_churn_waits_for_the_schedule_then_its_steps_and_asks_the_trainer_once(tmp_path):
    import signal

    from swarm.testbed.churn_control import ChurnController

    step, seen = [12], threading.Event()

    def steps():
        seen.set()
        return step[0]

    def polled():  # two full polls of the step count seen since the change
        for _ in range(2):
            seen.clear()
            assert seen.wait(5)

    swarm = _StepsSwarm()
    swarm.trainer = trainer = _Signalled()
    schedule = [ChurnEvent(0.0, "join", at_step=15)]
    path = tmp_path / "events.jsonl"
    controller = ChurnController(swarm, schedule, path, steps=steps, poll_s=0.01, end_after=3)
    controller.start()
    controller.begin()
    polled()  # the schedule is still playing (its join waits for step 15): no count yet
    assert swarm.done == [] and trainer.signals == []
    step[0] = 20
    polled()  # played: the count starts at 20
    step[0] = 22
    polled()
    assert swarm.done == [("join", "peer9")] and trainer.signals == []
    assert [e["kind"] for e in read_jsonl(path)] == ["join"]
    step[0] = 23
    controller.join(5)
    assert not controller.is_alive(), "asked once, the controller's work is done"
    assert trainer.signals == [signal.SIGTERM]
    assert [(e["kind"], e.get("at_step")) for e in read_jsonl(path)][1:] == [("end", 23)]


def test_quick_ends_its_churn_setting_after_the_join_and_the_full_run_trains_every_step():
    assert ChurnRun(quick=True).config().steps_after_churn == 10
    assert ChurnConfig().steps_after_churn is None and ChurnRun().config().steps_after_churn is None


def test_replicas_flag_passed_only_when_the_peer_has_it():
    cfg = ChurnConfig()
    peer, trainer = swarm_flags(cfg, "churn", {"--replicas": False})
    assert "--replicas" not in peer and "--min-peers" in peer and peer[peer.index("--min-peers") + 1] == "7"
    peer, _ = swarm_flags(cfg, "churn", {"--replicas": True})
    assert peer[peer.index("--replicas") + 1] == "2"
    assert trainer[trainer.index("--seed") + 1] == "0"


# --- the namespace placement, as data (no root needed) ---


def test_netns_placement_runs_each_process_in_its_own_namespace_on_its_address(tmp_path):
    from swarm.testbed.churn_netns import NetnsPlacement

    place = NetnsPlacement(tmp_path, max_peers=3)
    argv = place.wrap("peer2", ["python", "-m", "swarm.daemon.peer", "--num-stages", "2"])
    assert argv[:4] == ["ip", "netns", "exec", "swc-peer2"]
    assert argv[-2:] == ["--host", "10.79.0.12"]
    assert place.wrap("clock", ["python"]) == ["ip", "netns", "exec", "swc-trainer", "python"]
    with pytest.raises(RuntimeError, match="no namespace left for peer3"):
        place.wrap("peer3", ["python"])


def test_reroute_columns_counted_when_the_trainer_writes_them():
    rows = _rows(enumerate(EXPECTED, start=1))
    for r, attempts, dead in zip(rows, (1, 2, 1, 3), ("0", "abc", "0", "abc def"), strict=True):
        r["attempts"], r["dead_peers"] = str(attempts), dead
    row = summarize("churn", rows, [], [], EXPECTED, batch_size=2, target_steps=4)
    assert (row["retried_steps"], row["dead_peers"]) == (2, 2)
    plain = summarize("churn", _rows(enumerate(EXPECTED, start=1)), [], [], EXPECTED, batch_size=2, target_steps=4)
    assert plain["retried_steps"] is None and plain["dead_peers"] is None


# --- the controller's choices, against a fake swarm (no processes) ---


class _Proc:
    def __init__(self, pid):
        self.pid = pid

    def poll(self):
        return None


class _FakeSwarm:
    def __init__(self, stages):
        from swarm.testbed.churn_control import PeerProc

        self.peers = {f"peer{i}": PeerProc(f"peer{i}", f"id{i}", _Proc(100 + i)) for i in range(len(stages))}
        self._stages = {f"id{i}": s for i, s in enumerate(stages)}
        self.left = []

    def stages(self):
        return dict(self._stages)

    def live_peers(self):
        return [p for p in self.peers.values() if p.left is None]

    def leave(self, peer, kind):
        peer.left = kind
        self.left.append((peer.name, kind))

    def start_peer(self):
        from swarm.testbed.churn_control import PeerProc

        name = f"peer{len(self.peers)}"
        self.peers[name] = PeerProc(name, f"id{len(self.peers)}", _Proc(200))
        return self.peers[name]


def test_controller_leaves_only_serving_peers_and_names_the_stage_and_survivors(tmp_path):
    from swarm.testbed.churn_control import ChurnController

    swarm = _FakeSwarm([0, 0, 1, None])  # peer3 is on standby
    controller = ChurnController(swarm, [], tmp_path / "events.jsonl")
    first = controller.apply(ChurnEvent(1.0, "kill", 0.0))  # serving by name: peer0, peer1, peer2
    assert (first["peer"], first["stage"], first["replicas_left"], first["pid"]) == ("peer0", 0, 1, 100)
    second = controller.apply(ChurnEvent(2.0, "term", 0.99))
    assert (second["peer"], second["kind"], second["replicas_left"]) == ("peer2", "term", 0)
    third = controller.apply(ChurnEvent(3.0, "kill", 0.0))
    assert third["peer"] == "peer1" and third["replicas_left"] == 0
    assert controller.apply(ChurnEvent(4.0, "kill", 0.5))["kind"] == "skip"  # only the standby is left
    assert [name for name, _ in swarm.left] == ["peer0", "peer2", "peer1"]  # never the standby
    join = controller.apply(ChurnEvent(5.0, "join"))
    assert join["kind"] == "join" and join["peer"] == "peer4" and join["pid"] == 200


def test_controller_plays_its_schedule_from_begin_and_logs_each_action(tmp_path):
    from swarm.testbed.churn_control import ChurnController

    swarm = _FakeSwarm([0, 0])
    path = tmp_path / "events.jsonl"
    controller = ChurnController(swarm, [ChurnEvent(0.0, "kill", 0.0), ChurnEvent(0.0, "join")], path)
    controller.start()
    controller.begin()
    controller.join(10)
    assert not controller.is_alive()
    assert [e["kind"] for e in read_jsonl(path)] == ["kill", "join"]


def test_a_stopped_controller_acts_no_more(tmp_path):
    from swarm.testbed.churn_control import ChurnController

    swarm = _FakeSwarm([0, 0])
    controller = ChurnController(swarm, [ChurnEvent(3600.0, "kill", 0.0)], tmp_path / "events.jsonl")
    controller.start()
    controller.begin()
    controller.stop.set()
    controller.join(10)
    assert not controller.is_alive() and swarm.left == []
