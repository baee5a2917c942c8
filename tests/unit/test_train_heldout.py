"""`swarm train`'s held-out evaluation (`swarm.train.heldout`) in process: when it runs, where each result goes
(steps.csv, the summary, the gauge, the plot), and a failed evaluation skipped while training goes on."""

import csv
import json
import logging
import math

import pytest
import torch

import swarm.train.trainer as trainer
from swarm.metrics import Metrics
from swarm.model.data import HELD_OUT_FIRST_ID, DataConfig, SampleSet, build_datasets
from swarm.model.gpt import ModelConfig
from swarm.net.stream import StageCallError
from swarm.peers.routes import PlanRoutes
from swarm.runtime.inprocess import LocalPipeline
from swarm.train.heldout import HeldOut
from swarm.train.trainer import TrainConfig, train

torch.set_num_threads(1)

TINY = ModelConfig(seq_len_tokens=16, hidden_dim=32, n_layers=2, n_heads=4, init_seed=3)


def _config(tmp_path, **kw) -> TrainConfig:
    base = dict(model=TINY, train_samples=16, batch_size=4, micro_batches=2, steps=5, eval_every=2, eval_samples=6)
    return TrainConfig(**{**base, **kw}, out=str(tmp_path))


def _train_locally(cfg: TrainConfig, monkeypatch, wrap=lambda driver: driver, stage_cfg=None):
    """`train` over an in-process pipeline (the swarm's runtime in one process) instead of gRPC stages."""
    local = LocalPipeline(cfg.model, 2, stage_cfg=stage_cfg)
    monkeypatch.setattr(
        trainer,
        "driver_factory",
        lambda freeze, n_layers: lambda r, schedule, n_micro, **kw: wrap(local.driver(n_micro)),
    )
    metrics = Metrics()
    route = PlanRoutes(local.addresses, [row[0] for row in local.replica_peers])
    try:
        return train(cfg, route, quiet=True, metrics=metrics), metrics, local
    finally:
        local.close()


def _rows(summary) -> list[dict]:
    with open(summary.csv) as f:
        return list(csv.DictReader(f))


