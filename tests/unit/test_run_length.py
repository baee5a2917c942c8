"""The run's length and the schedule agree (`swarm.train.run_length`): an owned run's trainer trains the manifest's
total_steps, refuses to train past them, warns when it stops short; `swarm demo` gives its peers its own length.
No sockets."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from swarm.daemon.run_cli import init_run
from swarm.options import ModelFlags
from swarm.train.run_length import run_steps
from swarm.train.trainer import TrainConfig, add_arguments, config_from_args


@pytest.fixture
def manifest(tmp_path) -> Path:
    files = init_run(tmp_path / "run", name="unit", model=ModelFlags(layers=2, hidden=32, heads=2), total_steps=50)
    return files.manifest_path


def _trainer(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_run_steps_is_what_the_trainer_trains():
    assert run_steps(TrainConfig(train_samples=64, batch_size=8, epochs=4)) == 32
    assert run_steps(TrainConfig(train_samples=64, batch_size=8, epochs=4, steps=7)) == 7
    assert run_steps(TrainConfig(train_samples=20, batch_size=8, epochs=3)) == 6  # the last, partial batch dropped


def test_an_owned_runs_trainer_trains_the_manifests_total_steps(manifest):
    assert _trainer("--run", str(manifest)).steps == 50
    # told the same length by its epochs or steps: accepted as it is
    assert run_steps(_trainer("--run", str(manifest), "--epochs", "25", "--train-samples", "16", "--batch-size", "8"))
    assert _trainer("--run", str(manifest), "--steps", "50").steps == 50


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "51"], r"--steps 51 trains 51 steps, past run .*cosine ends at step 50"),
        (["--epochs", "8"], r"--epochs 8 trains 64 steps, past run .*swarm run init --total-steps 64"),
    ],
)
def test_a_trainer_told_to_train_past_the_runs_schedule_is_refused(manifest, argv, match):
    with pytest.raises(ValueError, match=match):
        _trainer("--run", str(manifest), *argv)


def test_a_trainer_told_fewer_steps_is_warned_and_trains_them(manifest, caplog):
    assert _trainer("--run", str(manifest), "--steps", "20").steps == 20
    assert "training 20 of run" in caplog.text and "--resume" in caplog.text


def test_a_config_files_steps_count_as_given(manifest, tmp_path):
    toml = tmp_path / "train.toml"
    toml.write_text("steps = 60\n")
    with pytest.raises(ValueError, match="--steps 60"):
        _trainer("--run", str(manifest), "--config", str(toml))


def test_an_unowned_trainer_keeps_its_own_length():
    assert _trainer().steps is None and run_steps(_trainer("--epochs", "2")) == 16


def test_the_demo_gives_its_peers_the_trainers_length(tmp_path):
    from swarm.testbed.demo import demo_flags, peer_config

    cfg = demo_flags().parse(["--epochs", "3", "--train-samples", "32", "--batch-size", "8"])
    peer = peer_config(cfg, tmp_path)
    assert peer.optim.total_steps == run_steps(cfg.train) == 12
    assert 1 <= peer.optim.warmup_steps < peer.optim.total_steps


def _watch(stages_total: int, run_total: int, warmup: int = 10, steps: int | None = None) -> list[str]:
    from swarm.runtime.worker import OptimConfig, lr_at
    from swarm.train.run_length import ScheduleWatch

    said: list[str] = []
    watch = ScheduleWatch(run_total, said.append)
    cfg = OptimConfig(warmup_steps=warmup, total_steps=stages_total)
    for step in range(steps or run_total):
        watch.observe(step, lr_at(cfg, step) if step % 7 else 0.0)  # every 7th step skipped: no rate
    return said


def test_stages_whose_schedule_ends_where_the_run_does_raise_nothing():
    assert _watch(100, 100) == [] and _watch(40, 40, warmup=0) == [] and _watch(500, 500, warmup=40) == []


@pytest.mark.parametrize("stages_total, ends", [(1000, "ends near step 1000"), (40, "ends near step 40")])
def test_stages_on_another_schedule_are_named_once_early(stages_total, ends):
    said = _watch(stages_total, 100, steps=40)
    assert len(said) == 1 and ends in said[0]
    assert "--total-steps 100" in said[0] and "swarm run init" in said[0]
