"""`swarm experiment freezing` end to end at toy size: rows, plot, table, and the settings it compares."""

from __future__ import annotations

import json

from swarm.experiments.freezing import SETTINGS, FreezingExperimentConfig, run_experiment


def test_the_freezing_experiment_writes_rows_plot_and_table(tmp_path):
    cfg = FreezingExperimentConfig(
        n_layers=4, hidden=32, seq_len=16, n_stages=2, batch_size=8, n_micro=2, train_samples=32,
        eval_samples=16, pretrain_epochs=1, epochs=3, interval=2, tolerance=10.0, max_fraction=0.75, repeats=2,
        in_process=True,
    )  # fmt: skip
    results = run_experiment(cfg, tmp_path)
    assert [r["setting"] for r in results] == list(SETTINGS)
    for r in results:
        for key in ("setting", "frozen_layers", "throughput_samples_s", "final_eval_loss", "total_wire_bytes",
                    "stages", "cache_hits"):  # fmt: skip
            assert key in r
        assert r["throughput_samples_s"] > 0 and r["total_wire_bytes"] > 0
    assert results[0]["frozen_layers"] == 0
    # two interleaved rounds: the speedup is their ratios' median, and both rounds computed the same thing
    for r in results:
        assert len(r["speedup_runs"]) == len(r["throughput_runs"]) == 2
        assert r["speedup"] == sum(r["speedup_runs"]) / 2 and results[0]["speedup_runs"] == [1.0, 1.0]
        assert r["final_eval_loss_runs"] == [r["final_eval_loss"]] * 2
    assert results[1]["frozen_layers"] == 3  # a tolerance this loose freezes as fast as alpha allows, up to the cap
    assert results[2]["stage_history"] == [2, 1]  # layers 0-2 frozen: both fit on one stage (cost 3 x 1/3 + 1 <= 2)
    assert [r["stages"] for r in results] == [2, 2, 1]  # after any repack
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [row["setting"] for row in rows] == list(SETTINGS)
    table = (tmp_path / "table.md").read_text()
    assert "| freeze+repack |" in table and "x (2) |" in table
