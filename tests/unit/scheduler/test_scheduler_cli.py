"""`swarm plan` and `swarm bench scheduler` as a user runs them (in process)."""

from __future__ import annotations

import json

import pytest

from swarm.bench.scheduler import dtfm_row
from swarm.cli import main
from swarm.scheduler.scenarios import synthetic_worldwide
from swarm.scheduler.search import SearchConfig


def test_plan_scenario_dtfm_json(capsys):
    assert main(["plan", "--scenario", "multi-universities", "--cost-model", "dtfm", "--json", "--moves", "200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost_model"] == "dtfm" and len(out["stages"]) == 8
    assert out["step_time_s"] == pytest.approx(16.0869, abs=1e-3)


def test_plan_input_file(tmp_path, capsys):
    path = tmp_path / "swarm.json"
    synthetic_worldwide(12, seed=3).save(path)
    args = ["plan", "--input", str(path), "--layers", "6", "--hidden", "256", "--seq-len", "128", "--moves", "100"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "predicted step time" in text and "stage" in text


def test_plan_takes_exactly_one_source():
    # the live source (--dht) is exercised against a real swarm in tests/integration/test_replan.py
    with pytest.raises(SystemExit, match="exactly one"):
        main(["plan", "--scenario", "worldwide", "--dht", "/ip4/127.0.0.1/tcp/1"])


def test_bench_row_has_the_promised_fields():
    row = dtfm_row("multi-universities", SearchConfig(), random_count=10)
    for key in ("scenario", "peers", "cost_model", "ours_s", "random_s", "greedy_s", "solve_s"):
        assert key in row
    assert row["ours_s"] <= row["greedy_s"] and row["ours_s"] <= row["random_s"]
