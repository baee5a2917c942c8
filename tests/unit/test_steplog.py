"""The trainer's step log: rows on disk as they come, steps.csv with every column any row had."""

import csv

from swarm.train.steplog import StepLog

FIELDS = ["step", "train_loss", "step_s", "forward_bytes", "backward_bytes", "fp32_wire_bytes", "sync_bytes"]


def _row(step: int, **extra) -> dict:
    return {"step": step, "train_loss": 5.0 - step, "step_s": 0.5, "forward_bytes": 10, "backward_bytes": 5,
            "fp32_wire_bytes": 100, "sync_bytes": 7, **extra}  # fmt: skip


def test_columns_that_appear_late_get_zeros_before_and_totals_add_up(tmp_path):
    log = StepLog(tmp_path, FIELDS)
    log.add(_row(1, link0_bytes=3))
    log.add(_row(2, link0_bytes=4, **{"swarm_aqsgd_buffer_misses_total{link=0}": 2}))
    assert log.wire_bytes == 30 and log.totals["sync_bytes"] == 14 and list(log.losses) == [4.0, 3.0]
    path = log.close()
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert rows[0]["swarm_aqsgd_buffer_misses_total{link=0}"] == "0"
    assert rows[1]["swarm_aqsgd_buffer_misses_total{link=0}"] == "2"
    assert list(rows[0])[: len(FIELDS)] == FIELDS and not (tmp_path / "steps.jsonl").exists()


def test_a_trainer_position_round_trips_and_another_runs_is_refused_by_name(tmp_path):
    import pytest

    from swarm.train.steplog import load_position, save_position

    run = {"seed": 0, "batch_size": 8, "train_samples": 64}
    assert load_position(tmp_path, run) is None
    save_position(tmp_path, 12, 1, 4, run)
    assert load_position(tmp_path, run) == (12, 1, 4)
    with pytest.raises(ValueError, match="another run's: batch_size 8 \\(now 16\\)"):
        load_position(tmp_path, {**run, "batch_size": 16})
    (tmp_path / "trainer_state.json").write_text('{"format": "swarm-trainer/1", "step": -1, "epoch": 0, "batch": 0}')
    with pytest.raises(ValueError, match="integers"):
        load_position(tmp_path, {})
    (tmp_path / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable"):
        load_position(tmp_path, run)


def test_total_bytes_columns_add_up_and_the_summary_prints_prediction_and_totals(tmp_path):
    from swarm.train.trainer import CSV_FIELDS, TrainSummary, format_summary

    assert {
        "tied_bytes",
        "sync_bytes",
        "control_bytes",
        "total_wire_bytes",
        "fp32_total_wire_bytes",
        "skipped",
        "loss_scale",
    } <= set(CSV_FIELDS)
    log = StepLog(tmp_path, FIELDS)
    log.add(_row(1, control_bytes=3, total_wire_bytes=25, fp32_total_wire_bytes=110))
    log.add(_row(2, control_bytes=3, total_wire_bytes=25, fp32_total_wire_bytes=110))
    assert (log.totals["control_bytes"], log.totals["total_wire_bytes"], log.totals["fp32_total_wire_bytes"]) == (
        6, 50, 220
    )  # fmt: skip
    log.close()
    common = dict(
        final_loss=1.0, first_loss=2.0, steps=2, wire_bytes=30, fp32_wire_bytes=200, sync_bytes=14, mean_step_s=0.5,
        seconds=1.0, stages=2, route=["a", "b"], plan_version=0, replans=0, csv="x", plot=None,
        total_wire_bytes=50, fp32_total_wire_bytes=220, total_ratio_vs_fp32=4.4,
    )  # fmt: skip
    text = format_summary(TrainSummary(**common, predicted_step_s=0.42))
    assert "predicted 0.42 s/step, measured 0.50 s/step (prediction -16.0%)" in text and "(4.4x)" in text
    assert "predicted no prediction (even split), measured 0.50" in format_summary(TrainSummary(**common))


def test_swarm_train_and_the_convergence_experiment_record_one_step_row():
    """The row is made in one place: the trainer's steps.csv has every column of it, and a `StepResult`'s
    figures land in it unchanged (the convergence experiment's losses.csv is these rows)."""
    from swarm.runtime.results import StepResult
    from swarm.runtime.routing import Traffic
    from swarm.train.steplog import step_row
    from swarm.train.trainer import CSV_FIELDS

    traffic = Traffic(sent={(0, "forward"): 5, (0, "backward"): 3})
    r = StepResult(loss=2.5, grad_norm=0.75, lr=1e-3, traffic=traffic, seconds=0.1, sync_bytes=7, control_bytes=11,
                   total_wire_bytes=40, fp32_total_wire_bytes=90, reduce_bytes=13)  # fmt: skip
    row = step_row(r, 3, 1)
    assert list(row) == ["step", "epoch", "train_loss", "lr", "grad_norm", "forward_bytes", "backward_bytes",
                         "sync_bytes", "reduce_bytes", "control_bytes", "total_wire_bytes",
                         "fp32_total_wire_bytes"]  # fmt: skip
    assert (row["step"], row["epoch"], row["train_loss"], row["grad_norm"], row["lr"]) == (3, 1, 2.5, 0.75, 1e-3)
    assert (row["forward_bytes"], row["backward_bytes"]) == (traffic.forward_bytes, traffic.backward_bytes)
    assert (row["sync_bytes"], row["control_bytes"], row["total_wire_bytes"], row["fp32_total_wire_bytes"]) == (
        7, 11, 40, 90)  # fmt: skip
    assert row["reduce_bytes"] == 13
    assert set(row) <= set(CSV_FIELDS)


def test_a_position_the_disk_refuses_is_logged_keeps_the_previous_one_and_leaves_no_tmp(tmp_path, monkeypatch, caplog):
    import errno
    import logging

    from swarm.train import steplog
    from swarm.train.steplog import load_position, save_position

    run = {"seed": 0, "batch_size": 8, "train_samples": 64}
    assert save_position(tmp_path, 12, 1, 4, run)
    real_open = open

    class FullFile:  # writes half, then the disk is full
        def __init__(self, path, mode="r"):
            self.f = real_open(path, mode)

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(steplog, "open", FullFile, raising=False)
    with caplog.at_level(logging.ERROR, logger="swarm.train.steplog"):
        assert save_position(tmp_path, 13, 1, 5, run) is False
    text = caplog.text
    assert str(tmp_path / "trainer_state.json") in text and "No space left" in text and "the disk mounted at" in text
    assert load_position(tmp_path, run) == (12, 1, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer_state.json"]


def test_on_a_really_full_disk_the_position_is_refused_and_the_previous_one_kept(tmp_path):
    from swarm.train.steplog import load_position, save_position
    from tests.unit.full_disk import fill, tiny_disk

    run = {"seed": 0, "batch_size": 8, "train_samples": 64}
    with tiny_disk(tmp_path) as disk:
        assert save_position(disk, 12, 1, 4, run)
        fill(disk)
        assert save_position(disk, 13, 1, 5, run) is False  # ENOSPC: no exception, the run goes on
        assert load_position(disk, run) == (12, 1, 4)
        assert not (disk / "trainer_state.json.tmp").exists()
