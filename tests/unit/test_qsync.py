"""QSync's per-peer precision: the allocator, the sensitivity indicator, the plan's `precisions`, the
announced per-precision speeds, and a stage switching precision with fp32 master weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from swarm.daemon.capacity import low_precisions, measure_speeds
from swarm.model.gpt import ModelConfig
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement, PlanRecord, validate_plan
from swarm.runtime.sensitivity import (
    MAX_SENSITIVITY,
    layer_sensitivities,
    measure_sensitivity,
    set_stage_precision,
    validate_sensitivity,
)
from swarm.runtime.worker import StageConfig, StageWorker
from swarm.scheduler.precision_choice import choose_precisions, plan_precisions, stage_times

LOW = {"bf16": 1e-4}


# ---- the allocator ---------------------------------------------------------------------------------------


def test_the_slow_stage_gets_the_lower_precision_when_the_budget_allows():
    times = [{"fp32": 1.0, "bf16": 0.5}, {"fp32": 2.0, "bf16": 0.9}, {"fp32": 1.0, "bf16": 0.5}]
    got = choose_precisions(times, [LOW] * 3, budget=1e-4)
    assert got.precisions == ("fp32", "bf16", "fp32")
    assert got.step_s == pytest.approx(1.0) and got.fp32_step_s == pytest.approx(2.0)
    assert got.spent == pytest.approx(1e-4)


def test_the_budget_is_respected_and_spent_where_it_moves_the_bottleneck():
    times = [{"fp32": 1.0, "bf16": 0.5}, {"fp32": 2.0, "bf16": 0.9}]
    sens = [{"bf16": 3e-4}, {"bf16": 1e-4}]
    tight = choose_precisions(times, sens, budget=2e-4)
    assert tight.precisions == ("fp32", "bf16") and tight.spent <= 2e-4
    loose = choose_precisions(times, sens, budget=1e-3)
    assert loose.precisions == ("bf16", "bf16"), "after the slow stage, the other one paces the step"
    assert loose.spent == pytest.approx(4e-4) and loose.step_s == pytest.approx(0.9)
    none = choose_precisions(times, sens, budget=0.0)
    assert none.precisions == ("fp32", "fp32") and none.spent == 0.0


def test_no_change_when_lowering_precision_does_not_move_the_bottleneck():
    # two stages equally slow and a budget for one: lowering one leaves the step as long
    times = [{"fp32": 2.0, "bf16": 1.0}, {"fp32": 2.0, "bf16": 1.0}]
    got = choose_precisions(times, [LOW, LOW], budget=1e-4)
    assert got.precisions == ("fp32", "fp32") and got.spent == 0.0
    # bf16 not faster on the slow stage (a device without a fast bf16 path)
    times = [{"fp32": 1.0, "bf16": 0.5}, {"fp32": 2.0, "bf16": 2.0}]
    assert choose_precisions(times, [LOW, LOW], budget=1.0).precisions == ("fp32", "fp32")


def test_recovery_raises_stages_whose_lower_precision_no_longer_pays():
    # the slow stage needs bf16; the other stage's bf16 would not shorten the step beyond the slow stage's bf16
    times = [{"fp32": 1.0, "bf16": 0.6}, {"fp32": 3.0, "bf16": 1.2}]
    got = choose_precisions(times, [LOW, LOW], budget=1.0)
    assert got.precisions == ("fp32", "bf16"), "stage 0's fp32 (1.0) is under the new bottleneck (1.2)"


def test_the_allocator_refuses_malformed_figures():
    with pytest.raises(ValueError):
        choose_precisions([{"fp32": 1.0}], [LOW, LOW])
    with pytest.raises(ValueError):
        choose_precisions([{"fp32": math.nan}], [LOW])
    with pytest.raises(ValueError):
        choose_precisions([{"bf16": 1.0}], [LOW])
    with pytest.raises(ValueError):
        choose_precisions([{"fp32": 1.0}], [LOW], budget=-1.0)
    # a stage without a sensitivity for bf16 is never lowered
    assert choose_precisions([{"fp32": 2.0, "bf16": 1.0}], [{}], budget=1.0).precisions == ("fp32",)


def peer(pid: str, speed: float, bf16: float | None = None) -> PeerAnnouncement:
    speeds = (("bf16", bf16),) if bf16 else ()
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, speed, speeds=speeds)


def test_the_live_planner_hook_plans_from_announced_speeds():
    stages = [
        {"layer_start": 0, "layer_end": 2, "peer_ids": ["a"]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": ["b", "c"]},
    ]
    peers = {"a": peer("a", 20.0, 40.0), "b": peer("b", 20.0, 40.0), "c": peer("c", 10.0, 25.0)}
    times = stage_times(stages, peers, ("bf16",))
    assert times[1] == {"fp32": pytest.approx(0.2), "bf16": pytest.approx(0.08)}, "the slowest replica paces"
    assert plan_precisions(stages, peers, [LOW, LOW], budget=1e-4) == ("fp32", "bf16")
    assert plan_precisions(stages, peers, [LOW, LOW], budget=1e-3) == ("bf16", "bf16")
    assert plan_precisions(stages, peers, None) is None, "no sensitivity known: today's behaviour"
    peers["c"] = peer("c", 10.0)  # a replica that announced no bf16 speed: its stage stays fp32
    assert plan_precisions(stages, peers, [LOW, LOW]) is None


# ---- sensitivity -----------------------------------------------------------------------------------------


class Steep(nn.Module):
    """A linear layer behind a steep tanh: bf16's rounding of the linear output moves tanh' a lot."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(20 * self.lin(x))


