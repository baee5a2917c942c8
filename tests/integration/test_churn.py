"""The churn experiment in --quick form: a small local swarm trained without churn, then with one SIGKILL and
one join (in network namespaces where the machine can make them), every process reaped and every namespace
removed; the rows are computed from the files it wrote, and the two settings' losses are the same at every step
completed before the kill (frozen plan inputs: the same computation until churn)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swarm.experiments.churn import ChurnConfig, ChurnRun, collect, flag_support, run_setting
from swarm.experiments.churn_report import SAME_LOSS_TOL, read_jsonl
from tests.integration.swarm_fixtures import alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.timeout(600)
def test_quick_churn_kills_one_serving_peer_joins_one_and_reaps_everything(tmp_path):
    """No-churn on loopback, then churn (one SIGKILL, one join) in network namespaces where this machine can make
    them, on loopback where it cannot: one pair of runs covers the experiment's rows, its loss agreement before the
    kill (the same keys, plan and samples in both) and the namespaces' churn, which once took a run of its own."""
    from swarm.testbed.churn_netns import PREFIX
    from swarm.testbed.netns import list_links, list_namespaces, unavailable_reason

    # --quick's own steps (`QUICK_STEPS`): in namespaces the kill waits on a status query and a fresh peer joins a
    # namespace made after it, which took longer than the steps left on a loaded machine (the trainer ended first)
    cfg = ChurnRun(ChurnConfig(setting_timeout_s=120.0, out=tmp_path), quick=True).config()
    netns = unavailable_reason() is None  # else the churn setting runs on loopback too
    lines: list[str] = []
    support = flag_support()
    # no churn: the steps up to 10 past the kill on the churn run's learning-rate schedule (what the loss agreement
    # compares), not its whole 120 (once 40% of the suite's longest test; the full experiment trains both alike)
    short = replace(cfg, steps=cfg.kill_every_steps + 10, schedule_steps=cfg.steps)
    base = run_setting(short, "no-churn", tmp_path, support, lines.append)
    assert base["rc"] == 0, lines
    assert not [n for n, pid in base["pids"].items() if alive(pid)], "a process of the swarm outlived the run"
    result = run_setting(replace(cfg, netns=netns), "churn", tmp_path, support, lines.append)
    d = tmp_path / "churn"
    events = read_jsonl(d / "events.jsonl")
    # the quick run ends its churn setting a few steps after the join, not at its 120 steps' bound
    assert [e["kind"] for e in events] == ["kill", "join", "end"], (events, lines)
    kill, join, end = events
    assert kill["stage"] is not None and kill["peer_id"] and kill["pid"] == result["pids"][kill["peer"]]
    assert join["peer"] not in (kill["peer"], "bootstrap", "trainer") and join["t"] > kill["t"]
    assert {"bootstrap", "trainer", join["peer"]} <= set(result["pids"])
    assert not [n for n, pid in result["pids"].items() if alive(pid)], "a process of the swarm outlived the run"
    if netns:
        assert not list_namespaces(PREFIX) and not list_links(PREFIX), "a namespace or link outlived the run"
    assert (d / "steps.csv").exists() and (d / "step_clock.jsonl").stat().st_size > 0
    assert result["rc"] == 0, lines  # asked to stop after its step, the trainer exits as after its last
    base_row, row = collect(cfg, tmp_path)
    assert row["kills"] == 1 and row["joins"] == 1
    assert end["at_step"] >= cfg.kill_every_steps + cfg.steps_after_churn and end["at_step"] < cfg.steps, end
    # judged up to its end: every step to there trained, every sample of them once; the trainer stopped long
    # before its bound (the clock it is read from and the polls lag a step or two behind the trainer)
    assert row["target_steps"] == end["at_step"] and end["at_step"] <= row["steps"] < cfg.steps, row
    assert row["samples_not_run"] == 0, row
    # same seed, ids, declared compute, unprobed links and equal chain weights: the same losses until the kill
    assert row["prekill_steps"] >= 1, row
    assert row["prekill_max_loss_diff"] <= SAME_LOSS_TOL, row
    assert base_row["final_loss_mean20"] is not None
    logs = [p.read_text(errors="replace") for p in (tmp_path / "no-churn" / "logs").glob("peer*.log")]
    assert logs and not [t for t in logs if "link to " in t], "a peer measured a link under --no-link-probe"
    assert any("(0 links measured" in t for t in logs)
    # main before issue 12 has no sample_ids column: "not measured", never a fake zero
    if row["samples_lost"] is None:
        assert "not measured" in row["accounting"]
