"""Codecs chosen inside the placement search (issue 29 item 7): the cost model prices each pair of peers at its
link's quickest codec (`ModelSpec.link_ladder`), so the search places peers knowing which codec each link would get,
and the planner's per-link choice afterwards agrees with what the search priced."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.peers.records import PeerAnnouncement
from swarm.scheduler.bits import (
    BACKWARD_LADDER,
    FORWARD_LADDER,
    BitsPolicy,
    LinkFigures,
    choose_link,
    link_ladder,
    measured_link_ladder,
)
from swarm.scheduler.cost import FullCost, Layout, link_rungs
from swarm.scheduler.exhaustive import exhaustive_full
from swarm.scheduler.plans import LinkLadder, LinkRung, ModelSpec, Peer, PlanInput
from swarm.scheduler.search import SearchConfig, search_full
from swarm.scheduler.sizes import measure_link_rungs, model_spec
from tests.unit.daemon.test_planner_versions import planner as make_planner
from tests.unit.scheduler.test_bits import A, B, fake_dht, measured

FP32, FLOOR = 131072.0, 8192.0  # one micro-batch's message in fp32 and at a 16x floor
LADDER = LinkLadder(
    (LinkRung("fp32", FP32), LinkRung("acsgd2", FLOOR)), (LinkRung("fp32", FP32), LinkRung("gradq2", FLOOR))
)


def spec(ladder: LinkLadder | None) -> ModelSpec:
    """4 layers of 1 GFLOP a micro-batch (1 GB of memory each: a peer of `swarm` holds at most 2), 4 micro-batches,
    fp32 boundaries as configured."""
    return ModelSpec(
        layers=4,
        flops_per_layer=1e9,
        forward_bytes=FP32,
        backward_bytes=FP32,
        gradient_bytes_per_layer=0.0,
        memory_bytes_per_layer=1e9,
        micro_batches=4,
        full_duplex=True,
        link_ladder=ladder,
    )


def swarm() -> PlanInput:
    """A and B compute 10 ms a layer but are joined by a 2 Mbit/s link; C computes 100 ms a layer on 1 Gbit/s links;
    each holds 2 of the model's 4 layers."""
    speeds = (1e11, 1e11, 1e10)
    rate = np.array([[np.inf, 2e6, 1e9], [2e6, np.inf, 1e9], [1e9, 1e9, np.inf]]) / 8
    delay = np.where(np.eye(3, dtype=bool), 0.0, 1e-3)
    peers = tuple(Peer(name, s, 2.5e9) for name, s in zip("ABC", speeds, strict=True))
    return PlanInput(peers, delay, rate, np.zeros((3, 3)))


def test_each_pair_is_priced_at_its_quickest_rung_the_most_precise_on_ties():
    inverse = np.array([[0.0, 1 / 250e3, 1 / 125e9], [1 / 250e3, 0.0, 1 / 125e9], [1 / 125e9, 1 / 125e9, 0.0]])
    coded = LinkLadder((LinkRung("fp32", FP32, 1e-4), LinkRung("q", FLOOR, 2e-3)), LADDER.backward)
    sizes, coding, rung = link_rungs(spec(coded), "forward", inverse)
    assert rung[0, 1] == 1 and sizes[0, 1] == FLOOR, "a slow link takes the floor: its bytes decide"
    assert rung[0, 2] == 0 and sizes[0, 2] == FP32 and coding[0, 2] == 1e-4, "a fast one: coding the floor costs more"
    fixed, none, unset = link_rungs(spec(None), "forward", inverse)
    assert (fixed == FP32).all() and (none == 0).all() and (unset == -1).all(), "without a ladder: the configured codec"
    tie = LinkLadder((LinkRung("fp32", FLOOR), LinkRung("q", FLOOR)), LADDER.backward)
    assert (link_rungs(spec(tie), "forward", inverse)[2] == 0).all(), "equal times: the more precise"


