"""`swarm demo` end to end in a small form: the README's main job starts its peers, trains, and sums up."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_the_demo_trains_and_its_planner_calibrates_the_prediction(tmp_path, capsys):
    from swarm.cli import main

    out = tmp_path / "demo"
    # 4 steps an epoch: the planner's calibration window (steps 4-8) closes inside the run, and its plan reaches
    # the trainer: the planner reads the clocks once a second and the trainer polls the plan once a second, so the
    # run must outlast a few seconds plus DHT latency under load (24 steps, ~4 s, did not on a loaded CI machine)
    args = ["demo", "--json", "--out", str(out), "--epochs", "20", "--train-samples", "32", "--batch-size", "8"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 80 and summary["final_loss"] < summary["first_loss"]
    assert summary["total_ratio_vs_fp32"] > 4
    # the republished plan is the same stages under the next version, with the calibrated prediction
    assert summary["plan_version"] == 2 and summary["predicted_step_s"] > 0
    assert (out / "steps.csv").exists() and (out / "loss.png").exists()
    # issue 28: the demo stops its peers (SIGINT), so each saves its own stage and none takes the others over
    # (a leave at the end left a 2-stage model in one file, layers-0000-0002)
    assert set(summary["peer_exit_codes"].values()) == {0}, summary["peer_exit_codes"]
    ranges = sorted(tuple(map(int, p.stem.split("-")[1:])) for p in (out / "checkpoints").glob("layers-*.safetensors"))
    assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[0][1] == ranges[1][0], ranges
