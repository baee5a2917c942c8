"""Cost models: hand-computed cases, DT-FM's cost reproduced by ours, memory limits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from swarm.scheduler.cost import DtfmCost, FullCost, GroupStats, Layout, allocate_layers, even_layers
from swarm.scheduler.plans import ModelSpec, Peer, PlanInput
from swarm.scheduler.scenarios import load_scenario


def two_sites() -> PlanInput:
    """Peers 0, 1 in one site, 2, 3 in another: 1 ms and 1 GB/s inside, 50 ms and 100 MB/s across."""
    site = np.array([0, 0, 1, 1])
    same = site[:, None] == site[None, :]
    delay = np.where(same, 0.001, 0.05)
    bandwidth = np.where(same, 1e9, 1e8)
    np.fill_diagonal(delay, 0.0)
    peers = tuple(Peer(f"p{i}", 1e12, 1e10) for i in range(4))
    return PlanInput(peers, delay, bandwidth)


def test_dtfm_cost_hand_computed():
    cost = DtfmCost(two_sites(), activation_bytes=0.1e9, gradient_bytes=0.4e9, replicas=2)
    # Stage groups across sites, pipelines inside: all-reduce 2 * (0.05 + 0.4e9 / (1e8 * 2)) = 4.1 per group;
    # each pipeline link 0.001 + 0.1e9 / 1e9 = 0.101.  Total 4.1 + 2 * 0.101.
    across = Layout(np.array([[0, 2], [1, 3]]), np.ones(2))
    assert cost.evaluate(across).total_s == pytest.approx(4.1 + 2 * 0.101)
    # Stage groups inside sites, pipelines across: 2 * (0.001 + 0.4e9 / (1e9 * 2)) = 0.402; link 0.05 + 1 = 1.05.
    inside = Layout(np.array([[0, 1], [2, 3]]), np.ones(2))
    assert cost.evaluate(inside).total_s == pytest.approx(0.402 + 2 * 1.05)
    # DT-FM's cost of a partition takes its best pairing and order: the best of all partitions is `inside`.
    breakdown, layout = cost.complete([np.array([0, 1]), np.array([2, 3])])
    assert breakdown.total_s == pytest.approx(2.502)
    assert breakdown.sync_s == pytest.approx(0.402) and breakdown.transfer_s == pytest.approx(2.1)
    assert cost.evaluate(layout).total_s == pytest.approx(2.502)


def test_full_cost_hand_computed():
    # Two peers, one stage each: 10 and 20 TFLOP/s; 100 MB/s and 10 ms each way.
    delay = np.array([[0.0, 0.01], [0.01, 0.0]])
    bandwidth = np.array([[np.inf, 1e8], [1e8, np.inf]])
    swarm = PlanInput((Peer("slow", 10e12, 1e10), Peer("fast", 20e12, 1e10)), delay, bandwidth)
    model = ModelSpec(
        layers=3,
        flops_per_layer=1e12,
        forward_bytes=1e6,
        backward_bytes=2e6,
        gradient_bytes_per_layer=1e8,
        memory_bytes_per_layer=1e9,
        micro_batches=4,
    )
    layout = Layout(np.array([[0], [1]]), np.array([1, 2]))
    b = FullCost(swarm, dataclasses.replace(model, schedule="gpipe")).evaluate(layout)
    # compute: 1 layer / 10 TFLOP/s = 0.1 s and 2 layers / 20 TFLOP/s = 0.1 s per micro-batch
    # link: pace 1e6/1e8 + 2e6/1e8 = 0.03 s, fill adds 0.01 + 0.01 of latency
    # step: 0.2 + 0.05 + (4 - 1) * max(0.1, 0.03), no replicas so no all-reduce
    assert b.compute_s == pytest.approx(0.2)
    assert b.transfer_s == pytest.approx(0.03)
    assert b.latency_s == pytest.approx(0.02)
    assert b.steady_s == pytest.approx(0.3)
    assert b.sync_s == 0.0
    assert b.total_s == pytest.approx(0.55)
    # 1F1B: stage 0 holds 2 micro-batches, each back after 0.1 + 0.05 + 0.1 s: one per 0.125 s at best
    b = FullCost(swarm, model).evaluate(layout)
    assert b.pace_s == pytest.approx(0.125)
    assert b.total_s == pytest.approx(0.25 + 3 * 0.125)


def test_1f1b_round_trip_binds_only_past_the_in_flight_limit():
    # 3 equal stages (0.1 s each), free links: stage k's trip (0.1 * (3 - k)) / (3 - k) never exceeds 0.1
    n = 3
    swarm = PlanInput(tuple(Peer(f"p{i}", 1e12, 1e10) for i in range(n)), np.zeros((n, n)), np.full((n, n), 1e30))
    model = ModelSpec(layers=3, flops_per_layer=1e11, forward_bytes=0, backward_bytes=0,
                      gradient_bytes_per_layer=0, memory_bytes_per_layer=0, micro_batches=8)  # fmt: skip
    b = FullCost(swarm, model).evaluate(Layout(np.arange(n)[:, None], np.ones(n, dtype=np.int64)))
    assert b.pace_s == pytest.approx(0.1) and b.total_s == pytest.approx(0.3 + 7 * 0.1)
    # 50 ms each way between stages: stage 0's trip 0.3 + 2 * 0.1 over 3 in flight = 0.1667 s
    delay = np.where(np.eye(n, dtype=bool), 0.0, 0.05)
    b = FullCost(PlanInput(swarm.peers, delay, swarm.bandwidth_bytes_per_s), model).evaluate(
        Layout(np.arange(n)[:, None], np.ones(n, dtype=np.int64))
    )
    assert b.pace_s == pytest.approx(0.5 / 3)
    # 2 micro-batches: stages 0 and 1 hold them all, so only the last stage's trip (its own 0.1 s) counts
    slow = PlanInput(swarm.peers, delay, swarm.bandwidth_bytes_per_s)
    b2 = FullCost(slow, dataclasses.replace(model, micro_batches=2))
    assert b2.evaluate(Layout(np.arange(n)[:, None], np.ones(n, dtype=np.int64))).pace_s == pytest.approx(0.1)


def test_tied_exchange_waits_beside_the_averaging():
    # 2 stages at 1 MB/s both ways, 5 ms one way; 0.5 MB of tied gradient each way: 0.5 s + 10 ms
    eye = np.eye(2, dtype=bool)
    peers = (Peer("a", 1e12, 1e10), Peer("b", 1e12, 1e10))
    swarm = PlanInput(peers, np.where(eye, 0, 0.005), np.where(eye, np.inf, 1e6))
    model = ModelSpec(layers=2, flops_per_layer=0, forward_bytes=0, backward_bytes=0, gradient_bytes_per_layer=0,
                      memory_bytes_per_layer=0, micro_batches=1, tied_bytes=0.5e6, full_duplex=True)  # fmt: skip
    layout = Layout(np.array([[0], [1]]), np.array([1, 1]))
    b = FullCost(swarm, model).evaluate(layout)
    assert b.tied_s == pytest.approx(0.51) and b.total_s == pytest.approx(0.01 + 0.51)
    untied = FullCost(swarm, dataclasses.replace(model, tied_bytes=0.0)).evaluate(layout)
    assert untied.tied_s == 0.0 and untied.total_s == pytest.approx(0.01)


@pytest.mark.parametrize(("overlapped", "expected"), [(True, 0.02 + 4 / 3), (False, 0.04 + 4 / 3)])
def test_full_cost_all_reduce(overlapped, expected):
    # Three replicas of one stage, 10 ms and 100 MB/s between any two; 1 layer of 1e8 gradient bytes.
    n = 3
    delay = np.full((n, n), 0.01)
    np.fill_diagonal(delay, 0.0)
    swarm = PlanInput(tuple(Peer(f"p{i}", 1e12, 1e10) for i in range(n)), delay, np.full((n, n), 1e8))
    model = ModelSpec(
        layers=1,
        flops_per_layer=0.0,
        forward_bytes=0.0,
        backward_bytes=0.0,
        gradient_bytes_per_layer=1e8,
        memory_bytes_per_layer=0.0,
        micro_batches=3,
        overlapped_sync_latency=overlapped,
    )
    b = FullCost(swarm, model).evaluate(Layout(np.array([[0, 1, 2]]), np.array([1])))
    # Each replica sends and receives a 1e8 / 3 shard to and from both others: 2 * 2 * (1e8/3) / 1e8 = 4/3 s;
    # latency is the farthest round trip (20 ms) or the sum of both (40 ms).
    assert b.sync_s == pytest.approx(expected)


@pytest.mark.parametrize("name", ["datacenter", "worldwide"])
def test_full_model_reproduces_dtfm_cost(name):
    scenario = load_scenario(name)
    dtfm = DtfmCost(scenario.plan_input, scenario.activation_bytes, scenario.gradient_bytes, scenario.replicas)
    ours = FullCost(scenario.plan_input, ModelSpec.dtfm(scenario.activation_bytes, scenario.gradient_bytes))
    rng = np.random.default_rng(0)
    for _ in range(5):
        grid = rng.permutation(64).reshape(8, 8)
        layout = Layout(grid, np.ones(8))
        assert ours.evaluate(layout).total_s == pytest.approx(dtfm.evaluate(layout).total_s)
        _, completed = dtfm.complete(list(grid))
        assert ours.evaluate(completed).total_s == pytest.approx(dtfm.complete(list(grid))[0].total_s)


@pytest.mark.parametrize(("name", "expected"), [("datacenter", 19.8016), ("spot", 49.504)])
def test_dtfm_random_median_is_all_links_slow(name, expected):
    # With zero delay a random grid almost surely puts a cross-machine pair in every boundary and group, so
    # DT-FM's random scheduler costs 7 * 2 * gradient / bw + 2 * 7 * activation / bw: 19.80 s and 49.50 s,
    # also the largest cost any grid can have: DT-FM's quoted medians, under the sizes its code uses.
    scenario = load_scenario(name)
    cost = DtfmCost(scenario.plan_input, scenario.activation_bytes, scenario.gradient_bytes, 8)
    rng = np.random.default_rng(1)
    values = [cost.evaluate(Layout(rng.permutation(64).reshape(8, 8), np.ones(8))).total_s for _ in range(50)]
    assert np.median(values) == pytest.approx(expected)
    assert max(values) <= expected + 1e-9


def test_memory_limits_are_hard():
    stats = [
        GroupStats(speed_flops_per_s=100e12, max_layers=2, sync_table_s=np.zeros(9)),  # fast, little memory
        GroupStats(speed_flops_per_s=10e12, max_layers=8, sync_table_s=np.zeros(9)),
    ]
    layers = allocate_layers(stats, layers=8, flops_per_layer=1e12, steady=10, link_pace_s=0.0)
    assert layers.tolist() == [2, 6]  # speed alone would ask for about 7 and 1
    assert allocate_layers(stats[:1], layers=8, flops_per_layer=1e12, steady=10, link_pace_s=0.0) is None


def test_layout_over_memory_is_infeasible():
    swarm = PlanInput((Peer("a", 1e12, 2.5e9), Peer("b", 1e12, 1e10)), np.zeros((2, 2)), np.full((2, 2), 1e9))
    model = ModelSpec(
        layers=4,
        flops_per_layer=1e9,
        forward_bytes=1.0,
        backward_bytes=1.0,
        gradient_bytes_per_layer=1.0,
        memory_bytes_per_layer=1e9,
    )
    cost = FullCost(swarm, model)
    assert cost.evaluate(Layout(np.array([[0], [1]]), np.array([2, 2]))).total_s < np.inf
    assert cost.evaluate(Layout(np.array([[0], [1]]), np.array([3, 1]))).total_s == np.inf
    assert even_layers(7, 3).tolist() == [3, 2, 2]


def test_a_token_bucket_refills_while_the_link_idles_so_a_step_takes_its_bytes_over_the_rate():
    # 1 MB/s both ways, a 150 kB bucket; 4 micro-batches of 100 kB forward, 100 kB of tied gradient, 0.2 s of
    # optimizer and round trips: the link idles 0.2 s a step and refills, so the step is its 500 kB at the rate
    eye = np.eye(2, dtype=bool)
    peers = (Peer("a", 1e12, 1e10), Peer("b", 1e12, 1e10))
    swarm = PlanInput(peers, np.zeros((2, 2)), np.where(eye, np.inf, 1e6), np.where(eye, 0.0, 150e3))
    model = ModelSpec(layers=2, flops_per_layer=0, forward_bytes=100e3, backward_bytes=0, gradient_bytes_per_layer=0,
                      memory_bytes_per_layer=0, micro_batches=4, tied_bytes=100e3, full_duplex=True,
                      step_overhead_s=0.2)  # fmt: skip
    b = FullCost(swarm, model).evaluate(Layout(np.array([[0], [1]]), np.array([1, 1])))
    # phases: no fill (the bucket), 3 x 0.1 steady, the tied sum within the refilled bucket, 0.2 overhead = 0.5;
    # the rate: 4 x 100 kB + 100 kB = 0.5 s. (Adding the link time, the tied time and the overhead said 0.7.)
    assert b.tied_s == pytest.approx(0.0) and b.total_s == pytest.approx(0.5)
    slower = FullCost(swarm, dataclasses.replace(model, tied_bytes=400e3)).evaluate(
        Layout(np.array([[0], [1]]), np.array([1, 1]))
    )
    assert slower.total_s == pytest.approx(0.8)  # 400 + 400 kB at the rate binds


def test_each_end_puts_its_own_tied_bytes_on_its_own_direction():
    # 1 Mbit/s (125 kB/s) both ways, a 64 KiB bucket, 4 micro-batches: forward 5.8 kB a message and 4.8 kB of tied
    # gradient from stage 0; backward 5.2 kB and 14.1 kB of tied gradient from stage 1 (the figures the peers
    # measured in the throttled experiment's default cell). Direction 1 -> 0 binds: 4 x 5.2 + 14.1 = 34.9 kB.
    # One tied figure for both ends (the larger) read 4 x 5.8 + 14.1 = 37.3 kB on direction 0 -> 1: 7% too slow.
    eye = np.eye(2, dtype=bool)
    peers = (Peer("a", 1e12, 1e10), Peer("b", 1e12, 1e10))
    swarm = PlanInput(peers, np.zeros((2, 2)), np.where(eye, np.inf, 125e3), np.where(eye, 0.0, 65536.0))
    model = ModelSpec(layers=2, flops_per_layer=0, forward_bytes=5.8e3, backward_bytes=5.2e3,
                      gradient_bytes_per_layer=0, memory_bytes_per_layer=0, micro_batches=4, tied_bytes=4.8e3,
                      tied_bytes_last=14.1e3, full_duplex=True)  # fmt: skip
    layout = Layout(np.array([[0], [1]]), np.array([1, 1]))
    assert FullCost(swarm, model).evaluate(layout).total_s == pytest.approx((4 * 5.2e3 + 14.1e3) / 125e3)
    # the last stage's 14.1 kB fits the refilled bucket; 100 kB does not: its own direction waits, not the other
    big = FullCost(swarm, dataclasses.replace(model, tied_bytes_last=100e3)).evaluate(layout)
    assert big.tied_s == pytest.approx((100e3 - 65536) / 125e3)
    # None: both ends send `tied_bytes`, as before
    same = FullCost(swarm, dataclasses.replace(model, tied_bytes_last=None)).evaluate(layout)
    assert same.total_s == pytest.approx((4 * 5.8e3 + 4.8e3) / 125e3)
    with pytest.raises(ValueError):
        dataclasses.replace(model, tied_bytes_last=float("nan"))
