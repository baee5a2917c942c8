"""Built-in GPT presets: `--model gpt-mid` names a shape every peer and the trainer rebuild identically."""

from __future__ import annotations

import argparse

import pytest

from swarm.model.gpt import ModelConfig
from swarm.model.spec import BUILTIN_PRESETS, builtin_preset, model_identity, parameter_count, resolve_model
from swarm.options import add_model_arguments, model_arguments, model_config


def _model(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    return model_config(args), args, parser


def test_gpt_mid_is_the_builtin_at_hidden_256_with_the_flags_sequence_and_seed():
    model, _, _ = _model(["--model", "gpt-mid", "--seq-len", "64", "--model-seed", "3", "--hidden", "64"])
    assert model == ModelConfig(hidden_dim=256, n_layers=4, n_heads=8, seq_len_tokens=64, init_seed=3)
    assert model.hidden_dim >= 256 and model.hidden_dim // model.n_heads == ModelConfig().hidden_dim // 4
    assert resolve_model("gpt-mid", builtin=ModelConfig(seq_len_tokens=64, init_seed=3)) == model
    assert resolve_model("gpt-mid", init_seed=2) == builtin_preset("gpt-mid", ModelConfig(init_seed=2))


def test_a_child_given_the_same_flags_builds_the_same_model():
    model, args, parser = _model(["--model", "gpt-mid", "--seq-len", "32"])
    child, _, _ = _model(model_arguments(args))
    assert model_identity(child) == model_identity(model) != model_identity(ModelConfig(seq_len_tokens=32))
    assert "gpt-mid" in model_arguments(args)


def test_the_stated_parameter_counts_hold():
    assert parameter_count(ModelConfig()) == 837_888
    assert parameter_count(builtin_preset("gpt-mid")) == 3_248_640  # BUILTIN_PRESETS' docstring says so


def test_a_preset_refuses_weights_and_an_unknown_preset_is_named():
    with pytest.raises(ValueError, match="gpt-mid"):
        resolve_model("gpt-mid", weights="/tmp")
    with pytest.raises(KeyError, match="gpt-mid"):
        builtin_preset("gpt-huge")
    with pytest.raises(SystemExit, match="--weights and --tokenizer"):
        _model(["--model", "gpt-mid", "--weights", "."])
    assert all(name.startswith("gpt-") for name in BUILTIN_PRESETS)  # never a Hugging Face preset's name