def test_the_search_places_peers_knowing_which_codec_each_link_gets():
    plan_input = swarm()
    after = search_full(FullCost(plan_input, spec(None)), plan_input)  # placed at the configured fp32
    inside = search_full(FullCost(plan_input, spec(LADDER)), plan_input)
    used = {int(p) for p in inside.layout.grid.ravel()}
    assert used == {0, 1}, "A and B: their slow link carries the floor's 8 kB, not fp32's 128 kB"
    assert 2 in {int(p) for p in after.layout.grid.ravel()}, "priced at fp32, the slow link is avoided: C computes"
    # choosing codecs after placing is worse: the fp32-placed layout, its links then given their quickest codecs
    then = FullCost(plan_input, spec(LADDER)).evaluate(after.layout).total_s
    assert inside.breakdown.total_s < 0.8 * then, (inside.breakdown.total_s, then)
    optimum, _ = exhaustive_full(FullCost(plan_input, spec(LADDER)))
    assert inside.breakdown.total_s == pytest.approx(optimum.total_s, rel=1e-9), "the optimum over every layout"


def test_the_rate_bound_counts_each_links_own_codec():
    plan_input = swarm()
    cost = FullCost(plan_input, spec(LADDER))
    layout = Layout(np.array([[0], [1]]), np.array([2, 2]))
    # 4 micro-batches of 8 kB each way on the 2 Mbit/s link: 4 x 8192 / 250e3 s
    assert cost.rate_bound_s(layout.grid) == pytest.approx(4 * FLOOR / 250e3)
    fixed = FullCost(plan_input, spec(None)).rate_bound_s(layout.grid)
    assert fixed == pytest.approx(4 * FP32 / 250e3)


def test_with_coding_time_a_link_nothing_hides_takes_its_quickest_codec():
    sizes = {label: 1e5 / 2**i for ladder in (FORWARD_LADDER, BACKWARD_LADDER) for i, label in enumerate(ladder)}
    slow_coding = {label: (1e-4 if label == "fp32" else 5e-3) for label in sizes}
    fast = LinkFigures(1e10, 1e10, compute_s=1e-6)  # no message hides under 1 us of compute
    plain = choose_link(fast, sizes.__getitem__)
    assert (plain.forward_label, plain.backward_label) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC)
    assert "at the floor" in plain.why
    coded = choose_link(fast, sizes.__getitem__, coding_s=slow_coding.__getitem__)
    assert (coded.forward_label, coded.backward_label) == ("fp32", "fp32") and "the quickest" in coded.why
    slow = LinkFigures(1e5, 1e5, compute_s=1e-6)  # 1 s for fp32: the bytes decide
    floor = choose_link(slow, sizes.__getitem__, coding_s=slow_coding.__getitem__)
    assert (floor.forward_label, floor.backward_label) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC)


def test_measured_rungs_price_a_delta_at_its_steady_bytes_and_every_codec_costs_time():
    shape = (2, 16, 32)
    figures = measure_link_rungs(("fp32", "acsgd2+ch+nr", "gradq2+ef+rot+nr+cs+g256"), shape, repeats=1)
    fp32 = 4 * np.prod(shape)
    assert 0.8 * fp32 < figures["fp32"][0] <= fp32 + 256, "fp32: its elements and a frame"
    assert figures["acsgd2+ch+nr"][0] < fp32 / 8, "a 2-bit delta, not its 16-bit first sight"
    assert all(coding > 0 for _, coding in figures.values())


def test_a_ladder_stops_at_the_policys_floors():
    figures = {label: (1000.0 / (i + 1), 1e-4) for i, label in enumerate((*FORWARD_LADDER, *BACKWARD_LADDER))}
    ladder = link_ladder(figures.__getitem__)
    assert [r.label for r in ladder.forward] == list(FORWARD_LADDER[: FORWARD_LADDER.index(DEFAULT_FORWARD_CODEC) + 1])
    assert [r.label for r in ladder.backward][-1] == DEFAULT_BACKWARD_CODEC
    deeper = link_ladder(figures.__getitem__, BitsPolicy(forward_floor=FORWARD_LADDER[-1]))
    assert deeper.forward[-1].label == FORWARD_LADDER[-1]
    with pytest.raises(KeyError):
        ladder.rung("nope")
    with pytest.raises(ValueError):
        LinkRung("fp32", 0.0)
    with pytest.raises(ValueError):
        LinkRung("fp32", 1.0, float("nan"))


