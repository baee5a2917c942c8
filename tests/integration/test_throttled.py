"""`swarm experiment throttled --quick` end to end: real local swarms per cell, on app-shaped links."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from swarm.compression import DEFAULT_FORWARD_CODEC

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_quick_matrix_writes_rows_csv_plots_and_report(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "experiment", "throttled", "--quick", "--json", "--out", str(out)],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    keys = {"rate_mbit", "setting", "fw_bits", "bw_bits", "mean_step_s", "wire_bytes", "final_loss"}
    keys |= {"rho", "predicted_step_s", "total_wire_bytes", "fp32_total_wire_bytes", "total_ratio_vs_fp32"}
    assert all(keys | {"speedup_share"} <= set(r) for r in rows)
    cells = {(r["rate_mbit"], r["setting"]) for r in rows}
    assert len(cells) == len(rows) >= 4 and {r["rate_mbit"] for r in rows} == {10.0, None}
    by = {(r["rate_mbit"], r["setting"].split("/")[0]): r for r in rows}
    fp32_slow, fp32_fast = by[(10.0, "fp32")], by[(None, "fp32")]
    # the same seed and the same even split in every cell: the link speed changes time, never the math,
    # also where stochastic rounding and error feedback make the math depend on the order of the encodes
    assert fp32_slow["final_loss"] == fp32_fast["final_loss"]
    fw = DEFAULT_FORWARD_CODEC
    assert by[(10.0, fw)]["final_loss"] == by[(None, fw)]["final_loss"]
    assert fp32_slow["wire_bytes"] <= fp32_fast["wire_bytes"], "zstd may only shrink what a slow link carries"
    quantized = [r for r in rows if r["fw_bits"] < 32]
    assert quantized and all(r["wire_bytes"] < fp32_fast["wire_bytes"] / 3 for r in quantized)
    with open(out / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == 8 * len(rows), "--quick runs 8 steps per cell"
    assert {"step_s", "train_loss"} <= set(steps[0])
    for name in ("loss_vs_time.png", "step_time.png", "wire_bytes.png"):
        assert (out / name).stat().st_size > 10_000, name
    report = (out / "report.md").read_text()
    assert "10 Mbit/s" in report and "unshaped" in report and "time on the wire" in report
    assert "## Targets" in report and "predicted step time within 10%" in report
    slow = [r for r in rows if r["rate_mbit"] == 10.0]
    assert all(r["rho"] is not None and r["rho"] > 0 for r in slow)  # fp32's wire time over its compute
    assert all(r["rho"] is None for r in rows if r["rate_mbit"] is None)
