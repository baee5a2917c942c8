"""Plan inputs, plans and scenarios: JSON round trips, validation, packaged data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from swarm.scheduler.plans import Breakdown, ModelSpec, Peer, Plan, PlanInput, StagePlan, TransformerShape
from swarm.scheduler.scenarios import SCENARIO_NAMES, load_scenario, scenario_data, synthetic_worldwide


def test_plan_input_json_round_trip(tmp_path):
    swarm = synthetic_worldwide(10, seed=1)
    path = tmp_path / "swarm.json"
    swarm.save(path)
    back = PlanInput.load(path)
    assert back.peers == swarm.peers
    np.testing.assert_array_equal(back.delay_s, swarm.delay_s)
    np.testing.assert_array_equal(back.bandwidth_bytes_per_s, swarm.bandwidth_bytes_per_s)


def test_plan_input_accepts_friendly_units():
    data = {
        "peers": [
            {"peer_id": "a", "compute_flops_per_s": 1e12, "memory_bytes": 1e10},
            {"peer_id": "b", "compute_flops_per_s": 2e12, "memory_bytes": 1e10},
        ],
        "delay_ms": [[0, 20], [20, 0]],
        "bandwidth_gbps": [[0, 1], [1, 0]],
    }
    swarm = PlanInput.from_dict(json.loads(json.dumps(data)))
    assert swarm.delay_s[0, 1] == pytest.approx(0.02)
    assert swarm.bandwidth_bytes_per_s[0, 1] == pytest.approx(125e6)


@pytest.mark.parametrize(
    "bad",
    [
        {"delay_s": np.zeros((2, 3))},
        {"bandwidth_bytes_per_s": np.zeros((2, 2))},
        {"peers": (Peer("a", 1.0, 1.0), Peer("a", 1.0, 1.0))},
    ],
)
def test_plan_input_validates(bad):
    args = {
        "peers": (Peer("a", 1.0, 1.0), Peer("b", 1.0, 1.0)),
        "delay_s": np.zeros((2, 2)),
        "bandwidth_bytes_per_s": np.ones((2, 2)),
    }
    with pytest.raises(ValueError):
        PlanInput(**{**args, **bad})


def test_plan_json_round_trip():
    plan = Plan(
        stages=(StagePlan(0, 3, ("a", "b")), StagePlan(3, 8, ("c", "d"))),
        breakdown=Breakdown(total_s=1.5, compute_s=0.5, sync_s=1.0),
        cost_model="full",
        version=2,
        unused_peer_ids=("e",),
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.n_stages == 2 and plan.n_replicas == 2
    with pytest.raises(ValueError):
        Plan.from_dict({**plan.to_dict(), "format": 99})


def test_scenarios_ship_with_the_package():
    assert "region_pairs" in scenario_data() and len(scenario_data()["scenarios"]) == 6
    for index, name in enumerate(SCENARIO_NAMES):
        by_name, by_index = load_scenario(name), load_scenario(str(index))
        assert by_name.name == by_index.name == name
        assert by_name.plan_input.n_peers == 64
    worldwide = load_scenario("4_worldwide").plan_input
    regions = [p.region for p in worldwide.peers]
    tokyo, london = regions.index("Tokyo"), regions.index("London")
    assert worldwide.delay_s[tokyo, london] == pytest.approx(0.210)
    assert worldwide.bandwidth_bytes_per_s[tokyo, london] == pytest.approx(0.366e9 / 8)
    with pytest.raises(ValueError):
        load_scenario("mars")


def test_transformer_figures():
    spec = ModelSpec.transformer(TransformerShape(layers=2, hidden=64, seq_len=32, micro_batch_size=2))
    assert spec.forward_bytes == 2 * 32 * 64 * 4 / 8
    assert spec.backward_bytes == 2 * 32 * 64 * 8 / 8
    assert spec.gradient_bytes_per_layer == (12 * 64 * 64 + 13 * 64) * 8 / 8
    assert spec.flops_per_layer == 4 * (24 * 2 * 32 * 64 * 64 + 4 * 2 * 32 * 32 * 64)
    with pytest.raises(ValueError):
        TransformerShape(layers=0)
