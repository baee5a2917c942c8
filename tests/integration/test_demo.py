"""`swarm demo` end to end in a small form: the README's main job starts its peers, trains, and sums up."""

from __future__ import annotations

import csv
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
    # held-out evaluation through the peers, forward only: every 20 steps (the default) and after the last
    with open(out / "steps.csv") as f:
        held = {int(r["step"]): r["held_out_loss"] for r in csv.DictReader(f) if r["held_out_loss"]}
    assert sorted(held) == [20, 40, 60, 80]
    assert summary["held_out_step"] == 80 and summary["held_out_loss"] == float(held[80])
    assert 0 < summary["held_out_loss"] < float(held[20])  # it learned something that carries over
