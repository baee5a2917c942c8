"""The churn experiment computes the same numbers in both settings until the first kill: frozen plan inputs
passed to every peer and trainer by default, the step-by-step loss comparison before the first kill, and
final_loss beside the less noisy final_loss_mean20."""

from __future__ import annotations

import argparse

import pytest

from swarm.experiments.churn import PLAN_INPUTS, ChurnConfig, add_arguments, config_from_args, swarm_flags
from swarm.experiments.churn_report import (
    MEAN20_STEPS,
    ROW_KEYS,
    loss_agreement,
    report_markdown,
    summarize,
    targets,
)

ALL = {"--replicas": True, "--no-link-probe": True, "--replan-timeout-s": True, "--chain-weights": True}


def _args(**kw):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}" for k, v in kw.items() if v is True])


def _rows(losses, t0=1000.0):
    return [
        {"step": str(k + 1), "train_loss": repr(loss), "time": str(t0 + k), "forward_bytes": "1", "backward_bytes": "1"}
        for k, loss in enumerate(losses)
    ]


@pytest.mark.parametrize("setting", ["no-churn", "churn"])
def test_both_settings_freeze_the_plan_inputs_by_default(setting):
    peer, trainer = swarm_flags(config_from_args(_args()), setting, ALL)
    assert "--no-link-probe" in peer
    assert trainer[trainer.index("--chain-weights") + 1] == "equal"
    assert peer[peer.index("--compute-speed") + 1] != "0"  # compute declared too, never measured


def test_measured_plan_turns_the_frozen_inputs_off():
    cfg = config_from_args(_args(measured_plan=True))
    assert cfg.measured_plan
    peer, trainer = swarm_flags(cfg, "churn", ALL)
    assert "--no-link-probe" not in peer and "--chain-weights" not in trainer


def test_frozen_flags_left_out_where_the_checkout_lacks_them():
    peer, trainer = swarm_flags(ChurnConfig(), "churn", {})
    assert "--no-link-probe" not in peer and "--chain-weights" not in trainer


def test_help_says_the_settings_compute_alike_until_the_first_kill():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--measured-plan" in text and "same losses step for step until the first kill" in text
    assert "until the first kill" in PLAN_INPUTS[False]


def test_losses_compared_only_at_steps_completed_before_the_first_kill():
    base = _rows([3.0, 2.5, 2.25, 2.0, 1.5])
    churn = _rows([3.0, 2.5, 2.25, 2.75, 1.9])  # differs from step 4, completed at 1003.0, after the kill
    kill = [{"t": 1002.5, "kind": "kill"}, {"t": 1002.6, "kind": "join"}]
    assert loss_agreement(base, churn, kill) == {
        "prekill_steps": 3,
        "prekill_max_loss_diff": 0.0,
        "prekill_first_diff_step": None,
        "prekill_plan_parted_step": None,
    }
    early = [{"t": 1003.5, "kind": "term"}]  # now step 4 is before the (graceful) leave
    got = loss_agreement(base, churn, early)
    assert got["prekill_steps"] == 4 and got["prekill_first_diff_step"] == 4
    assert got["prekill_max_loss_diff"] == pytest.approx(0.75)
    # no leave at all: every step is compared; no step before the kill: nothing compared, not a zero
    assert loss_agreement(base, churn, [])["prekill_steps"] == 5
    assert loss_agreement(base, churn, [{"t": 999.0, "kind": "kill"}])["prekill_max_loss_diff"] is None