def test_a_per_link_planner_prices_and_publishes_its_links_from_the_measured_ladder():
    model = ModelConfig()
    configured = model_spec(model, CodecConfig.parse("fp32"), CodecConfig.parse("fp32"))
    ladder = measured_link_ladder(model, 2)

    def records() -> dict:
        return {"peers": [PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, 40.0) for pid in (A, B)]}

    dht, published = fake_dht(records(), measured(1.0))
    make_planner(dht, replace(configured, link_ladder=ladder)).round()
    ((_, plan),) = published
    codecs = plan["codecs"][0]
    assert (codecs["forward"], codecs["backward"]) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC), codecs
    # the prediction is the floor's: at 1 Mbit/s fp32 messages alone would take 4 x 121 kB / 125 kB/s a step
    fp32_s = 4 * ladder.rung("fp32").message_bytes / 125e3
    assert plan["step_time_s"] < fp32_s / 4, (plan["step_time_s"], fp32_s)
    dht2, published2 = fake_dht(records(), measured(1.0))
    make_planner(dht2, configured).round()  # fixed codecs: no ladder, no codecs in the plan, fp32 predicted
    assert "codecs" not in published2[0][1] or not published2[0][1]["codecs"]
    assert published2[0][1]["step_time_s"] > fp32_s * 0.9


def test_the_flags_codecs_are_the_per_link_floors_and_fp32_flags_compress_nothing():
    from dataclasses import replace as changed

    from swarm.options import CodecFlags
    from swarm.scheduler.bits import flags_policy, ladder_rung

    default = CodecFlags().build()
    policy = flags_policy(default["fw_codec"], default["bw_codec"])
    assert (policy.forward_floor, policy.backward_floor) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC)
    local = changed(default["fw_codec"], zstd_level=3, seed=7)  # a peer's own options: still the same rung
    assert ladder_rung(local, FORWARD_LADDER) == DEFAULT_FORWARD_CODEC
    fp32 = CodecFlags("fp32", "fp32").build()
    nothing = flags_policy(fp32["fw_codec"], fp32["bw_codec"])
    assert (nothing.forward_floor, nothing.backward_floor, nothing.average_floor, nothing.tied_floor) == ("fp32",) * 4
    four = CodecFlags("acsgd4+ch+nr", DEFAULT_BACKWARD_CODEC).build()
    assert flags_policy(four["fw_codec"], four["bw_codec"]).forward_floor == "acsgd4+ch+nr"
    off = CodecFlags("aqsgd2", "gradq4").build()  # not on the ladders: per-link leaves the links at the flags
    assert flags_policy(off["fw_codec"], off["bw_codec"]) is None
    assert ladder_rung(CodecConfig.parse("gradq2+ef"), BACKWARD_LADDER) is None


def test_swarm_plan_per_link_compares_choosing_codecs_inside_the_search_with_after_it():
    from swarm.scheduler.localsearch import AnnealConfig
    from swarm.scheduler.plan_cli import describe_per_link, per_link_plan
    from swarm.scheduler.plans import TransformerShape

    shape = TransformerShape(layers=4, hidden=128, seq_len=128, micro_batch_size=2, micro_batches=4)
    flops = ModelSpec.transformer(shape).flops_per_layer
    plan_input = swarm()  # A and B fast, joined by a slow link; C slow on fast links; 2 of the 4 layers each
    memory = ModelSpec.transformer(shape).stage_memory_bytes(2, 2, 1) + 1e5
    speeds = (flops / 0.01, flops / 0.01, flops / 0.1)
    peers = tuple(Peer(p.peer_id, s, memory) for p, s in zip(plan_input.peers, speeds, strict=True))
    plan_input = PlanInput(peers, plan_input.delay_s, plan_input.bandwidth_bytes_per_s, plan_input.burst_bytes)
    fp32 = TransformerShape(**{**shape.__dict__, "forward_bits": 32.0, "backward_bits": 32.0})
    made, compared = per_link_plan(plan_input, fp32, SearchConfig(anneal=AnnealConfig(moves=200)))
    assert compared["inside_step_s"] == pytest.approx(made.step_time_s)
    assert compared["inside_step_s"] < 0.8 * compared["after_step_s"] <= compared["placed_step_s"], compared
    assert compared["codecs"] and all("/" in c for c in compared["codecs"])
    assert "codecs chosen inside the search" in describe_per_link(compared)
