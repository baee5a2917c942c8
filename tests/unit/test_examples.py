"""The files in examples/ are what the commands read: every key of examples/run.toml is a flag (or a field) of
`swarm demo`, each value lands where the file says, and every command takes `--config`."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from swarm.cli import COMMANDS, _build_parser

RUN_TOML = Path(__file__).resolve().parents[2] / "examples" / "run.toml"


def test_the_example_run_toml_is_swarm_demos_config():
    from swarm.testbed.demo import demo_flags, peer_config

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as --config files need
    text = tomllib.loads(RUN_TOML.read_text())
    flags = demo_flags()
    given = flags.read_toml(RUN_TOML)  # raises naming any key that is not a flag
    cfg = flags.parse(["--config", str(RUN_TOML)])
    assert cfg.peers == text["peers"] and cfg.out == text["out"]
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.model) == (4, 128, "gpt")
    assert cfg.train.epochs == text["train"]["epochs"] and cfg.train.eval_every == text["train"]["eval_every"]
    assert cfg.peer.link_shape.rate_bytes_per_s == text["peer"]["rate_mbit"] * 1e6 / 8
    assert cfg.peer.fw_codec.label == "acsgd2+ch+fsl32+fslw4+fsle10+dsl16+s20" and not cfg.peer.fw_codec.stochastic
    leaves = sum(len(v) if isinstance(v, dict) else 1 for v in text.values())
    assert len(given) == leaves, "every key of the file is read as one flag"
    # the peers' schedule ends where this run's training does
    assert peer_config(cfg, Path("/tmp/unused")).optim.total_steps == 4 * 256 // 16
    # a flag on the command line wins over the file
    assert flags.parse(["--config", str(RUN_TOML), "--epochs", "1"]).train.epochs == 1


def _leaf_parsers(parser: argparse.ArgumentParser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from _leaf_parsers(sub, (*path, name))


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_command_reads_a_config_file(path):
    _, leaves = _build_parser()
    importlib.import_module(COMMANDS[path][0]).add_arguments(leaves[path])
    for where, parser in _leaf_parsers(leaves[path], path):
        options = {s for a in parser._actions for s in a.option_strings}
        assert "--config" in options, f"swarm {' '.join(where)} has no --config"


def test_swarm_peer_reads_a_config_file():
    from swarm.daemon.peer_config import build_parser

    assert "--config" in build_parser().format_help()
