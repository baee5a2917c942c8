"""`swarm experiment hetero` end to end on a tiny model: three runs in lockstep, the planned one lowering the
slow stage's precision, every row carrying what the issue asks for."""

from __future__ import annotations

import pytest
import torch

from swarm.experiments.hetero import HeteroConfig, ModuleThrottle, run_experiment
from swarm.model.data import DataConfig
from swarm.model.gpt import ModelConfig
from swarm.scheduler.precision_choice import choose_precisions

pytestmark = [pytest.mark.timeout(120)]


def test_three_settings_same_seed_the_planned_one_lowers_the_slow_stage():
    cfg = HeteroConfig(
        model=ModelConfig(seq_len_tokens=16, hidden_dim=32, n_layers=2, n_heads=2),
        data=DataConfig(seq_len_tokens=16, train_samples=48, eval_samples=16),
        batch_size=8,
        n_micro=2,
        epochs=2,
        plan_fraction=0.3,
        budget=1.0,
    )
    rows = run_experiment(cfg, show_progress=False)
    assert [r["setting"] for r in rows] == ["equal", "slow-fp32", "slow-planned"]
    for r in rows:
        assert {"setting", "throughput_samples_s", "final_eval_loss", "precisions", "recovered"} <= set(r)
        assert r["throughput_samples_s"] > 0 and r["window_steps"] == 12 - round(12 * 0.3)
    equal, slow, planned = rows
    assert equal["final_eval_loss"] == slow["final_eval_loss"], "the throttle only sleeps: same training"
    assert slow["slept_s"] > 0 and equal["slept_s"] == 0
    # what the allocator chose from the figures it measured (on a model this small bf16 may not be faster here)
    measured = choose_precisions(planned["stage_times_s"], planned["sensitivity"], cfg.budget)
    assert planned["precisions"] == list(measured.precisions) and planned["why"] == measured.why
    times = planned["stage_times_s"][cfg.slow_stage]
    assert (planned["precisions"][cfg.slow_stage] == "bf16") == (times["bf16"] < times["fp32"])
    assert planned["sensitivity"][cfg.slow_stage]["bf16"] > 0
    assert abs(planned["loss_vs_slow_fp32"]) < 0.05


def test_the_throttle_sleeps_after_forward_and_backward_in_proportion_to_compute():
    lin = torch.nn.Linear(64, 64)
    throttle = ModuleThrottle(lin, 3.0)
    slept = []
    throttle.sleep = lambda s: slept.append(s)  # record, do not sleep
    x = torch.randn(32, 64, requires_grad=True)
    lin(x).sum().backward()
    assert len(slept) == 2 and all(s >= 0 for s in slept), "one pause after the forward, one after the backward"
    assert x.grad is not None and lin.weight.grad is not None, "gradients flow through the marks"
    with torch.no_grad():
        lin(x)
    assert len(slept) == 2, "evaluation is not slowed"
    throttle.remove()
    lin(x).sum().backward()
    assert len(slept) == 2
    with pytest.raises(ValueError):
        ModuleThrottle(lin, 0.5)


def test_the_planner_times_a_stage_through_its_throttle():
    """The planned setting's speed figures come from the live module, throttle included (a comparison of two
    stages' wall clocks is no test of that: under load all five passes of either may wait for a core, as one suite
    run saw, 2.3 ms against stage 0's 3.9)."""
    from types import SimpleNamespace

    from swarm.experiments.hetero import _stage_time
    from swarm.model.gpt import build_stage

    model = ModelConfig(seq_len_tokens=16, hidden_dim=32, n_layers=2, n_heads=2)
    module = build_stage(model, 1, 2, False, True)
    throttle = ModuleThrottle(module, 2.0)
    slept = []
    throttle.sleep = lambda s: slept.append(s)  # record, do not sleep
    pipe = SimpleNamespace(hosts=[None, SimpleNamespace(worker=SimpleNamespace(module=module))])
    x, targets = torch.randn(2, 16, 32), torch.randint(0, model.vocab_size, (2, 16))
    assert _stage_time(pipe, 1, x, targets, "fp32") > 0
    assert len(slept) == 12, "a pause after each forward and each backward of its six passes"