def test_losses_compared_only_while_both_settings_run_the_same_plan():
    """A peer's DHT record lapsing under load repairs the churn setting's plan before any kill: from that step
    the routes differ, so the comparison stops there, says so, and still fails on a difference before it."""
    base = _rows([3.0, 2.5, 2.25, 2.0, 1.5])
    churn = _rows([3.0, 2.5, 2.25, 2.75, 1.9])
    for rows, plans in ((base, "11111"), (churn, "11122")):
        for row, plan in zip(rows, plans, strict=True):
            row["plan_version"] = plan
    got = loss_agreement(base, churn, [{"t": 1003.5, "kind": "kill", "stage": 0, "replicas_left": 1}])
    assert got == {
        "prekill_steps": 3,
        "prekill_max_loss_diff": 0.0,
        "prekill_first_diff_step": None,
        "prekill_plan_parted_step": 4,
    }
    churn[1]["train_loss"] = "2.6"  # a difference on the shared plan still counts
    got = loss_agreement(base, churn, [{"t": 1003.5, "kind": "kill", "stage": 0, "replicas_left": 1}])
    assert got["prekill_first_diff_step"] == 2 and got["prekill_max_loss_diff"] == pytest.approx(0.1)
    base_row = summarize("no-churn", base, [], [], [], 2, 5)
    churn_row = summarize("churn", churn, [{"t": 1003.5, "kind": "kill", "stage": 0, "replicas_left": 1}], [], [], 2, 5)
    churn_row.update(got)
    check = next(c for c in targets([base_row, churn_row], 60) if c.name.startswith("experiment:"))
    assert check.passed is False and "plans parted at step 4" in check.value


def test_a_prekill_difference_fails_the_same_computation_check():
    base_rows = _rows([3.0, 2.5, 2.0])
    churn_rows = _rows([3.0, 2.5 + 1e-3, 2.1])
    events = [{"t": 1001.5, "kind": "kill", "stage": 0, "replicas_left": 1}]
    base = summarize("no-churn", base_rows, [], [], [], 2, 3)
    churn = summarize("churn", churn_rows, events, [], [], 2, 3)
    churn.update(loss_agreement(base_rows, churn_rows, events))
    check = next(c for c in targets([base, churn], 60) if c.name.startswith("experiment:"))
    assert check.passed is False and "first differs at step 2" in check.value
    churn.update(loss_agreement(base_rows, _rows([3.0, 2.5, 2.1]), events))
    check = next(c for c in targets([base, churn], 60) if c.name.startswith("experiment:"))
    assert check.passed is True and "over 2 steps" in check.value


def test_final_loss_is_the_last_5_steps_and_mean20_the_last_20_both_reported():
    losses = [float(k) for k in range(30)]
    row = summarize("no-churn", _rows(losses), [], [], [], 2, 30)
    assert row["final_loss"] == pytest.approx(sum(range(25, 30)) / 5)  # unchanged meaning
    assert row["final_loss_mean20"] == pytest.approx(sum(range(10, 30)) / MEAN20_STEPS)
    assert ROW_KEYS.index("final_loss_mean20") == ROW_KEYS.index("final_loss") + 1
    churn = summarize("churn", _rows([x * 1.01 for x in losses]), [{"t": 1010.5, "kind": "kill"}], [], [], 2, 30)
    check = next(c for c in targets([row, churn], 60) if c.name == "final loss within 2% of no-churn")
    assert check.value.startswith("1.00%") and "mean of the last 20 steps: 1.00%" in check.value
    text = report_markdown([row, churn], targets([row, churn], 60), {}, [])
    assert "final_loss_mean20" in text and "judged on final_loss" in text
    assert summarize("churn", [], [], [], [], 2, 30)["final_loss_mean20"] is None


def test_identities_folder_is_passed_to_the_swarm_so_two_runs_share_peer_ids(tmp_path, monkeypatch):
    import swarm.experiments.churn as churn
    import swarm.testbed.churn_control as testbed

    cfg = config_from_args(_args())
    assert cfg.identities is None
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    keys = tmp_path / "keys"
    cfg = config_from_args(parser.parse_args(["--identities", str(keys)]))
    assert cfg.identities == keys
    seen = []

    class Stop(Exception):
        pass

    class FakeSwarm:
        def __init__(self, out, peer_flags, trainer_flags, wrap, observe, identities):
            seen.append(identities)
            raise Stop

    monkeypatch.setattr(testbed, "ChurnSwarm", FakeSwarm)
    for config in (cfg, config_from_args(_args())):
        with pytest.raises(Stop):
            churn.run_setting(config, "no-churn", tmp_path / "out", ALL, lambda line: None)
    assert seen == [keys, tmp_path / "out" / "identities"]