def test_train_evaluates_every_n_steps_and_after_the_last(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    summary, metrics, local = _train_locally(cfg, monkeypatch)
    rows = _rows(summary)
    held = {int(r["step"]): r["held_out_loss"] for r in rows}
    assert [s for s, v in held.items() if v] == [2, 4, 5]  # every 2 steps, and after the last
    assert all(v == "" for s, v in held.items() if s not in (2, 4, 5))
    # the summary holds the final evaluation, of the weights the run ended with
    assert summary.held_out_step == 5 and summary.held_out_samples == 6 and summary.held_out_bytes > 0
    assert summary.held_out_loss == pytest.approx(float(held[5]), rel=1e-12)
    assert metrics.held_out_loss._value.get() == pytest.approx(summary.held_out_loss, rel=1e-12)
    _, evals, report = build_datasets(DataConfig(seq_len_tokens=16, train_samples=16, eval_samples=6))
    assert summary.held_out_loss == pytest.approx(local.evaluate(evals, 4), rel=1e-5)  # exact forward, same windows
    assert summary.held_out_first_id == int(evals.ids[0]) == HELD_OUT_FIRST_ID  # the held-out files' first window
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["held_out_loss"] == summary.held_out_loss
    # which text the run trained on: the corpus's digest and its windows'
    assert (saved["corpus_digest"], saved["windows_digest"]) == (report.corpus_digest, report.windows_digest)
    assert len(report.corpus_digest) == len(report.windows_digest) == 64
    assert "held-out" in trainer.format_summary(summary)
    assert (tmp_path / "loss.png").exists()


def test_eval_samples_zero_turns_evaluation_off(tmp_path, monkeypatch):
    summary, _, _ = _train_locally(_config(tmp_path, eval_samples=0, steps=2), monkeypatch)
    assert summary.held_out_loss is None and summary.held_out_step is None and summary.held_out_samples == 0
    assert summary.held_out_first_id is None
    assert all(r["held_out_loss"] == "" for r in _rows(summary))
    assert "held-out" not in trainer.format_summary(summary)


class _FailingEvaluations:
    """A driver whose evaluations fail as a dead peer's would (the steps themselves run)."""

    def __init__(self, driver):
        self.driver = driver

    def __getattr__(self, name):
        return getattr(self.driver, name)

    def evaluate(self, *args, **kwargs):
        raise StageCallError("stage 1 (peer p at a): unreachable or too slow (UNAVAILABLE): gone")


def test_a_failed_evaluation_is_skipped_and_training_goes_on(tmp_path, monkeypatch, caplog):
    summary, _, _ = _train_locally(_config(tmp_path, steps=3), monkeypatch, wrap=_FailingEvaluations)
    assert summary.steps == 3 and summary.held_out_loss is None
    assert "held-out evaluation after step 2 skipped" in caplog.text


def test_the_schedule_of_evaluations():
    data = build_datasets(DataConfig(seq_len_tokens=8, train_samples=4, eval_samples=2))[1]
    held = HeldOut(data, every=3, rows=2, hidden=32, metrics=Metrics())
    assert [d for d in range(8) if held.due(d, 7)] == [3, 6, 7]
    only_end = HeldOut(data, every=0, rows=2, hidden=32, metrics=Metrics())
    assert [d for d in range(8) if only_end.due(d, 7)] == [7]
    off = HeldOut(SampleSet(data.ids[:0], data.windows[:0]), every=3, rows=2, hidden=32, metrics=Metrics())
    assert not off.on and not any(off.due(d, 7) for d in range(8))
    assert off.summary()["held_out_loss"] is None


@pytest.mark.parametrize("field, value", [("eval_every", -1), ("eval_samples", -2)])
def test_negative_evaluation_settings_are_refused(field, value):
    with pytest.raises(ValueError, match="eval_every and eval_samples"):
        TrainConfig(**{field: value})


def test_the_eval_flags_are_in_train_help():
    import argparse

    parser = argparse.ArgumentParser()
    trainer.add_arguments(parser)
    text = parser.format_help()
    assert "--eval-every" in text and "--eval-samples" in text
    assert math.isfinite(TrainConfig().eval_every)


def test_the_prediction_is_compared_with_the_median_step_and_the_spread_is_shown():
    """A loaded machine's slow steps move the mean, not the median: the summary compares the plan's prediction
    with the median and shows the 10-90% spread of the step times."""
    from swarm.train.summary_text import step_time_spread
    from swarm.train.trainer import TrainSummary

    times = [0.5] * 8 + [5.0, 9.0]  # two steps slowed down by other work on the machine
    spread = step_time_spread(times)
    assert spread == {"median_step_s": 0.5, "step_s_p10": 0.5, "step_s_p90": 5.0}
    assert step_time_spread([]) == {"median_step_s": 0.0, "step_s_p10": 0.0, "step_s_p90": 0.0}
    summary = TrainSummary(
        final_loss=1.0, first_loss=2.0, steps=10, wire_bytes=1, fp32_wire_bytes=1, sync_bytes=0,
        mean_step_s=sum(times) / len(times), seconds=20.0, stages=2, route=["a", "b"], plan_version=2, replans=1,
        csv="x", plot=None, predicted_step_s=0.45, **spread,
    )  # fmt: skip
    text = trainer.format_summary(summary)
    assert "measured median 0.50 s/step (10-90%: 0.50-5.00) (prediction -10.0%)" in text


def test_train_says_when_the_stages_schedule_does_not_end_where_it_stops(tmp_path, monkeypatch, caplog):
    from swarm.runtime.worker import OptimConfig, StageConfig

    stages = StageConfig(optim=OptimConfig(warmup_steps=1, total_steps=1000))  # a hand-started swarm's default
    _train_locally(_config(tmp_path, steps=4, eval_samples=0), monkeypatch, stage_cfg=stages)
    assert "schedule ends near step 1000, but this run trains 4 steps" in caplog.text
    caplog.clear()
    stages = StageConfig(optim=OptimConfig(warmup_steps=1, total_steps=4))  # as swarm demo tells its peers
    _train_locally(_config(tmp_path / "again", steps=4, eval_samples=0), monkeypatch, stage_cfg=stages)
    assert "schedule" not in caplog.text


def test_an_evaluation_refused_as_of_an_older_plan_runs_again_on_the_newer_one():
    """The demo's planner republished plan 2 between step 20 and its evaluation: the stages refused plan 1's
    call (plan-mismatch) and the evaluation at step 20 was skipped. It follows the plan and evaluates there."""
    from types import SimpleNamespace

    from swarm.net.stream import PLAN_MISMATCH

    data = SampleSet(torch.arange(4), torch.zeros(4, 9, dtype=torch.long))
    held = HeldOut(data, every=20, rows=2, hidden=32, metrics=Metrics())

    class Old:
        def evaluate(self, *args):
            raise StageCallError(f"stage 0: {PLAN_MISMATCH} stage 0 of plan 1: this peer serves stage 0 of plan 2")

    new = SimpleNamespace(evaluate=lambda *args: SimpleNamespace(loss=2.5, bytes=10, seconds=0.1))
    followed = []
    assert held.run(Old(), 20, replan=lambda: followed.append(2) or new) == 2.5
    assert followed == [2] and [(p.step, p.loss) for p in held.points] == [(20, 2.5)]
    # another refusal is not a plan change: skipped, and no plan is followed
    other = SimpleNamespace(evaluate=lambda *a: (_ for _ in ()).throw(StageCallError("stage 0: UNAVAILABLE")))
    assert held.run(other, 40, replan=lambda: followed.append(3) or new) is None and followed == [2]


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _timed_driver(clock: _Clock, took_s: float, fail: bool = False):
    """A driver whose evaluation takes `took_s` on `clock` (and fails after it, with `fail`)."""
    from types import SimpleNamespace

    def evaluate(*args):
        clock.now += took_s
        if fail:
            raise StageCallError("stage 1: DEADLINE_EXCEEDED")
        return SimpleNamespace(loss=2.0, bytes=1, seconds=took_s)

    return SimpleNamespace(evaluate=evaluate)


def test_a_slow_evaluation_puts_the_next_periodic_ones_off_to_keep_its_share_and_the_last_always_runs(caplog):
    """At 1 Mbit/s an evaluation took ~57 s against ~1 s a step: every 20 steps it held the run three quarters of
    its time. With a share of 0.25 one that took 60 s waits for 180 s of training; the final one always runs."""
    caplog.set_level(logging.INFO, logger="swarm.train.heldout")
    data = SampleSet(torch.arange(4), torch.zeros(4, 9, dtype=torch.long))
    clock = _Clock()
    held = HeldOut(data, every=20, rows=2, hidden=32, metrics=Metrics(), max_share=0.25, clock=clock)
    slow = _timed_driver(clock, 60.0)
    evaluated = []
    for done in range(1, 401):
        clock.now += 1.0  # a step
        if held.due(done, 400):
            held.run(slow, done)
            evaluated.append(done)
    # 20 (then 180 s owed), 200 (180 steps later: the first multiple of 20 past it), 380, and the last
    assert evaluated == [20, 200, 380, 400], evaluated
    assert held.deferred == 8 + 8  # 40..180 and 220..360
    assert [p.step for p in held.points] == evaluated
    assert caplog.text.count("put off") == 2 and "after 180 s of training" in caplog.text
    assert held.summary()["held_out_deferred"] == 16  # the summary says so: swarm train logs no INFO
    # the evaluations' share of the run's time: 4 x 60 s of 640 s (the last one included), where one every 20 steps
    # would have been 20 x 60 s of 1,600 s
    assert 4 * 60 / (clock.now - 100.0) == pytest.approx(0.375)


def test_quick_evaluations_are_never_put_off_and_a_share_of_1_keeps_every_one():
    data = SampleSet(torch.arange(4), torch.zeros(4, 9, dtype=torch.long))
    for share, took in ((0.25, 4.9), (1.0, 60.0)):  # under DEFERRABLE_S (5 s), or no cap at all
        clock = _Clock()
        held = HeldOut(data, every=20, rows=2, hidden=32, metrics=Metrics(), max_share=share, clock=clock)
        driver = _timed_driver(clock, took)
        evaluated = []
        for done in range(1, 101):
            clock.now += 0.1  # quick steps: the evaluation is most of the time, yet runs every 20 steps
            if held.due(done, 100):
                held.run(driver, done)
                evaluated.append(done)
        assert evaluated == [20, 40, 60, 80, 100] and held.deferred == 0, (share, took)


def test_a_failed_evaluations_time_counts_too():
    """An evaluation that waited out a deadline and failed took the run's time all the same."""
    data = SampleSet(torch.arange(4), torch.zeros(4, 9, dtype=torch.long))
    clock = _Clock()
    held = HeldOut(data, every=20, rows=2, hidden=32, metrics=Metrics(), max_share=0.5, clock=clock)
    assert held.run(_timed_driver(clock, 30.0, fail=True), 20) is None and not held.points
    clock.now += 29.0
    assert held.wait_s() == pytest.approx(1.0) and not held.due(40, 100)
    clock.now += 1.0
    assert held.due(60, 100)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, math.nan])
def test_an_evaluation_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="eval_max_share"):
        TrainConfig(eval_max_share=share)
    data = SampleSet(torch.arange(4), torch.zeros(4, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="max_share"):
        HeldOut(data, every=20, rows=2, hidden=32, metrics=Metrics(), max_share=share)


def test_the_summary_says_how_many_evaluations_were_put_off():
    from swarm.train.trainer import TrainSummary

    base = dict(
        final_loss=1.0, first_loss=2.0, steps=64, wire_bytes=1, fp32_wire_bytes=1, sync_bytes=0, mean_step_s=0.9,
        seconds=174.0, stages=2, route=["a", "b"], plan_version=2, replans=0, csv="x", plot=None,
        held_out_loss=3.235, held_out_step=64, held_out_samples=48,
    )  # fmt: skip
    text = trainer.format_summary(TrainSummary(**base, held_out_deferred=2))
    assert "loss 3.235 on 48 windows after step 64 (2 periodic ones put off: --eval-max-share)" in text
    assert "put off" not in trainer.format_summary(TrainSummary(**base))
