"""The attacks experiment without processes: its rows are judged from observations and steps only (an attack
shows as succeeding unless the run refused it or evicted its peer), its targets, report, config and the lies."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.experiments.attacks import AttacksConfig, AttacksRun, liar_choice
from swarm.experiments.attacks_report import (
    CLEAN_KEYS,
    ROW_KEYS,
    SHAPE_KEYS,
    Observation,
    Setting,
    clean_row,
    evictions,
    held_out_loss,
    judge,
    replacement,
    replicas_identical,
    report_markdown,
    targets,
    throughput,
)
from swarm.experiments.liar_peer import LIES, Lie, apply_lie, parse_lie

A, B, C, D, LIAR = "a1", "b2", "c3", "d4", "e5"


def _obs(t, step, version, stages, trainers=("t0",), banned=(), peers=None):
    return Observation(t, step, version, tuple(tuple(s) for s in stages), tuple(trainers), tuple(banned), peers or {})


def _steps(n, loss=3.0):
    return [{"step": i + 1, "train_loss": loss, "time": 100.0 + i} for i in range(n)]


def test_the_held_out_loss_is_the_last_steps_and_none_where_it_has_none():
    rows = _steps(10)
    rows[4]["held_out_loss"], rows[-1]["held_out_loss"] = "3.5", "3.2643593549728394"
    assert held_out_loss(rows) == 3.26436, "the last step's, rounded as final_loss"
    row = judge(Setting("liar-noise", "liar", (LIAR,)), rows, [_obs(1, 0, 1, [[A, LIAR]])], 0, 10)
    assert row["held_out_loss"] == 3.26436 and row["final_loss"] == 3.0, "an extra field: final_loss unchanged"
    rows[-1]["held_out_loss"] = ""
    assert held_out_loss(rows) is None, "a run stopped before its last evaluation: none, not an earlier one"
    assert held_out_loss([]) is None
    rows[-1]["held_out_loss"] = "nan"
    assert held_out_loss(rows) is None


def test_a_liar_never_evicted_is_an_attack_that_succeeded():
    obs = [_obs(1, 0, 1, [[A, LIAR], [B, C]]), _obs(2, 5, 1, [[A, LIAR], [B, C]])]
    row = judge(Setting("liar-noise", "liar", (LIAR,)), _steps(10), obs, 0, 10)
    assert row["refused_or_detected"] is False and row["evicted"] is False and row["detection_steps"] is None
    assert not row["run_stopped"] and row["steps"] == 10 and row["final_loss"] == 3.0
    assert set(ROW_KEYS) <= set(row)


def test_a_liar_left_out_of_a_newer_plan_is_evicted_at_that_step():
    obs = [_obs(1, 0, 1, [[A, LIAR], [B, C]]), _obs(2, 4, 1, [[A, LIAR], [B, C]]), _obs(3, 6, 2, [[A], [B, C]])]
    row = judge(Setting("liar-norm:nan", "liar", (LIAR,)), _steps(10), obs, 0, 10)
    assert row["refused_or_detected"] is True and row["evicted"] is True and row["detection_steps"] == 6


def _ann(stage, version):
    return [stage, version, "direct", None, 0.0]


def test_a_standby_that_serves_the_liars_stage_under_the_repaired_plan_replaced_it():
    standby = "f6"
    peers1 = {A: _ann(0, 1), LIAR: _ann(0, 1), B: _ann(1, 1), C: _ann(1, 1), standby: _ann(None, 1)}
    obs = [
        _obs(1, 0, 1, [[A, LIAR], [B, C]], peers=peers1),
        _obs(2, 1, 1, [[A, LIAR], [B, C]], banned=(LIAR,), peers=peers1),  # evicted: banned at step 1
        _obs(3, 2, 2, [[A, standby], [B, C]], banned=(LIAR,), peers=peers1),  # planned, not serving yet
        _obs(4, 4, 2, [[A, standby], [B, C]], banned=(LIAR,), peers={**peers1, standby: _ann(0, 2)}),
    ]
    replicas = {A: [0, 9, "d0"], standby: [0, 9, "d0"], B: [1, 9, "d1"], C: [1, 9, "d1"]}
    row = judge(Setting("liar-noise", "liar", (LIAR,)), _steps(10), obs, 0, 10, replicas)
    assert row["detection_steps"] == 1 and set(SHAPE_KEYS) <= set(row)
    assert row["replaced_by"] == standby and row["replaced_after_steps"] == 3 and row["replicas_identical"] is True
    assert replacement(obs, LIAR, obs[1]) == (standby, 3)
    # replicas that ended apart: the row says which, and whether a step behind or on other bits
    apart = {**replicas, standby: [0, 8, "d0"], C: [1, 9, "d2"]}
    row = judge(Setting("liar-noise", "liar", (LIAR,)), _steps(10), obs, 0, 10, apart)
    assert row["replicas_identical"] is False
    assert f"stage 0: {standby[:8]} step 8 digest d0" in row["evidence"] and "digest d2" in row["evidence"]
    # the stage left short (no standby): no replacement; a peer serving another stage is none either
    short = [*obs[:2], _obs(3, 2, 2, [[A], [B, C]], peers=peers1), _obs(4, 3, 3, [[A, B], [C]], peers=peers1)]
    assert replacement(short, LIAR, obs[1]) is None
    assert judge(Setting("liar-noise", "liar", (LIAR,)), _steps(10), short, 0, 10)["replaced_by"] is None


def test_the_churn_control_is_no_attack_and_counts_for_no_target_but_shows_its_replacement():
    standby = "f6"
    peers = {A: _ann(0, 2), B: _ann(1, 2), C: _ann(1, 2), standby: _ann(0, 3)}
    obs = [
        _obs(1, 0, 1, [[A, LIAR], [B, C]], peers=peers),
        _obs(3, 2, 2, [[A], [B, C]], peers=peers),  # the killed volunteer dropped (dead): no ban
        _obs(4, 3, 3, [[A, standby], [B, C]], peers=peers),
    ]
    row = judge(Setting("churn-control", "control", (LIAR,), attack_step=1, attack_t=2.0), _steps(10), obs, 0, 10)
    assert row["refused_or_detected"] is None and row["evicted"] is False and "killed" in row["evidence"]
    assert row["replaced_by"] == standby and row["replaced_after_steps"] == 1
    clean = {**row, "setting": "clean", "kind": "clean", "evictions": 0}
    far = {**row, "final_loss": 9.0, "run_stopped": True}  # a control far off and stopped misses nothing
    checks = {c.name.split(",")[0]: c for c in targets([clean, far])}
    assert checks["the run never stops"].verdict == "met"
    assert checks["final loss within 1% of the clean run"].verdict == "met"


def test_replicas_identical_needs_one_step_and_one_digest_per_stage():
    assert replicas_identical({A: [0, 9, "d0"], B: [0, 9, "d0"], C: [1, 9, "x"]}) is True
    assert replicas_identical({A: [0, 9, "d0"], B: [0, 9, "d9"]}) is False  # other bits
    assert replicas_identical({A: [0, 9, "d0"], B: [0, 8, "d0"]}) is False  # a step behind
    assert replicas_identical({}) is None and replicas_identical(None) is None


def test_a_liar_that_could_not_lie_is_not_counted():
    obs = [_obs(1, 0, 1, [[A, LIAR], [B, C]])]
    row = judge(Setting("liar-scale:10", "liar", (LIAR,), facts={"lied": False}), _steps(10), obs, 0, 10)
    assert row["refused_or_detected"] is None and "not tried" in row["evidence"]


def test_a_peer_planned_again_after_a_missed_heartbeat_was_not_evicted():
    back = [_obs(1, 0, 1, [[A, LIAR], [B, C]]), _obs(2, 4, 2, [[A], [B, C]]), _obs(3, 6, 3, [[A, LIAR], [B, C]])]
    row = judge(Setting("liar-noise", "liar", (LIAR,)), _steps(10), back, 0, 10)
    assert row["evicted"] is False and row["refused_or_detected"] is False
    assert evictions(back) == 0


def test_a_ban_counts_as_detection_even_before_the_plan_changes():
    obs = [_obs(1, 0, 1, [[A, LIAR], [B, C]]), _obs(2, 3, 1, [[A, LIAR], [B, C]], banned=(LIAR,))]
    row = judge(Setting("liar-scale:300", "liar", (LIAR,)), _steps(10), obs, 0, 10)
    assert row["refused_or_detected"] is True and row["detection_steps"] == 3


def test_a_stopped_or_short_run_is_reported_stopped():
    obs = [_obs(1, 0, 1, [[A, LIAR], [B, C]])]
    assert judge(Setting("liar-norm:-1e30", "liar", (LIAR,)), _steps(3), obs, 1, 10)["run_stopped"] is True
    assert judge(Setting("liar-norm:-1e30", "liar", (LIAR,)), _steps(3), obs, 0, 10)["run_stopped"] is True
    assert judge(Setting("liar-norm:-1e30", "liar", (LIAR,)), _steps(10), obs, None, 10)["run_stopped"] is True


def test_stranger_trainers_named_in_a_plan_succeeded_and_never_named_were_refused():
    s = Setting("stranger-trainers", "stranger", ("x1", "x2"), attack_step=3, attack_t=1.5)
    named = [_obs(1, 2, 1, [[A], [B]]), _obs(2, 4, 2, [[A], [B]], trainers=("t0", "x1"))]
    assert judge(s, _steps(10), named, 0, 10)["refused_or_detected"] is False
    kept_out = [_obs(1, 2, 1, [[A], [B]]), _obs(2, 4, 1, [[A], [B]])]
    row = judge(s, _steps(10), kept_out, 0, 10)
    assert row["refused_or_detected"] is True and row["detection_steps"] is None


def test_a_hijacked_plan_followed_by_honest_peers_succeeded():
    s = Setting("ground-key-planner", "stranger", ("00a",), 3, 1.5, {"hijack_version": 2})
    followed = [_obs(2, 4, 1, [[A], [B]], peers={A: [0, 2, "direct", None, 0.0], B: [1, 1, "direct", None, 0.0]})]
    assert judge(s, _steps(10), followed, 0, 10)["refused_or_detected"] is False
    ignored = [_obs(2, 4, 1, [[A], [B]], peers={A: [0, 1, "direct", None, 0.0], B: [1, 1, "direct", None, 0.0]})]
    assert judge(s, _steps(10), ignored, 0, 10)["refused_or_detected"] is True
    # the owner's planner publishes its own plan 2 later: honest peers announcing 2 then follow it, not the hijack
    own_plan = [_obs(2, 4, 2, [[A], [B]], peers={A: [0, 2, "direct", None, 0.0], B: [1, 2, "direct", None, 0.0]})]
    assert judge(s, _steps(10), own_plan, 0, 10)["refused_or_detected"] is True
    # readers accept a plan that names the attacker its trainer (an unowned run elected it): hijacked
    taken = [_obs(2, 4, 2, [["00a"], [B]], trainers=("00a",))]
    assert judge(s, _steps(10), taken, 0, 10)["refused_or_detected"] is False
    # the owner's planner plans the attacker at a stage, as it may any volunteer: not a hijack
    volunteer = [_obs(2, 4, 2, [["00a", A], [B]], peers={A: [0, 2, "direct", None, 0.0]})]
    assert judge(s, _steps(10), volunteer, 0, 10)["refused_or_detected"] is True
    nothing = Setting("ground-key-planner", "stranger", ("00a",), 3, 1.5, {})
    assert judge(nothing, _steps(10), ignored, 0, 10)["refused_or_detected"] is None  # could not be tried


def test_sybils_succeed_when_nobody_replans_after_the_planner_kill():
    s = Setting("sybils-planner-kill", "stranger", ("s1",), 3, 1.5, {"killed": A, "killed_at": 2.0})
    frozen = [_obs(1, 2, 1, [[A, C], [B, D]]), _obs(3, 5, 1, [[A, C], [B, D]])]
    assert judge(s, _steps(10), frozen, 0, 10)["refused_or_detected"] is False
    repaired = [*frozen, _obs(4, 6, 2, [[C], [B, D]])]
    assert judge(s, _steps(10), repaired, 0, 10)["refused_or_detected"] is True


def test_token_replay_is_refused_only_by_an_authentication_refusal():
    base = {"capture": "OK"}
    for replay, refused in (("OK", False), ("FAILED_PRECONDITION", False), ("UNAUTHENTICATED", True)):
        s = Setting("token-replay", "stranger", (), 3, 1.5, {**base, "replay": replay})
        assert judge(s, _steps(10), [], 0, 10)["refused_or_detected"] is refused, replay
    broken = Setting("token-replay", "stranger", (), 3, 1.5, {"capture": "PERMISSION_DENIED", "replay": "OK"})
    assert judge(broken, _steps(10), [], 0, 10)["refused_or_detected"] is None


def test_an_attacker_that_failed_is_not_counted_refused():
    s = Setting("stranger-trainers", "stranger", (), 3, 1.5, {"error": "TimeoutError: the DHT node did not start"})
    row = judge(s, _steps(10), [_obs(2, 4, 1, [[A], [B]])], 0, 10)
    assert row["refused_or_detected"] is None and "TimeoutError" in row["evidence"]


def test_held_streams_and_relay_fill_are_judged_by_their_effect():
    held = Setting("held-data-streams", "stranger", ("h",), 3, 1.5, {"streams": 48})
    assert judge(held, _steps(4), [], 1, 10)["refused_or_detected"] is False
    assert judge(held, _steps(10), [], 0, 10)["refused_or_detected"] is True
    relay = {"victim": "v9", "accepted": 48, "attaches": 48}
    reached = Setting("relay-slot-fill", "stranger", ("r",), 3, 1.5, {**relay, "probes": 5, "reachable": 2})
    assert judge(reached, _steps(10), [], 0, 10)["refused_or_detected"] is True
    shut_out = Setting("relay-slot-fill", "stranger", ("r",), 3, 1.5, {**relay, "probes": 5, "reachable": 0})
    assert judge(shut_out, _steps(10), [], 0, 10)["refused_or_detected"] is False
    unmeasured = Setting("relay-slot-fill", "stranger", ("r",), 3, 1.5, {**relay, "probes": 0, "reachable": 0})
    assert judge(unmeasured, _steps(10), [], 0, 10)["refused_or_detected"] is None


def test_clean_row_counts_evictions_and_both_throughputs():
    obs = [_obs(1, 0, 1, [[A, C], [B, D]]), _obs(2, 5, 2, [[A], [B, D]], peers={C: [None, 2, "direct", None, 0.0]})]
    rows = _steps(11)
    row = clean_row(judge(Setting("clean", "clean"), rows, obs, 0, 11), obs, rows, _steps(11)[::2], 8)
    assert row["evictions"] == 1  # C, still announced, left out of plan 2
    assert row["throughput_samples_s"] == pytest.approx(8.0) and row["throughput_no_verify_samples_s"] == 4.0
    assert set(CLEAN_KEYS) <= set(row)
    assert evictions(obs[:1]) == 0 and throughput(rows[:1], 8) is None


def test_a_clean_row_without_the_no_verify_run_leaves_the_cost_not_measured():
    rows, obs = _steps(11), []
    row = clean_row(judge(Setting("clean", "clean"), rows, obs, 0, 11), obs, rows, None, 8)
    assert row["throughput_samples_s"] > 0 and row["throughput_no_verify_samples_s"] is None
    cost = [c for c in targets([row]) if c.name.startswith("verification costs")]
    assert [c.verdict for c in cost] == ["not measured"]


def test_targets_and_report_say_what_was_measured():
    clean = {"setting": "clean", "refused_or_detected": None, "detection_steps": None, "evicted": False,
             "run_stopped": False, "steps": 10, "final_loss": 3.0, "evictions": 0, "throughput_samples_s": 9.5,
             "throughput_no_verify_samples_s": 10.0}  # fmt: skip
    caught = {**clean, "setting": "liar-noise", "refused_or_detected": True, "detection_steps": 4, "final_loss": 3.01}
    late = {**caught, "setting": "liar-scale:10", "detection_steps": 25}
    untried = {**caught, "setting": "token-replay", "refused_or_detected": None, "detection_steps": None}
    checks = {c.name.split(",")[0]: c for c in targets([clean, caught, late, untried])}
    every = checks["every attack refused"]
    assert every.verdict == "MISSED" and "liar-scale:10" in every.value and "token-replay" not in every.value
    assert checks["the run never stops"].verdict == "met"
    assert checks["final loss within 1% of the clean run"].verdict == "met"
    assert checks["verification costs at most 10% of throughput"].verdict == "met"
    assert targets([clean, caught])[0].verdict == "met"
    text = report_markdown([clean, caught], targets([clean, caught]), {"steps": 10}, ["loss.png"], ["a note"])
    assert "| liar-noise | True | 4 |" in text and "a note" in text and "loss.png" in text


def test_a_setting_the_harness_could_not_start_is_not_run_not_a_stopped_run():
    failed = Setting("liar-sign-flip", "liar", (LIAR,), 0, 0.0, {"lied": False}, "RuntimeError: no DHT node")
    row = judge(failed, [], [], None, 10)
    assert row["run_stopped"] is None and row["refused_or_detected"] is None and row["final_loss"] is None
    assert row["evidence"].startswith("not run") and "no DHT node" in row["evidence"]
    assert set(ROW_KEYS) <= set(row)
    assert judge(Setting("liar-noise", "liar", (LIAR,), error="late"), _steps(3), [], 1, 10)["run_stopped"]
    clean = {"setting": "clean", "refused_or_detected": None, "detection_steps": None, "evicted": False,
             "run_stopped": False, "steps": 10, "final_loss": 3.0, "evictions": 0, "throughput_samples_s": 9.5,
             "throughput_no_verify_samples_s": 10.0}  # fmt: skip
    caught = {**clean, "setting": "liar-noise", "refused_or_detected": True, "detection_steps": 1}
    checks = targets([clean, caught, row])
    assert [c.verdict for c in checks] == ["met where run"] * len(checks)
    assert all("not run: liar-sign-flip" in c.value for c in checks)


def test_observations_round_trip_through_json():
    o = _obs(1.5, 3, 2, [[A, B], [C]], banned=(D,), peers={A: [0, 2, "direct", None, 0.0]})
    assert Observation.from_json(o.to_json()) == o


def test_the_liar_is_a_middle_stage_peer_other_than_the_planner():
    peers = {A: [0, 1, "direct", None, 1e12], B: [1, 1, "direct", None, 0.0], C: [1, 1, "direct", None, 0.0]}
    obs = [_obs(1.0, 5, 1, [[A, D], [B, C], [LIAR]], peers=peers)]
    assert liar_choice(obs, 3, {B: "peer4", C: "peer1"}) == (4, B)
    two = [_obs(1.0, 5, 1, [[A, D], [B, C]], peers=peers)]
    assert liar_choice(two, 2, {A: "peer0", D: "peer3"}) == (3, D)  # stage 0, the planner A last
    assert liar_choice([], 3, {}) is None


def test_config_quick_and_settings():
    quick = AttacksRun(quick=True).config()
    assert quick.peers == 4 and quick.volunteers == 5 and quick.chosen() == ("clean", "liar-norm:nan")
    assert AttacksConfig(standbys=0).volunteers == 6
    assert AttacksConfig(settings="churn-control").chosen() == ("clean", "churn-control")
    with pytest.raises(ValueError, match="standbys"):
        AttacksConfig(standbys=-1)
    assert AttacksConfig(settings="token-replay").chosen() == ("clean", "token-replay")
    with pytest.raises(ValueError, match="unknown"):
        AttacksConfig(settings="clean,flood")
    with pytest.raises(ValueError):
        AttacksConfig(attack_at_step=30, steps=30)


class _Stage(torch.nn.Module):
    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.lin, self.is_first, self.is_last = torch.nn.Linear(4, 4), first, last

    def forward(self, x):
        return self.lin(x)


def _worker(first=False, last=False):
    from swarm.runtime.worker import StageWorker

    torch.manual_seed(0)
    return StageWorker(_Stage(first, last))


def test_lies_parse_and_refuse_nonsense():
    assert [str(parse_lie(lie)) for lie in LIES] == list(LIES)
    assert math.isnan(parse_lie("norm:nan").value)
    for bad in ("scale", "scale:x", "noise:3", "flood", "scale:inf"):
        with pytest.raises(ValueError):
            parse_lie(bad)


def test_each_lie_changes_what_the_worker_sends():
    x = torch.randn(2, 4)
    honest = _worker().forward(0, x)
    scaled = _worker()
    apply_lie(scaled, Lie("scale", 300.0))
    torch.testing.assert_close(scaled.forward(0, x), honest * 300)
    noisy = _worker()
    apply_lie(noisy, Lie("noise"))
    out = noisy.forward(0, x)
    assert torch.allclose(out.norm(), honest.norm()) and not torch.allclose(out, honest)

    flip, plain = _worker(), _worker()
    apply_lie(flip, Lie("sign-flip"))
    g = torch.ones(2, 4)
    flip.forward(0, x), plain.forward(0, x)
    torch.testing.assert_close(flip.backward(0, g), -plain.backward(0, g))

    lying = _worker()
    apply_lie(lying, Lie("norm", -1e30))
    assert lying.grad_sq_norm() == -1e30

    frozen = _worker()
    before = {k: v.clone() for k, v in frozen.module.state_dict().items()}
    apply_lie(frozen, Lie("no-update"))
    frozen.forward(0, x)
    frozen.backward(0, g)
    assert frozen.step() > 0 and frozen.step_count == 1
    for k, v in frozen.module.state_dict().items():
        assert torch.equal(v, before[k])


def test_sign_flip_on_the_first_stage_flips_its_own_gradients():
    first, plain = _worker(first=True), _worker(first=True)
    apply_lie(first, Lie("sign-flip"))
    x, g = torch.randn(2, 4), torch.ones(2, 4)
    for w in (first, plain):
        w.forward(0, x)
        w.backward(0, g)
    w0 = plain.module.lin.weight.detach().clone()
    first.step(1.0), plain.step(1.0)
    # AdamW's first step moves each weight by about lr against its gradient's sign: opposite directions
    assert torch.all(torch.sign(first.module.lin.weight - w0) == -torch.sign(plain.module.lin.weight - w0))


def test_one_attacker_node_signs_records_for_each_of_its_keys():
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord

    from swarm.experiments.adversaries import KeyPool, multi_key_signer, owner_of

    pool = KeyPool(max_keys=3)
    keys = [key for _, key in pool.below(None, 3)]
    assert len(keys) == 3 and len(pool.below("0", 5)) <= 3  # the grind stops at max_keys
    signer, checker = multi_key_signer(keys), RSASignatureValidator(keys[0])
    for key in keys:
        record = DHTRecord(b"run.peers", owner_of(key), b"value", 1e12)
        signed = DHTRecord(record.key, record.subkey, signer.sign_value(record), record.expiration_time)
        assert checker.validate(signed)  # a reader verifies it against the key in its subkey
    assert pool.below(min(pool.keys), 1) == []


def test_the_sybil_attack_waits_for_a_planner_lease_holder_to_kill():
    """On a loaded machine the 3 s lease is often lapsed at one look: the attack looks again until one holds it."""
    from types import SimpleNamespace

    from swarm.experiments.attacks import _kill_planner

    reads = iter([[], [SimpleNamespace(peer_id="p1", planner_until=5.0)]])
    dht = SimpleNamespace(peers=lambda: next(reads))
    left: list = []
    peer = SimpleNamespace(peer_id="p1")
    swarm = SimpleNamespace(live_peers=lambda: [peer], leave=lambda p, how: left.append((p.peer_id, how)))
    assert _kill_planner(swarm, dht, wait_s=5.0, now=lambda: 1.0) == "p1" and left == [("p1", "kill")]
    nobody = SimpleNamespace(peers=lambda: [SimpleNamespace(peer_id="p1", planner_until=0.5)])
    assert _kill_planner(swarm, nobody, wait_s=0.0, now=lambda: 1.0) is None, "a lapsed lease is nobody's"


def test_the_step_count_survives_the_trainer_closing_its_lines_into_the_csv(tmp_path, monkeypatch):
    """The eighth pass's ground-key-planner row: the trainer closed steps.jsonl into steps.csv between the
    observer's look at the lines and its read of them; the FileNotFoundError ended the setting as stopped, after
    120 of 120 steps. The count now falls back to the CSV, which is whole before the lines are removed."""
    from pathlib import Path

    from swarm.experiments.attacks import Observer
    from swarm.experiments.attacks_report import read_steps
    from swarm.train.steplog import StepLog

    log = StepLog(tmp_path, ["step", "train_loss", "step_s"])
    observer = Observer(None, 4, tmp_path, tmp_path / "observations.jsonl")
    assert observer.step_count() == 0 and read_steps(tmp_path) == []
    for step in (1, 2, 3):
        log.add({"step": step, "train_loss": 3.0, "step_s": 1.0})
    assert observer.step_count() == 3 and len(read_steps(tmp_path)) == 3
    log.add({"step": 4, "train_loss": 3.0, "step_s": 1.0})
    real_read = Path.read_text

    def closes_first(path, *args, **kwargs):  # the trainer exits just before the read
        if path.name == "steps.jsonl" and path.exists():
            log.close()
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", closes_first)
    assert observer.step_count() == 4
    assert not (tmp_path / "steps.jsonl").exists() and [int(r["step"]) for r in read_steps(tmp_path)] == [1, 2, 3, 4]


def test_a_no_verify_run_far_slower_than_the_verified_one_is_load_not_a_negative_cost():
    """The ninth pass: clean 4.61 samples/s, its no-verify twin 3.11 (the machine's load rose between them); the
    report said "met" with a cost of -48%. Beyond the machine's noise that is not a measurement."""
    base = {"setting": "clean", "refused_or_detected": None, "detection_steps": None, "evicted": False,
            "run_stopped": False, "steps": 10, "final_loss": 3.0, "evictions": 0}  # fmt: skip

    def verdict(on, off):
        row = {**base, "throughput_samples_s": on, "throughput_no_verify_samples_s": off}
        return next(c for c in targets([row]) if c.name.startswith("verification costs")).verdict

    assert verdict(4.61, 3.11) == "not measured"
    assert verdict(10.749, 11.275) == "met" and verdict(10.0, 9.5) == "met"  # 4.7%; -5%: noise, no cost
    assert verdict(8.0, 10.0) == "MISSED"
