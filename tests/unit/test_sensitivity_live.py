"""QSync live: a training stage measures its sensitivity from its real gradients (`SensitivityProbe`) without
changing what it trains, the peer announces it (`PeerAnnouncement.sensitivity`, `SensitivityReport`), the planner
plans with the announced figures (median over replicas, clamped, its own where none) and re-chooses a followed
plan's precisions when they change (`PrecisionWatch`); a slow peer is made of a normal one (`ComputeThrottle`)."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.daemon.precision_watch import PrecisionWatch
from swarm.daemon.sensitivity_report import SensitivityReport
from swarm.model.gpt import ModelConfig
from swarm.model.spec import build_stage
from swarm.peers.plan import PlanDocument, PlanStage
from swarm.peers.records import MAX_SENSITIVITY, PeerAnnouncement
from swarm.runtime.sensitivity import gradient_sensitivity, measure_sensitivity
from swarm.runtime.sensitivity_probe import ProbeConfig, SensitivityProbe
from swarm.runtime.throttle import ComputeThrottle
from swarm.runtime.worker import OptimConfig, StageConfig, StageWorker
from swarm.scheduler.precision_choice import CLAMP_FACTOR, announced_sensitivities, precision_planner

TINY = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=3, n_heads=2)


def _workers(first: bool, last: bool, probe: ProbeConfig | None):
    out = []
    for with_probe in (False, True):
        torch.manual_seed(0)
        start = 0 if first else 1
        module = build_stage(TINY, start, 3 if last else start + 1, first, last)
        worker = StageWorker(module, StageConfig(OptimConfig(warmup_steps=1)))
        if with_probe:
            worker.probe = SensitivityProbe(probe)
        out.append(worker)
    return out


def _train(worker: StageWorker, steps: int, first: bool, last: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for mb in range(2):
            tokens = torch.randint(0, TINY.vocab_size, (2, 8), generator=gen)
            x = tokens if first else torch.randn(2, 8, 16, generator=gen)
            worker.forward(mb, x, targets=tokens if last else None)
            grad = torch.tensor(0.5) if last else torch.randn(2, 8, 16, generator=gen)
            worker.backward(mb, grad)
        worker.step()


@pytest.mark.parametrize("first,last", [(True, False), (False, False), (False, True)])
def test_a_probed_stage_trains_bit_for_bit_as_an_unprobed_one(first, last):
    plain, probed = _workers(first, last, ProbeConfig(every_steps=2, settle_probes=2, later_every_steps=3))
    _train(plain, 7, first, last)
    _train(probed, 7, first, last)
    for a, b in zip(plain.module.parameters(), probed.module.parameters(), strict=True):
        assert torch.equal(a, b), "the probe puts the step's gradients back: training is unchanged"
    probe = probed.probe
    assert probe.probes == 4, "steps 0 and 2 while settling, then every 3: 3 and 6"
    figures = probe.figures()
    assert set(figures) == {"bf16"} and 0 < figures["bf16"] < 0.1, figures


def test_the_probe_runs_on_its_schedule_once_per_step():
    probe = SensitivityProbe(ProbeConfig(every_steps=2, settle_probes=2, later_every_steps=5))
    linear = torch.nn.Linear(4, 4)
    taken = []
    for step in range(12):
        probe.capture(step, 1, torch.randn(3, 4), None)  # not micro-batch 0: never
        probe.capture(step, 0, torch.randn(3, 4), None)
        if probe.measure(step, 0, linear, torch.randn(3, 4)) is not None:
            taken.append(step)
        assert probe.measure(step, 0, linear, torch.randn(3, 4)) is None, "once per step"
    assert taken == [0, 2, 5, 10]
    assert linear.weight.grad is None
    assert SensitivityProbe(ProbeConfig(every_steps=0)).due(0) is False
    for bad in (dict(every_steps=-1), dict(later_every_steps=0), dict(precisions=("fp32",)), dict(precisions=())):
        with pytest.raises(ValueError):
            ProbeConfig(**bad)


def test_an_abandoned_capture_is_not_measured_with_another_steps_gradient():
    probe = SensitivityProbe(ProbeConfig(every_steps=1))
    linear = torch.nn.Linear(4, 4)
    probe.capture(0, 0, torch.randn(3, 4), None)
    assert probe.measure(1, 0, linear, torch.randn(3, 4)) is None, "captured for step 0, not 1"
    assert probe.figures() == {}


def test_real_gradient_sensitivity_agrees_with_the_synthetic_one_and_bounds_overflow():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 32)
    x = torch.randn(16, 32)
    real = gradient_sensitivity(linear, x, torch.randn(16, 32))["bf16"]
    synthetic = measure_sensitivity(linear, [x])["bf16"]
    assert 0 < real < 1e-2 and 1 / 10 < real / synthetic < 10
    held = torch.ones_like(linear.weight)
    linear.weight.grad = held
    bad = gradient_sensitivity(linear, x, torch.full((16, 32), math.nan))
    assert bad == {"bf16": MAX_SENSITIVITY}, "a NaN gradient reads as the most sensitive, never as NaN"
    assert linear.weight.grad is held


# ---- the announcement ------------------------------------------------------------------------------------


def test_sensitivity_travels_on_the_wire_and_bad_figures_are_refused():
    a = PeerAnnouncement("p0", "127.0.0.1:5000", "cpu", 1, 1.0, sensitivity=((0, 2, "bf16", 1.5e-4),))
    wire = a.to_wire()
    assert wire["sensitivity"] == "0:2:bf16:0.00015" and PeerAnnouncement.from_wire(wire) == a
    old = {k: v for k, v in wire.items() if k != "sensitivity"}
    assert PeerAnnouncement.from_wire(old).sensitivity == (), "an announcement from before sensitivity"
    for bad in (
        "0:2:bf16:nan",
        "0:2:bf16:inf",
        "0:2:bf16:-1e-4",
        "0:2:bf16:1e9",
        "2:2:bf16:0.1",
        "0:2:fp32:0.1",
        "0:2:bf16:0.1 0:2:bf16:0.2",
        "0:2:bf16",
        "x" * 4096,
        7,
    ):
        with pytest.raises(ValueError, match="sensitivity"):
            PeerAnnouncement.from_wire({**wire, "sensitivity": bad})


def test_a_refused_announcement_names_its_signer():
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.peers.entries import _announcement, peer_id_of

    key = RSAPrivateKey()
    public = key.get_public_key().to_bytes()
    subkey = b"[owner:" + public + b"]"
    owner = peer_id_of(public)
    wire = PeerAnnouncement(owner, "127.0.0.1:5000", "cpu", 1, 1.0).to_wire()
    assert _announcement(subkey, wire)[0].peer_id == owner
    with pytest.raises(ValueError, match=f"from {owner}: PeerAnnouncement.sensitivity"):
        _announcement(subkey, {**wire, "sensitivity": "0:2:bf16:nan"})


class _Host:
    def __init__(self, start: int, end: int, figures: dict[str, float]):
        self.role = type("Role", (), {"layer_start": start, "layer_end": end})()
        probe = type("Probe", (), {"figures": lambda self: dict(figures)})()
        self.worker = type("Worker", (), {"probe": probe})()


def test_the_peer_announces_a_first_figure_new_layers_and_real_moves_only():
    now = [0.0]
    report = SensitivityReport(min_interval_s=5.0, rel_change=0.25, clock=lambda: now[0])
    assert report.entries(None) is None and report.entries(_Host(0, 2, {})) is None, "nothing measured yet"
    assert report.entries(_Host(0, 2, {"bf16": 1e-4})) == ((0, 2, "bf16", 1e-4),)
    assert report.entries(_Host(0, 2, {"bf16": 1e-4})) is None, "unchanged"
    now[0] = 10.0
    assert report.entries(_Host(0, 2, {"bf16": 1.1e-4})) is None, "a 10% move is noise"
    now[0] = 11.0
    assert report.entries(_Host(0, 2, {"bf16": 2e-4})) == ((0, 2, "bf16", 2e-4),)
    now[0] = 12.0
    assert report.entries(_Host(0, 2, {"bf16": 9e-4})) is None, "within min_interval_s of the last one"
    assert report.entries(_Host(2, 4, {"bf16": 3e-4})) == ((2, 4, "bf16", 3e-4),), "a new role: at once"


# ---- the planner -----------------------------------------------------------------------------------------


def _peer(pid: str, speed: float, bf16: float, sens: tuple = ()) -> PeerAnnouncement:
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, speed, speeds=(("bf16", bf16),), sensitivity=sens)


STAGES = [
    {"layer_start": 0, "layer_end": 2, "peer_ids": ["a"]},
    {"layer_start": 2, "layer_end": 4, "peer_ids": ["b", "c", "d"]},
]


def test_announced_figures_are_the_median_of_a_stages_peers_clamped_and_named():
    own = [{"bf16": 1e-4}, {"bf16": 1e-4}]
    peers = {
        "a": _peer("a", 10, 20, ((0, 2, "bf16", 3e-4), (2, 4, "bf16", 9.0))),  # stage 1's layers: not its stage
        "b": _peer("b", 10, 20, ((2, 4, "bf16", 2e-4),)),
        "c": _peer("c", 10, 20, ((2, 4, "bf16", 0.0),)),  # a liar: clamped
        "d": _peer("d", 10, 20, ((2, 4, "bf16", 5e-4),)),
    }
    got, notes = announced_sensitivities(STAGES, peers, own)
    assert got[0] == {"bf16": 3e-4}
    assert got[1] == {"bf16": 2e-4}, "the median of (clamped 1e-6, 2e-4, 5e-4)"
    assert "announced by 3 peer(s)" in notes[1] and "c's bf16 0 clamped" in notes[1]
    liar_alone = {**peers, "b": _peer("b", 10, 20), "d": _peer("d", 10, 20)}
    got, _ = announced_sensitivities(STAGES, liar_alone, own)
    assert got[1] == {"bf16": pytest.approx(1e-4 / CLAMP_FACTOR)}, "one liar moves its stage by the clamp at most"
    quiet = {pid: _peer(pid, 10, 20) for pid in "abcd"}
    got, notes = announced_sensitivities(STAGES, quiet, own)
    assert got == own and all("the planner's own" in n for n in notes)


def test_the_planner_plans_with_the_announced_sensitivity_over_its_own():
    model = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2)
    stages = [
        {"layer_start": 0, "layer_end": 1, "peer_ids": ["a"]},
        {"layer_start": 1, "layer_end": 2, "peer_ids": ["b"]},
    ]
    from swarm.runtime.sensitivity import stage_sensitivity

    own = stage_sensitivity(model, 1, 2, micro_batch_size=1)["bf16"]
    choose = precision_planner(model, 2 * own, micro_batch_size=1)
    quiet = [_peer("a", 40.0, 60.0), _peer("b", 10.0, 25.0)]
    assert choose(stages, quiet) == ("fp32", "bf16"), "its own figure is within the budget"
    loud = [_peer("a", 40.0, 60.0), _peer("b", 10.0, 25.0, ((1, 2, "bf16", 10 * own),))]
    assert choose(stages, loud) is None, "the stage measured itself over the budget: fp32"
    calm = [_peer("a", 40.0, 60.0), _peer("b", 10.0, 25.0, ((1, 2, "bf16", own / 10),))]
    assert precision_planner(model, own / 2, micro_batch_size=1)(stages, calm) == ("fp32", "bf16")


class _Planner:
    def __init__(self, record):
        self.published, self.record = [], record
        self.spec = type("Spec", (), {"layers": 4})()
        self.dht = self

    def next_version(self, peers):
        return self.record.version + 1

    def publish_plan(self, version, document):
        self.published.append((version, document))

    def get_plan(self, layers, **kwargs):
        return self.published[-1]


def test_the_watch_switches_a_followed_plans_precision_when_the_choice_changes():
    from swarm.peers.records import PlanRecord

    stages = [
        {"layer_start": 0, "layer_end": 2, "peer_ids": ["a"]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": ["b"]},
    ]
    plan = PlanDocument.from_wire({"stages": stages, "precisions": ["fp32", "fp32"]})
    record = PlanRecord(version=3, document=plan.to_wire(), created_at=1.0)
    answer = [("fp32", "bf16")]
    now = [0.0]
    watch = PrecisionWatch(lambda s, p: answer[0], hold_s=10.0, clock=lambda: now[0])
    planner = _Planner(record)
    assert watch.round(planner, record, []) is None, "held at start-up"
    now[0] = 10.0
    version, doc = watch.round(planner, record, [])
    assert version == 4 and doc.precisions == ("fp32", "bf16") and doc.stages == plan.stages
    now[0] = 15.0
    answer[0] = None
    assert watch.round(planner, record, []) is None, "one switch per hold_s"
    lowered = PlanDocument.from_wire({"stages": stages, "precisions": ["fp32", "bf16"]})
    assert watch.rechosen(lowered, []) == ("fp32", "fp32"), "fp32 everywhere wins again: back up"
    assert watch.rechosen(plan, []) is None and watch.rechosen(PlanDocument.from_wire({"stages": stages}), []) is None
    answer[0] = ("fp32", "bf16")
    assert watch.rechosen(lowered, []) is None, "already so"


# ---- a slower peer ---------------------------------------------------------------------------------------


def test_the_throttle_sleeps_in_proportion_to_each_calls_compute_and_can_be_removed():
    worker = StageWorker(build_stage(TINY, 1, 2, False, False))
    plain_forward = worker.forward
    throttle = ComputeThrottle(worker, 3.0)
    slept = []
    throttle.sleep = lambda s: slept.append(s)  # record, do not sleep
    worker.forward(0, torch.randn(2, 8, 16))
    worker.backward(0, torch.randn(2, 8, 16))
    assert len(slept) == 2 and all(s >= 0 for s in slept)
    throttle.remove()
    assert worker.forward == plain_forward
    with pytest.raises(ValueError):
        ComputeThrottle(worker, 0.5)
    with pytest.raises(ValueError):
        ComputeThrottle(worker, math.nan)


def test_a_peer_refuses_a_slowdown_below_one():
    from swarm.daemon.peer_config import PeerConfig

    assert PeerConfig(compute_slowdown=2.5).compute_slowdown == 2.5
    for bad in (0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="compute_slowdown"):
            PeerConfig(compute_slowdown=bad)
    with pytest.raises(ValueError, match="sensitivity_every_steps"):
        PeerConfig(sensitivity_every_steps=-1)


def test_a_plan_asks_its_stages_to_probe_only_with_true_and_keeps_the_ask_on_a_repack():
    stages = [{"layer_start": 0, "layer_end": 1, "peer_ids": ["A" * 52]}, {"layer_start": 1, "layer_end": 3}]
    stages[1]["peer_ids"] = ["B" * 52]
    plain = PlanDocument.from_wire({"stages": stages})
    assert plain.probe_sensitivity is None and "probe_sensitivity" not in plain.to_wire()
    asking = PlanDocument.from_wire({"stages": stages, "probe_sensitivity": True})
    assert asking.probe_sensitivity is True and asking.to_wire()["probe_sensitivity"] is True
    assert PlanDocument.from_wire(asking.to_wire()) == asking
    for bad in (False, 1, "true", [True], {}):
        with pytest.raises(ValueError, match="probe_sensitivity"):
            PlanDocument.from_wire({"stages": stages, "probe_sensitivity": bad})
    merged = asking.with_stages([PlanStage(0, 3, ("A" * 52,))])  # another stage count: the ask is not the stages'
    assert merged.probe_sensitivity is True and merged.n_stages == 1


def test_a_peer_probes_only_where_its_plan_asks_and_its_flag_allows():
    from swarm.runtime.host import StageRole
    from tests.unit.scheduler.test_bits import bare_daemon

    stages = [{"layer_start": 0, "layer_end": 2, "peer_ids": ["A" * 52]}]
    stages.append({"layer_start": 2, "layer_end": 4, "peer_ids": ["B" * 52]})
    plain = PlanDocument.from_wire({"stages": stages})
    asking = plain.replace(probe_sensitivity=True)
    daemon = bare_daemon()
    daemon.cfg.sensitivity_every_steps = 3
    role = StageRole(1, 2, 2, 4, 3)
    assert daemon._make_host(role).worker.probe is None, "no plan yet (an even split): nobody to read the figure"
    assert daemon._make_host(role, plain).worker.probe is None, "a plan whose planner plans no precisions"
    host = daemon._make_host(role, asking)
    probe = host.worker.probe
    assert isinstance(probe, SensitivityProbe) and probe.cfg.every_steps == 3
    daemon._probe_as_asked(host.worker, asking.replace(version=2))
    assert host.worker.probe is probe, "a plan that still asks keeps the probe and its figures"
    daemon._probe_as_asked(host.worker, plain)
    assert host.worker.probe is None, "the ask withdrawn (same stages): the probe goes between two steps"
    daemon.cfg.sensitivity_every_steps = 0
    assert daemon._make_host(role, asking).worker.probe is None, "--sensitivity-every-steps 0: never"
