"""Command-line flags take their choices and help from the codec and schedule registries."""

from __future__ import annotations

import argparse

import pytest

from swarm.compression import CODEC_NAMES
from swarm.daemon import peer
from swarm.experiments import convergence, throttled
from swarm.runtime.schedules import SCHEDULES
from swarm.testbed import demo
from swarm.train import trainer


def _parser(module) -> argparse.ArgumentParser:
    if module is peer:
        return peer.build_parser()
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


@pytest.mark.parametrize("module", [demo, trainer, convergence])
def test_every_schedule_flag_offers_exactly_the_registered_schedules(module):
    assert sorted(_action(_parser(module), "--schedule").choices) == sorted(SCHEDULES)


@pytest.mark.parametrize(("module", "flag"), [(demo, "--fw-codec"), (peer, "--bw-codec"), (convergence, "--settings")])
def test_codec_help_names_every_registered_codec(module, flag):
    help_text = _action(_parser(module), flag).help
    assert all(name in help_text for name in CODEC_NAMES)


def _model(argv: list[str]):
    from swarm.options import model_config

    return model_config(_parser(trainer).parse_args(argv))


def test_model_defaults_to_the_builtin_shaped_by_the_flags_as_before():
    from swarm.model.gpt import ModelConfig

    assert _model([]) == ModelConfig()
    assert _model(["--model", "gpt", "--layers", "2", "--seq-len", "16"]) == ModelConfig(n_layers=2, seq_len_tokens=16)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--weights", "/nonexistent/ckpt"], "--weights /nonexistent/ckpt: no such file or directory"),
        (["--tokenizer", "/nonexistent/tok.json"], "--tokenizer /nonexistent/tok.json: no such file"),
        (["--weights", "."], "--weights and --tokenizer need a Hugging Face model"),
    ],
)
def test_a_bad_model_flag_is_a_one_line_error(argv, says):
    with pytest.raises(SystemExit) as err:
        _model(argv)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("module", [demo, trainer, convergence, throttled, peer])
def test_every_entry_point_takes_the_model_flags_with_help(module):
    parser = _parser(module)
    for flag in ("--model", "--weights", "--tokenizer"):
        assert _action(parser, flag) is not None and _action(parser, flag).help
