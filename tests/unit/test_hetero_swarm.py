"""`swarm experiment hetero` on processes, without the processes: the settings' peer configs, the interleaved
rounds' medians and ratios, and a failed swarm started again."""

from __future__ import annotations

from dataclasses import replace

import pytest

import swarm.experiments.hetero_swarm as hs
from swarm.experiments.hetero import HeteroConfig, check_targets
from swarm.net.stream import StageCallError


def test_only_the_planned_setting_gets_a_budget_and_only_placement_an_uneven_split():
    cfg = HeteroConfig(budget=2e-3)
    peers = {s: hs._peer_config(cfg, s, 40) for s in (*hs.SWARM_SETTINGS, hs.PLACED)}
    assert [peers[s].planning.precision_budget for s in hs.SWARM_SETTINGS] == [0.0, 0.0, 2e-3]
    assert [p.planning.even_layers for p in peers.values()] == [True, True, True, False]
    assert all(p.optim.total_steps == 40 and p.num_stages == cfg.n_stages for p in peers.values())


def test_rounds_are_interleaved_and_reported_as_medians_and_per_round_ratios(tmp_path, monkeypatch):
    speed = {"equal": [10.0, 12.0, 11.0], "slow-fp32": [5.0, 6.0, 5.5], "slow-planned": [8.0, 9.0, 9.0]}
    order, seen = [], {s: 0 for s in speed}

    def fake(cfg, setting, out, steps, say, tries=3):
        order.append(setting)
        k = seen[setting]
        seen[setting] += 1
        loss = 3.0 if setting != "slow-planned" else 3.006
        row = {"setting": setting, "throughput_samples_s": speed[setting][k], "final_eval_loss": loss}
        return {**row, "precisions": ["fp32", "fp32"]}

    monkeypatch.setattr(hs, "_attempts", fake)
    rows = hs.run_swarm_experiment(replace(HeteroConfig(), repeats=3), tmp_path, say=lambda _: None)
    assert order[:3] == ["equal", "slow-fp32", "slow-planned"] and order[3:6] == ["slow-fp32", "slow-planned", "equal"]
    assert [r["throughput_samples_s"] for r in rows] == [11.0, 5.5, 9.0]
    planned = rows[2]
    assert planned["recovered_rounds"] == pytest.approx([0.6, 0.5, 3.5 / 5.5]) and planned[
        "recovered"
    ] == pytest.approx(0.6)
    assert rows[1]["slow_cost"] == pytest.approx(0.5)
    assert planned["loss_vs_slow_fp32"] == pytest.approx(0.002)
    statements = check_targets(rows)
    assert [met for _, met in statements] == [True, True, True]
    assert (tmp_path / "rows.json").is_file()


def test_a_failed_swarm_is_started_again_from_scratch_and_says_so(tmp_path, monkeypatch):
    calls = []

    def flaky(cfg, setting, out, steps, say):
        calls.append(out.name)
        if len(calls) < 3:
            raise StageCallError("stage 0: schedule: 0F2 of step 0 ran already or is running")
        return {"setting": setting}

    monkeypatch.setattr(hs, "_run_setting", flaky)
    said = []
    row = hs._attempts(HeteroConfig(), "equal", tmp_path / "equal", 10, said.append)
    assert row["attempts"] == 3 and calls == ["equal", "equal-try2", "equal-try3"] and len(said) == 2
    calls.clear()
    with pytest.raises(StageCallError):
        hs._attempts(HeteroConfig(), "equal", tmp_path / "equal", 10, said.append, tries=2)
