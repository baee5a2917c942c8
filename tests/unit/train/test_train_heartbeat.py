"""`swarm train`'s liveness flags reach the driver's `HeartbeatConfig`, with sane defaults and clear refusals."""

from __future__ import annotations

import argparse

import pytest

from swarm.runtime.heartbeat import HeartbeatConfig
from swarm.train.trainer import TrainConfig, add_arguments, train_flags


def test_defaults_keep_todays_fast_path_and_add_the_confirming_probe():
    hb = TrainConfig().heartbeat
    assert hb == HeartbeatConfig(interval_s=1.0, misses=3, floor_s=1.0, ceiling_s=10.0, confirm_s=10.0)
    assert hb.misses * hb.floor_s == 3.0  # a fast peer (or a killed one) is suspect after 3 s, as before


def test_flags_reach_the_heartbeat_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--heartbeat-s", "2", "--heartbeat-misses", "4", "--heartbeat-ceiling-s", "30", "--heartbeat-confirm-s", "20"]
    )
    hb = train_flags().from_args(args).heartbeat
    assert (hb.interval_s, hb.misses, hb.floor_s, hb.ceiling_s, hb.confirm_s) == (2.0, 4, 2.0, 30.0, 20.0)


@pytest.mark.parametrize(
    "bad", [{"heartbeat_misses": 0}, {"heartbeat_ceiling_s": 0.0}, {"heartbeat_confirm_s": -1.0}, {"heartbeat_s": 0}]
)
def test_nonsense_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="heartbeat|Heartbeat"):
        TrainConfig(**bad)
