"""`swarm experiment attacks --quick`: a small local owned run, clean and with a volunteer lying NaN norms, with
its rows as `--json` prints them, its report and plot, and every process reaped: the liar is detected and
evicted, the standby takes its place with bit-identical weights, and the run neither stops nor loses a step."""

from __future__ import annotations

import json

import pytest

from swarm.cli import main
from swarm.experiments.attacks import QUICK_SETTINGS
from swarm.experiments.attacks_report import CLEAN_KEYS, ROW_KEYS
from tests.integration.swarm_fixtures import alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_quick_attacks_rows_clean_run_and_reaping(tmp_path, capsys):
    assert main(["experiment", "attacks", "--quick", "--json", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["setting"] for r in rows] == list(QUICK_SETTINGS)
    for row in rows:
        assert set(ROW_KEYS) <= set(row), row
        assert isinstance(row["evicted"], bool) and isinstance(row["run_stopped"], bool)
        assert row["refused_or_detected"] in (True, False, None)
    clean = rows[0]
    assert set(CLEAN_KEYS) <= set(clean)
    assert clean["steps"] == 8 and not clean["run_stopped"] and clean["evictions"] == 0
    assert clean["final_loss"] is not None and clean["throughput_samples_s"] > 0
    assert all(r["owned_run"] for r in rows)
    assert clean["replicas_identical"] is True and clean["replaced_by"] is None
    # the whole rows (`--json` prints the keys): a failure below names what each row saw
    evidence = {r["setting"]: r.get("evidence") for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    for row in rows[1:]:  # the liar is struck out and banned; the run goes on to its last step
        assert row["refused_or_detected"] is True and row["evicted"] is True, row
        assert not row["run_stopped"] and row["steps"] == clean["steps"], row
        assert row["detection_steps"] is not None and row["detection_steps"] <= 20, row
        # the standby took the liar's place with its sibling's state (not the liar's): the replicas end equal
        assert row["replaced_by"] is not None and row["replicas_identical"] is True, (row, evidence[row["setting"]])
    assert (tmp_path / "report.md").read_text().count("| liar-norm:nan |") == 1
    assert (tmp_path / "loss.png").stat().st_size > 0
    for setting in QUICK_SETTINGS:
        result = json.loads((tmp_path / setting.replace(":", "_") / "attack.json").read_text())
        assert result["pids"] and not [n for n, pid in result["pids"].items() if alive(pid)], setting
