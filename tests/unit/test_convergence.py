"""`swarm experiment convergence --quick` runs end to end and writes sane outputs."""

import csv
import json
import math

import pytest
import torch

from swarm.cli import main
from swarm.experiments.convergence import Setting

torch.set_num_threads(1)


def test_settings_parse_codecs_rounding_and_warmup():
    s = Setting.parse("aqsgd2/gradq4+ef@w1", {"stochastic": False, "group_size": 128}, {"group_size": 1024})
    assert (s.forward.name, s.forward.bits, s.backward.bits, s.backward.error_feedback) == ("aqsgd", 2, 4, True)
    assert (s.forward.stochastic, s.forward.group_size, s.backward.stochastic) == (False, 128, True)
    assert s.warmup_epochs == 1 and s.name == "aqsgd2/gradq4+ef@w1"
    assert Setting.parse("aqsgd2+sr/gradq4+nr", {"stochastic": False}).forward.stochastic
    assert not Setting.parse("aqsgd2+sr/gradq4+nr").backward.stochastic
    for bad in ("aqsgd2", "aqsgd2+xx/gradq4", "aqsgd2+ef/gradq4"):
        with pytest.raises(ValueError):
            Setting.parse(bad)


def test_quick_run_writes_csv_plot_and_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["experiment", "convergence", "--quick", "--json", "--no-progress", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert "training samples" in captured.err  # the loader's report
    assert [r["setting"] for r in rows] == ["fp32/fp32", "directq2/gradq4+ef", "aqsgd2/gradq4+ef"]
    keys = {"setting", "fw_bits", "bw_bits", "final_train_loss", "final_eval_loss", "wire_bytes", "fp32_wire_bytes"}
    for row in rows:
        assert keys | {"steady_ratio_vs_fp32"} <= set(row)
        assert math.isfinite(row["final_eval_loss"]) and 0 < row["final_eval_loss"] < math.log(256) + 0.5
        assert row["fp32_wire_bytes"] == rows[0]["wire_bytes"]
    fp32, _, aq = rows
    assert fp32["fw_bits"] == 32 and aq["fw_bits"] == 2 and aq["bw_bits"] == 4
    assert aq["wire_bytes"] < fp32["wire_bytes"] / 3 and aq["steady_ratio_vs_fp32"] > 5
    with open(out / "losses.csv") as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == 3 * rows[0]["steps"] and float(steps[0]["train_loss"]) > 0
    assert (out / "loss.png").stat().st_size > 10_000
    assert json.loads((out / "results.json").read_text())["rows"] == rows
    assert "aqsgd2/gradq4+ef" in (out / "results.md").read_text()
