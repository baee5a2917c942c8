"""DT-FM's cost conventions, each pinned by a hand-computed case (scheduler.py, random_scheduler.py, config.py).

Checked against a line-by-line reading of DT-FM's published scheduler: its cost of a grid and ours agree to
rounding on every scenario, so these tests guard the conventions rather than fix a difference.
"""

from __future__ import annotations

import numpy as np
import pytest

from swarm.scheduler.baselines import random_layouts
from swarm.scheduler.cost import DtfmCost, Layout
from swarm.scheduler.plans import Peer, PlanInput
from swarm.scheduler.scenarios import load_scenario


def _swarm(delay_s: np.ndarray, bandwidth_bytes_per_s: np.ndarray) -> PlanInput:
    peers = tuple(Peer(f"p{i}", 1e12, 1e10) for i in range(len(delay_s)))
    return PlanInput(peers, delay_s, bandwidth_bytes_per_s)


def _scenario_cost(name: str) -> DtfmCost:
    s = load_scenario(name)
    return DtfmCost(s.plan_input, s.activation_bytes, s.gradient_bytes, s.replicas)


def test_units_are_decimal_gigabytes_over_gigabits_and_milliseconds():
    # compute_data_parallel_cost / bipartite_matching: size_GB * 8 / bandwidth_Gbps + delay_ms / 1e3.
    dc = _scenario_cost("datacenter")
    assert dc.link_s[0, 1] == pytest.approx(0.47125 * 8 / 100)  # same instance: 0.0377 s
    assert dc.link_s[0, 8] == pytest.approx(0.47125 * 8 / 3.125)  # across instances: 1.2064 s
    assert dc.allreduce_s[0, 8] == pytest.approx(2 * 0.65 * 8 / (3.125 * 8))  # 0.416 s per partner
    world = _scenario_cost("worldwide")
    seoul, ireland = 32, 56
    assert world.link_s[seoul, ireland] == pytest.approx(0.228 + 0.47125 * 8 / 0.335)
    assert world.link_s[seoul, seoul + 1] == pytest.approx(0.005 + 0.47125 * 8 / 2)
    regional = _scenario_cost("regional")
    assert regional.allreduce_s[0, 1] == pytest.approx(2 * (0.005 + 0.65 * 8 / (2 * 8)))


def test_scenario_matrices_follow_the_schedulers_config():
    # config.py (what scheduler.py imports), not generate_sim_com_matrices.py (10 ms inside a region).
    world = load_scenario("worldwide").plan_input
    assert world.delay_s[0, 1] == pytest.approx(0.005)
    assert world.bandwidth_bytes_per_s[0, 1] == pytest.approx(2e9 / 8)
    spot = load_scenario("spot").plan_input
    assert spot.bandwidth_bytes_per_s[0, 3] == pytest.approx(100e9 / 8)  # inside one 4-GPU spot instance
    assert spot.bandwidth_bytes_per_s[3, 4] == pytest.approx(1.25e9 / 8)  # next instance
    assert spot.bandwidth_bytes_per_s[32, 33] == pytest.approx(1.25e9 / 8)  # standalone GPUs
    campus = load_scenario("multi-universities").plan_input
    assert campus.delay_s[0, 1] == pytest.approx(0.001) and campus.delay_s[0, 32] == pytest.approx(0.011)


def test_all_reduce_sums_over_partners_and_divides_by_group_size():
    # Three replicas, 10 ms apart; 0-1 at 100 MB/s, the other pairs at 200 MB/s; 0.6 GB of gradients.
    delay = np.full((3, 3), 0.01)
    np.fill_diagonal(delay, 0.0)
    bandwidth = np.array([[np.inf, 1e8, 2e8], [1e8, np.inf, 2e8], [2e8, 2e8, np.inf]])
    cost = DtfmCost(_swarm(delay, bandwidth), activation_bytes=0.0, gradient_bytes=0.6e9, replicas=3)
    # member 0: 2 (0.01 + 0.6e9 / (1e8 * 3)) + 2 (0.01 + 0.6e9 / (2e8 * 3)) = 4.02 + 2.02 (a sum, not a max)
    assert cost.group_cost(np.array([0, 1, 2])) == pytest.approx(6.04)


def _three_groups() -> DtfmCost:
    """Groups A = {0, 1}, B = {2, 3}, C = {4, 5}; no delay, no gradients, activation 1e8 bytes."""
    seconds = np.full((6, 6), 0.1)  # link times inside groups (never used)
    for (i, j), t in {(0, 2): 0.5, (1, 3): 5.0, (0, 3): 3.0, (1, 2): 3.0}.items():  # A - B
        seconds[i, j] = seconds[j, i] = t
    seconds[np.ix_([0, 1], [4, 5])] = seconds[np.ix_([4, 5], [0, 1])] = 10.0  # A - C
    seconds[np.ix_([2, 3], [4, 5])] = seconds[np.ix_([4, 5], [2, 3])] = 1.0  # B - C
    return DtfmCost(_swarm(np.zeros((6, 6)), 1e8 / seconds), activation_bytes=1e8, gradient_bytes=0.0, replicas=2)


def test_pipeline_cost_is_bottleneck_pairing_and_best_open_path():
    cost = _three_groups()
    a, b, c = np.array([0, 1]), np.array([2, 3]), np.array([4, 5])
    # Bottleneck matching: 0-3 and 1-2 (worst 3 s), not the min-sum pairing 0-2, 1-3 (worst 5 s).
    value, perm = cost.boundary(a, b)
    assert value == pytest.approx(3.0) and perm.tolist() == [1, 0]
    # Open path over the groups, any start: A-B-C = 3 + 1, not the given order A-C-B = 10 + 1.
    breakdown, layout = cost.complete([a, c, b])
    assert breakdown.total_s == pytest.approx(2 * 4.0)
    assert cost.evaluate(layout).total_s == pytest.approx(8.0)


def test_random_baseline_keeps_order_and_pairs_columns():
    # random_scheduler.py: stages in drawn order, replica j of one stage sends to replica j of the next.
    cost = _three_groups()
    drawn = Layout(np.array([[0, 1], [4, 5], [2, 3]]), np.ones(3))  # A, C, B: links 10 then 1
    assert cost.evaluate(drawn).total_s == pytest.approx(2 * (10.0 + 1.0))
    unmatched = Layout(np.array([[0, 1], [2, 3], [4, 5]]), np.ones(3))  # pairs 0-2 (0.5) and 1-3 (5)
    assert cost.evaluate(unmatched).total_s == pytest.approx(2 * (5.0 + 1.0))
    # Every draw is one shuffle of all peers cut into consecutive stage blocks.
    for layout in random_layouts(64, 8, 8, 8, count=3, seed=0):
        assert sorted(layout.grid.ravel().tolist()) == list(range(64))


def test_datacenter_by_hand():
    cost = _scenario_cost("datacenter")
    # One GPU of every instance per stage: all-reduce 7 x 0.416, pipelines inside instances 2 x 7 x 0.0377
    # (3.440 s: DT-FM's quoted best).
    strided = [np.arange(i, 64, 8) for i in range(8)]
    assert cost.complete(strided)[0].total_s == pytest.approx(2.912 + 0.5278)
    # One instance per stage: all-reduce 7 x 0.013, every boundary crosses instances 2 x 7 x 1.2064.
    blocks = [np.arange(i, i + 8) for i in range(0, 64, 8)]
    assert cost.complete(blocks)[0].total_s == pytest.approx(0.091 + 16.8896)
