"""`swarm experiment convergence`'s flags: generated from `ConvergenceRun`, round trips, a TOML file under them."""

from __future__ import annotations

import argparse

import pytest

from swarm.experiments.convergence import (
    DEFAULT_SETTINGS,
    QUICK_SETTINGS,
    ConvergenceRun,
    ExperimentConfig,
    ModelData,
    add_arguments,
    config_from_args,
)
from swarm.flags import Flags
from swarm.model.gpt import ModelConfig
from swarm.options import ModelFlags


def _config(argv: list[str]) -> ExperimentConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_seed_and_seq_len_set_both_the_model_and_the_data():
    cfg = _config(["--seed", "3", "--seq-len", "64", "--hidden", "48", "--train-samples", "20"])
    assert cfg.model == ModelConfig(seq_len_tokens=64, hidden_dim=48, init_seed=3)
    assert cfg.data_seed == 3 and cfg.data.seq_len_tokens == 64 and cfg.data.train_samples == 20


def test_defaults_are_the_experiments():
    assert _config([]) == ExperimentConfig()
    assert Flags(ConvergenceRun).parse([]).config() == ExperimentConfig()


def test_quick_shrinks_the_run_but_keeps_the_seed_and_given_settings():
    cfg = _config(["--quick", "--seed", "2"])
    assert cfg.model == ModelConfig(seq_len_tokens=32, hidden_dim=32, n_layers=2, n_heads=2, init_seed=2)
    assert cfg.settings == QUICK_SETTINGS and (cfg.epochs, cfg.batch_size, cfg.n_micro) == (3, 8, 2)
    assert cfg.optim.lr_peak == 3e-3 and cfg.data.train_samples == 48 and cfg.data_seed == 2
    assert _config(["--quick", "--settings", "fp32/fp32,aqsgd2/gradq4"]).settings == ("fp32/fp32", "aqsgd2/gradq4")


def test_rounding_and_renamed_flags_reach_their_fields():
    cfg = _config(["--fw-rounding", "stochastic", "--stages", "3", "--micro-batches", "2", "--bf16"])
    assert cfg.forward_stochastic and cfg.n_stages == 3 and cfg.n_micro == 2 and cfg.autocast_bf16
    assert not _config(["--fw-rounding", "nearest"]).forward_stochastic


def test_run_round_trips_through_argv():
    flags = Flags(ConvergenceRun)
    run = ConvergenceRun(
        experiment=ExperimentConfig(settings=DEFAULT_SETTINGS[:2], n_stages=3, forward_stochastic=True, epochs=2),
        inputs=ModelData(model=ModelFlags(seq_len=64, layers=2), seed=5, lr=1e-3, data="/tmp/text"),
        threads=2, quick=True, progress=False,
    )  # fmt: skip
    argv = flags.to_argv(run)
    assert "--fw-rounding" in argv and "--no-progress" in argv and "--seed" in argv
    assert flags.parse(argv) == run


def test_toml_file_with_a_flag_overriding_it(tmp_path):
    path = tmp_path / "conv.toml"
    path.write_text('seed = 4\nepochs = 5\nfw-rounding = "stochastic"\nsettings = "fp32/fp32,aqsgd2/gradq4"\n')
    cfg = _config(["--config", str(path), "--epochs", "6"])
    assert cfg.epochs == 6 and cfg.data_seed == 4 and cfg.model.init_seed == 4 and cfg.forward_stochastic
    assert cfg.settings == ("fp32/fp32", "aqsgd2/gradq4")


def test_grad_clip_sets_the_optimizers_threshold_and_zero_turns_it_off():
    assert _config([]).optim.grad_clip_norm == 1.0
    assert _config(["--grad-clip", "2.5"]).optim.grad_clip_norm == 2.5
    assert _config(["--grad-clip", "0"]).optim.grad_clip_norm is None
    run = ConvergenceRun(inputs=ModelData(grad_clip=0.0))
    assert Flags(ConvergenceRun).parse(Flags(ConvergenceRun).to_argv(run)).config().optim.grad_clip_norm is None


def test_grad_clip_refuses_a_negative_or_non_finite_norm(capsys):
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit):
            _config(["--grad-clip", bad])
        assert "--grad-clip" in capsys.readouterr().err