def test_sensitivity_orders_constructed_layers():
    torch.manual_seed(0)
    norm, linear, steep = nn.LayerNorm(16), nn.Linear(16, 16), Steep()
    x = [torch.randn(8, 16) for _ in range(2)]
    s = [measure_sensitivity(m, x)["bf16"] for m in (norm, linear, steep)]
    assert s[0] == 0.0, "autocast keeps layer_norm in fp32: nothing added"
    assert 0 < s[1] < s[2] / 10 < MAX_SENSITIVITY, "the steep layer's gradient suffers far more"
    per_layer = layer_sensitivities([norm, linear, steep], x[0])
    assert per_layer[0] < per_layer[1] < per_layer[2]
    assert linear.weight.grad is None, "the stage's gradients are left as they were"
    with pytest.raises(ValueError):
        measure_sensitivity(linear, x, ("fp32",))
    with pytest.raises(ValueError):
        measure_sensitivity(linear, [])


def test_a_reported_sensitivity_is_checked_whole():
    assert validate_sensitivity({"bf16": 1e-4}) == {"bf16": 1e-4}
    assert validate_sensitivity([("bf16", 0), ("fp16", 2e-3)]) == {"bf16": 0.0, "fp16": 2e-3}
    for bad in (
        {"bf16": math.nan},
        {"bf16": -1.0},
        {"bf16": MAX_SENSITIVITY * 2},
        {"fp32": 0.0},
        {"int4": 0.1},
        {"bf16": "0.1"},
        [("bf16", 0.1), ("bf16", 0.2)],
        [("bf16", 0.1, 3)],
        [("bf16", 0.1)] * 9,
    ):
        with pytest.raises(ValueError):
            validate_sensitivity(bad)


# ---- the plan's precisions -------------------------------------------------------------------------------

PEERS = [PeerAnnouncement(p, "127.0.0.1:5000", "cpu", 1 << 30, 1.0) for p in ("p0", "p1")]
STAGES = [
    {"layer_start": 0, "layer_end": 2, "peer_ids": ["p0"]},
    {"layer_start": 2, "layer_end": 4, "peer_ids": ["p1"]},
]


def record(**extra) -> PlanRecord:
    return PlanRecord(version=2, document={"stages": STAGES, **extra}, created_at=1.0)


def test_a_plan_with_valid_precisions_or_none_passes():
    validate_plan(record(), 4, PEERS)
    validate_plan(record(precisions=["fp32", "bf16"]), 4, PEERS)
    validate_plan(record(precisions=["fp16", "fp16"]), 4, PEERS)


@pytest.mark.parametrize(
    "bad",
    [
        ["bf16"],  # wrong length
        ["bf16", "bf16", "bf16"],
        ["fp32", "int4"],  # unknown name
        ["fp32", None],
        ["fp32", 16],
        "bf16,bf16",  # not a list
        {"0": "bf16"},
        ["fp16", "fp32"],  # fp16's loss scale must be agreed by every stage
    ],
)
def test_a_plan_with_bad_precisions_is_refused(bad):
    with pytest.raises(ValueError, match="precisions"):
        validate_plan(record(precisions=bad), 4, PEERS)


def test_a_peer_computes_its_stage_in_its_plan_precision():
    plan = PlanDocument.from_wire({"stages": STAGES, "precisions": ["fp32", "bf16"]})
    assert plan.precision(1, "fp32") == "bf16"
    assert plan.precision(0, "bf16") == "fp32"
    assert PlanDocument.from_wire({"stages": STAGES}).precision(1, "fp16") == "fp16", "no precisions: --precision"


# ---- announced speeds ------------------------------------------------------------------------------------


