"""Command-line flags take their choices and help from the codec and schedule registries."""

from __future__ import annotations

import argparse

import pytest

from swarm.compression import CODEC_NAMES
from swarm.daemon import peer
from swarm.experiments import convergence
from swarm.runtime.schedules import SCHEDULES
from swarm.train import demo, trainer


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
