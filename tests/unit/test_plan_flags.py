"""`swarm plan`'s flags: generated from `PlanCommand`, the model shape's unset fields filled from a default."""

from __future__ import annotations

import argparse

import pytest

from swarm.scheduler import TransformerShape
from swarm.scheduler.plan_cli import PLAN_FLAGS, DtfmGrid, PlanCommand, PlanSource, ShapeFlags, add_arguments


def test_unset_shape_flags_take_the_default_shape():
    live = TransformerShape(layers=4, hidden=128, seq_len=128, micro_batches=4, forward_bits=2.0)
    assert ShapeFlags().shape(TransformerShape()) == TransformerShape()
    assert ShapeFlags(hidden=64, gradient_bits=4.0).shape(live) == TransformerShape(
        layers=4, hidden=64, seq_len=128, micro_batches=4, forward_bits=2.0, gradient_bits=4.0
    )


def test_exactly_one_source():
    PlanSource(scenario="uniform").check()
    PlanSource(dht_address_file="addr").check()
    for source in (PlanSource(), PlanSource(scenario="uniform", input="x.json")):
        with pytest.raises(SystemExit, match="exactly one"):
            source.check()


def test_plan_command_round_trips_and_reads_toml(tmp_path):
    cmd = PlanCommand(
        source=PlanSource(dht=("/ip4/1.2.3.4/tcp/5/p2p/Qm",), run_name="r"), cost_model="dtfm", seed=3, json=True,
        model=ShapeFlags(layers=12, forward_bits=2.0), dtfm=DtfmGrid(stages=4, replicas=2, activation_gb=0.5),
    )  # fmt: skip
    assert PLAN_FLAGS.parse(PLAN_FLAGS.to_argv(cmd)) == cmd
    path = tmp_path / "plan.toml"
    path.write_text('scenario = "uniform"\nlayers = 8\nseed = 2\nstages = 4\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    got = PLAN_FLAGS.from_args(parser.parse_args(["--config", str(path), "--seed", "5"]))
    assert got.source.scenario == "uniform" and got.model.layers == 8 and got.seed == 5 and got.dtfm.stages == 4
