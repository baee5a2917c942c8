"""Frozen plan inputs, for runs that must compute the same numbers: `swarm train --chain-weights equal`
(sample shares that never move), `swarm-peer --no-link-probe` (no link measured, no wait for probes), and
the trainer's steps.jsonl, which a live reader sees row by row."""

from __future__ import annotations

import argparse
import json

import pytest

from swarm.daemon.peer_config import build_parser
from swarm.daemon.peer_config import config_from_args as peer_config
from swarm.train.steplog import StepLog
from swarm.train.trainer import TrainConfig, add_arguments, config_from_args, route_weights

KEYS = [b"a", b"b"]


def _train_args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_equal_route_weights_never_move_however_unequal_the_routes():
    weights = route_weights("equal")
    for _ in range(50):
        weights.observe({b"a": 100.0, b"b": 1.0})
    assert weights.weights(KEYS) == [1.0, 1.0]


def test_measured_route_weights_follow_the_throughput():
    weights = route_weights("measured")
    for _ in range(50):
        weights.observe({b"a": 100.0, b"b": 1.0})
    a, b = weights.weights(KEYS)
    assert a > b


def test_chain_weights_flag_defaults_to_measured_and_reaches_the_config():
    assert config_from_args(_train_args()).chain_weights == "measured"
    assert config_from_args(_train_args("--chain-weights", "equal")).chain_weights == "equal"
    with pytest.raises(SystemExit):
        _train_args("--chain-weights", "fast")
    with pytest.raises(ValueError, match="chain_weights"):
        TrainConfig(chain_weights="fast")
    with pytest.raises(ValueError):
        route_weights("fast")


def test_the_driver_gets_the_configured_weights(monkeypatch, tmp_path):
    """train() builds its driver with `weights=` from --chain-weights (an equal one never moves)."""
    import swarm.runtime.driver as driver_module
    from swarm.peers.routes import PlanRoutes

    made = []

    class Stop(Exception):
        pass

    def fake_driver(*args, weights=None, **kw):
        made.append(weights)
        raise Stop

    monkeypatch.setattr(driver_module, "PipelineDriver", fake_driver)
    from swarm.train.trainer import train

    cfg = TrainConfig(chain_weights="equal", steps=1, out=str(tmp_path), train_samples=8, batch_size=8)
    with pytest.raises(Stop):
        train(cfg, PlanRoutes(["127.0.0.1:1"], ["p"]), quiet=True)
    (weights,) = made
    weights.observe({b"a": 100.0, b"b": 1.0})
    weights.observe({b"a": 100.0, b"b": 1.0})
    assert weights.weights(KEYS) == [1.0, 1.0]


def test_link_probe_flag_defaults_to_probing_and_turns_off():
    parser = build_parser()
    assert peer_config(parser.parse_args([])).planning.probe_links is True
    assert peer_config(parser.parse_args(["--no-link-probe"])).planning.probe_links is False
    assert "--no-link-probe" in parser.format_help()


def test_steplog_rows_reach_the_file_as_they_are_added(tmp_path):
    log = StepLog(tmp_path, ["step", "train_loss", "step_s"])
    row = {"step": 1, "train_loss": 2.5, "step_s": 0.1, "forward_bytes": 1, "backward_bytes": 2}
    row |= {"fp32_wire_bytes": 3, "sync_bytes": 0}
    log.add(row)
    # a second reader, while the log is open: the row is there already, not in a write buffer
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["train_loss"] for line in lines] == [2.5]
    log.add({**row, "step": 2, "train_loss": 2.0})
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 2
    log.close()
