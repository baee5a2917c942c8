"""Precision under a loss budget chosen inside the placement search (issue 29 item 7): every shape's best layout is
re-priced with the precisions chosen for it, so a shape whose bottleneck a lower precision lifts can win."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.peers.records import PeerAnnouncement
from swarm.scheduler.bits import measured_link_ladder
from swarm.scheduler.cost import FullCost, Layout
from swarm.scheduler.plans import ModelSpec, Peer, PlanInput
from swarm.scheduler.precision_choice import precision_planner
from swarm.scheduler.relays import plan_relayed, with_speeds
from swarm.scheduler.search import search_full
from swarm.scheduler.sizes import model_spec
from tests.unit.daemon.test_planner_versions import planner as make_planner
from tests.unit.scheduler.test_bits import A, B, fake_dht, measured

SPEC = ModelSpec(
    layers=4,
    flops_per_layer=1e9,
    forward_bytes=1e3,
    backward_bytes=1e3,
    gradient_bytes_per_layer=1e7,  # replicas of one stage would sum 0.32 s a step: two stages, or A alone
    memory_bytes_per_layer=0.0,
    micro_batches=4,
    full_duplex=True,
)


def two_peers() -> PlanInput:
    """A computes 10 ms a layer in fp32 (no faster precision); B 50 ms in fp32, 12.5 ms in bf16. 1 Gbit/s links."""
    rate = np.where(np.eye(2, dtype=bool), np.inf, 1e9 / 8)
    delay = np.where(np.eye(2, dtype=bool), 0.0, 1e-4)
    return PlanInput((Peer("A", 1e11, 1e12), Peer("B", 2e10, 1e12)), delay, rate, np.zeros((2, 2)))


def bf16_on_b(layout: Layout):
    """B's stage lowered to bf16 (4x), wherever B is placed; None when B is not used."""
    if 1 not in layout.grid:
        return None
    return np.array([1e11, 8e10])


def test_a_shape_a_lower_precision_makes_quicker_wins_and_is_priced_at_it():
    plan_input = two_peers()
    cost = FullCost(plan_input, SPEC)
    fp32 = search_full(cost, plan_input)
    assert fp32.layout.grid.tolist() == [[0]], "in fp32 A alone is quickest: B would pace a pipeline at 50 ms a layer"
    chosen = search_full(cost, plan_input, speeds_for=bf16_on_b)
    assert sorted(chosen.layout.grid.ravel().tolist()) == [0, 1] and chosen.layout.stages == 2
    again = FullCost(with_speeds(plan_input, [1e11, 8e10]), SPEC).evaluate(chosen.layout).total_s
    assert chosen.breakdown.total_s == pytest.approx(again), "priced at the speeds its precisions give"
    assert chosen.breakdown.total_s < fp32.breakdown.total_s
    relayed = plan_relayed(plan_input, SPEC, {}, speeds_for=bf16_on_b)
    assert relayed.step_time_s == pytest.approx(again) and relayed.n_stages == 2


def test_without_a_faster_precision_the_search_is_unchanged():
    plan_input = two_peers()
    cost = FullCost(plan_input, SPEC)
    plain, unchanged = search_full(cost, plan_input), search_full(cost, plan_input, speeds_for=lambda layout: None)
    assert unchanged.layout.grid.tolist() == plain.layout.grid.tolist()
    assert unchanged.breakdown.total_s == plain.breakdown.total_s


def announce(pid: str, fp32: float, bf16: float | None = None) -> PeerAnnouncement:
    speeds = (("bf16", bf16),) if bf16 else ()
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, fp32, speeds=speeds)


def test_the_live_planner_prices_the_precisions_it_publishes():
    tiny = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2)
    spec = model_spec(tiny, CodecConfig.parse("fp32"), CodecConfig.parse("fp32"))
    peers = [announce(A, 40.0), announce(B, 10.0, 40.0)]
    ladder = replace(spec, link_ladder=measured_link_ladder(tiny, 2))  # per-link: codecs and epilogue chosen too
    for planned in (spec, ladder):
        published = {}
        for budget in (None, 1.0):
            dht, out = fake_dht({"peers": list(peers)}, measured(1000.0))
            hook = precision_planner(tiny, budget, micro_batch_size=1) if budget else None
            make_planner(dht, planned, precisions=hook).round()
            published[budget] = out[0][1]
        assert "precisions" not in published[None] or not published[None]["precisions"]
        assert "probe_sensitivity" not in published[None], "no precisions planned: no stage spends compute probing"
        assert published[1.0]["probe_sensitivity"] is True, "the stages measure what the precisions are chosen from"
        with_bf16 = published[1.0]
        b_stage = next(i for i, st in enumerate(with_bf16["stages"]) if B in st["peer_ids"])
        assert with_bf16["precisions"][b_stage] == "bf16"
        assert with_bf16["step_time_s"] < published[None]["step_time_s"], "B's stage priced at its bf16 speed"