def test_speeds_travel_on_the_wire_and_strangers_cannot_send_bad_ones():
    a = PeerAnnouncement("p0", "127.0.0.1:5000", "cpu", 1 << 30, 10.0, speeds=(("bf16", 21.5),))
    wire = a.to_wire()
    assert wire["speeds"] == "bf16:21.5"
    assert PeerAnnouncement.from_wire(wire) == a
    old = {k: v for k, v in wire.items() if k != "speeds"}
    assert PeerAnnouncement.from_wire(old).speeds == (), "an announcement from before speeds"
    for bad in ("bf16:nan", "bf16:-1", "bf16:inf", "int8:3", "fp32:3", "bf16:1 bf16:2", "bf16", "x" * 4096, 7):
        with pytest.raises(ValueError, match="speeds"):
            PeerAnnouncement.from_wire({**wire, "speeds": bad})
    with pytest.raises(ValueError, match="speeds"):
        PeerAnnouncement("p0", "127.0.0.1:5000", "cpu", 1, 1.0, speeds=(("bf16", 1.0),) * 5)


def test_a_cpu_peer_measures_bf16_and_no_int8():
    assert low_precisions("cpu") == ("bf16",)
    tiny = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=1, n_heads=2)
    speeds = dict(measure_speeds(tiny, "cpu", micro_batch_size=1, iters=2))
    assert set(speeds) == {"bf16"} and speeds["bf16"] > 0


# ---- switching a stage's precision -----------------------------------------------------------------------


def _tiny_worker() -> StageWorker:
    from swarm.model.spec import build_stage

    model = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2)
    return StageWorker(build_stage(model, 0, 1, False, False), StageConfig())


def test_a_stage_switches_precision_between_steps_and_keeps_fp32_master_weights():
    worker = _tiny_worker()
    seen = []
    linear = next(m for m in worker.module.modules() if isinstance(m, nn.Linear))
    linear.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    x = torch.randn(2, 8, 16)

    def step():
        worker.forward(0, x)
        worker.backward(0, torch.ones(2, 8, 16))
        worker.step()

    step()
    assert seen[-1] == torch.float32
    assert set_stage_precision(worker, "bf16") and not set_stage_precision(worker, "bf16")
    step()
    assert seen[-1] == torch.bfloat16, "the stage's matmuls run in bf16"
    assert all(p.dtype == torch.float32 for p in worker.module.parameters()), "master weights stay fp32"
    state = worker.optimizer.state[linear.weight]
    assert state["exp_avg"].dtype == torch.float32
    assert worker.scaler is None and worker.loss_scale == 1.0
    worker.forward(0, x)
    with pytest.raises(RuntimeError, match="in flight"):
        set_stage_precision(worker, "fp32")
    assert worker.precision == "bf16", "nothing changed"
    worker.backward(0, torch.ones(2, 8, 16))
    worker.step()
    assert set_stage_precision(worker, "fp16") and worker.scaler is not None
    assert set_stage_precision(worker, "fp32") and worker.scaler is None
    with pytest.raises(ValueError):
        set_stage_precision(worker, "int8")


def test_the_planner_measures_stage_sensitivities_and_plans_with_them():
    from swarm.daemon.peer_config import PlanningConfig
    from swarm.scheduler.precision_choice import precision_planner

    assert precision_planner(ModelConfig(), 0.0) is None, "off by default: today's behaviour"
    with pytest.raises(ValueError, match="precision_budget"):
        PlanningConfig(precision_budget=math.nan)
    tiny = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2)
    choose = precision_planner(tiny, 1.0, micro_batch_size=1)
    stages = [
        {"layer_start": 0, "layer_end": 1, "peer_ids": ["a"]},
        {"layer_start": 1, "layer_end": 2, "peer_ids": ["b"]},
    ]
    assert choose(stages, [peer("a", 40.0, 60.0), peer("b", 10.0, 25.0)]) == ("fp32", "bf16")
    strict = precision_planner(tiny, 1e-12, micro_batch_size=1)
    assert strict(stages, [peer("a", 40.0, 60.0), peer("b", 10.0, 25.0)]) is None, "over the budget: fp32"


def test_a_convergence_setting_names_stages_computed_in_bf16():
    from swarm.experiments.convergence import Setting
    from swarm.experiments.hetero import apply_stage_precisions, split_stage_precisions
    from swarm.runtime.inprocess import LocalPipeline

    s = Setting.parse("fp32/fp32~bf16:1")
    assert s.name == "fp32/fp32~bf16:1" and s.stage_precisions == ((1, "bf16"),) and s.forward.name == "fp32"
    assert Setting.parse("fp32/fp32@w1~bf16:0:1").stage_precisions == ((0, "bf16"), (1, "bf16"))
    assert Setting.parse("fp32/fp32").stage_precisions == ()
    for bad in ("fp32/fp32~int8:1", "fp32/fp32~bf16", "fp32/fp32~bf16:x", "fp32/fp32~bf16:-1"):
        with pytest.raises(ValueError):
            split_stage_precisions(bad)
    pipe = LocalPipeline(ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2), 2)
    try:
        apply_stage_precisions(pipe, ((1, "bf16"),))
        assert [h.worker.precision for h in pipe.hosts] == ["fp32", "bf16"]
        with pytest.raises(ValueError):
            apply_stage_precisions(pipe, ((2, "bf16"),))
    finally:
        pipe.close()
