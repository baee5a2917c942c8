"""What the planner charges a tunnel (swarm.scheduler.relays: `TunnelCost`, `tunnelled_messages`): a fixed cost per
message into an unreachable peer, the trainer's calls included, so the ends of a pipeline avoid NAT'd peers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from swarm.scheduler import ModelSpec, Peer, PlanInput, SearchConfig, plan
from swarm.scheduler.cost import FullCost, Layout
from swarm.scheduler.relays import (
    TUNNEL_CALL_S,
    TunnelCost,
    plan_relayed,
    price,
    relay_extra_s,
    tunnelled_messages,
)

CFG = SearchConfig(seed=0, stages=4, max_replicas=1, replica_fractions=(1.0,))


def _model(**kw) -> ModelSpec:
    figures = dict(
        layers=4, flops_per_layer=1e9, forward_bytes=1e3, backward_bytes=1e3, gradient_bytes_per_layer=1e3,
        memory_bytes_per_layer=1e3, micro_batches=4, full_duplex=True, tied_bytes=1e3,
    )  # fmt: skip
    return ModelSpec(**(figures | kw))


def _uniform(ids, delay=1e-4, bandwidth=1e9, speed=1e12) -> PlanInput:
    n = len(ids)
    d, bw = np.full((n, n), delay), np.full((n, n), bandwidth)
    np.fill_diagonal(d, 0.0)
    np.fill_diagonal(bw, np.inf)
    return PlanInput(tuple(Peer(p, speed, 1e12) for p in ids), d, bw)


def _ends(made, relays) -> int:
    return sum(relays.get(made.stages[s].peer_ids[0]) is not None for s in (0, -1))


@pytest.mark.parametrize("relays", [{"p1": "p0", "p3": "p2"}, {"p0": "p1", "p2": "p3"}])
def test_the_search_keeps_a_nat_peer_off_one_end_when_pipelines_cost_the_same(relays):
    # two of four NAT'd, each with a reachable relay; fast, low-latency links, so the two legs cost little and
    # the old planner took N-R-R-N (both NAT'd peers beside their relays, at the ends): every trainer call and
    # both directions of the tied sum then pass a tunnel. Priced, a layout with at most one NAT'd end wins.
    x, model = _uniform(["p0", "p1", "p2", "p3"]), _model()
    made = plan_relayed(x, model, relays, CFG)
    assert _ends(made, relays) <= 1, [s.peer_ids for s in made.stages]
    both_ends = {"p1": ["p1", "p0", "p2", "p3"], "p0": ["p0", "p1", "p3", "p2"]}[next(iter(relays))]
    index = {p: i for i, p in enumerate(["p0", "p1", "p2", "p3"])}
    layout = Layout(np.array([[index[p]] for p in both_ends]), np.ones(4, dtype=np.int64))
    assert made.step_time_s < price(layout, x, relays, model).total_s


def test_messages_into_each_place_counted_by_hand():
    unreachable = np.ones(4, dtype=bool)
    grid = np.array([[0], [1], [2], [3]])
    tied, untied = _model(), _model(tied_bytes=0.0)
    # M = 4; first: 4 backward + 4 Forward from the trainer + Grads, Step (+ Reduce and 1 tied partner: tied);
    # middle: 4 + 4 + Grads, Step; last: 4 forward + 4 Backward starts + PutLabels + Grads, Step (+ 2 tied)
    assert tunnelled_messages(grid, unreachable, untied) == 10 + 10 + 10 + 11
    assert tunnelled_messages(grid, unreachable, tied) == 12 + 10 + 10 + 13
    only = np.array([False, False, False, True])
    assert tunnelled_messages(grid, only, tied) == 13
    # two replicas: M = 2 per pipeline; each replica averages with 1 partner and gets Reduce; the tied group is
    # the 4 end replicas (3 partners each)
    grid2 = np.array([[0, 1], [2, 3]])
    per_first = 2 + 2 + 1 + 2 + 1 + 3  # backward, Forward, averaging, Grads/Step, Reduce, tied
    per_last = 2 + 3 + 1 + 2 + 1 + 3  # forward, Backward starts + PutLabels, averaging, Grads/Step, Reduce, tied
    assert tunnelled_messages(grid2, unreachable, tied) == 2 * per_first + 2 * per_last


def test_relay_extra_grows_by_the_per_message_term_exactly():
    # a (NAT'd, relayed by b) | b | c: a reverse connection only, so the extra is the tunnel's alone.
    # By hand: a is stage 0 of an untied model with M = 4: 4 backward from b, the trainer's 4 Forward, Grads, Step
    x, model = _uniform(["a", "b", "c"]), _model(tied_bytes=0.0, layers=3)
    from swarm.scheduler.plans import Plan, StagePlan

    made = Plan(tuple(StagePlan(i, i + 1, (p,)) for i, p in enumerate("abc")), FullCost(x, model).evaluate(
        Layout(np.array([[0], [1], [2]]), np.ones(3, dtype=np.int64))), "full")  # fmt: skip
    for tunnel_s in (1e-3, 2.5e-3):
        assert relay_extra_s(made, x, {"a": "b"}, model, tunnel_s=tunnel_s) == pytest.approx(10 * tunnel_s, abs=1e-12)
    assert relay_extra_s(made, x, {"a": "b"}, model, tunnel_s=0.0) is None  # no two legs, no tunnel cost


SCENARIOS = [
    (["a", "b", "c", "d"], 1e-4, 1e9, {}),
    (["a", "b", "c", "d"], 0.005, 12.5e6, {"a": None, "b": None}),
    (["a", "b", "c", "d", "e", "f"], 0.02, 1e6, {}),
]


@pytest.mark.parametrize("ids, delay, bandwidth, relays", SCENARIOS)
def test_no_unreachable_peer_changes_nothing(ids, delay, bandwidth, relays):
    x = _uniform(ids, delay, bandwidth)
    x.speeds_flops_per_s[:] = np.linspace(1e11, 3e11, len(ids))  # uneven compute: the search has choices
    model = _model(tied_bytes=2e4)
    cfg = SearchConfig(seed=1)
    made, plain = plan_relayed(x, model, relays, cfg), plan(x, model, cfg)
    assert made.to_dict() == plain.to_dict()  # the same plan and prediction, bit for bit
    layout = Layout(np.arange(len(ids))[:, None], np.array([1] * (len(ids) - 1) + [5 - len(ids)]))
    if (layout.layers >= 1).all():
        assert price(layout, x, relays, model) == FullCost(x, model).evaluate(layout)
    assert relay_extra_s(made, x, relays, model) is None


@pytest.mark.parametrize("bad", [float("nan"), -1e-3, float("inf"), -0.0 - 1e-12, "0.6", True, None])
def test_a_bad_tunnel_latency_is_refused(bad):
    x, model, relays = _uniform(["a", "b", "c"]), _model(layers=3), {"a": "b"}
    layout = Layout(np.array([[0], [1], [2]]), np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError, match="tunnel_s"):
        plan_relayed(x, model, relays, CFG, tunnel_s=bad)
    with pytest.raises(ValueError, match="tunnel_s"):
        price(layout, x, relays, model, tunnel_s=bad)
    with pytest.raises(ValueError, match="tunnel_s"):
        TunnelCost(x, model, np.array([True, False, False]), bad)


def test_the_default_is_the_measured_figure_and_priced_whole():
    assert 0 < TUNNEL_CALL_S <= 1e-3  # measured per call (its docstring): a fraction of a millisecond
    x, model = _uniform(["a", "b", "c"]), _model(layers=3)
    cost = TunnelCost(x, model, np.array([True, False, False]), TUNNEL_CALL_S)
    layout = Layout(np.array([[0], [1], [2]]), np.ones(3, dtype=np.int64))
    plain = FullCost(x, model).evaluate(layout)
    priced = cost.evaluate(layout)
    count = tunnelled_messages(layout.grid, cost.unreachable, model)
    assert priced.total_s == plain.total_s + count * TUNNEL_CALL_S
    assert priced.overhead_s == plain.overhead_s + count * TUNNEL_CALL_S
    assert math.isinf(cost.evaluate(Layout(layout.grid, np.array([3, 0, 0]))).total_s)  # infeasible stays so


def test_a_tied_sum_through_relays_is_a_relayed_link():
    # a | c | d | b, a relayed by c and b by d: no pipeline link takes two legs, but the tied sum between a and b
    # does (a -> b through d, b -> a through c), and the plan's price counts it; the old relay_extra_s said None
    x, model = _uniform(["a", "b", "c", "d"], delay=0.005, bandwidth=1e6), _model(tied_bytes=2e4)
    from swarm.scheduler.plans import Plan, StagePlan

    layout = Layout(np.array([[0], [2], [3], [1]]), np.ones(4, dtype=np.int64))
    made = Plan(
        tuple(StagePlan(i, i + 1, (p,)) for i, p in enumerate("acdb")), FullCost(x, model).evaluate(layout), "full"
    )
    relays = {"a": "c", "b": "d"}
    legs = price(layout, x, relays, model, tunnel_s=0.0).total_s - FullCost(x, model).evaluate(layout).total_s
    assert legs > 0
    assert relay_extra_s(made, x, relays, model, tunnel_s=0.0) == pytest.approx(legs)


def test_the_live_planners_even_layers_keep_the_tunnels_price():
    # the live planner re-prices its plan with even layers (`--plan-even-layers`, as `swarm experiment nat`
    # runs): that re-pricing charges the tunnels too, so the published step is the layout's `price`
    from swarm.daemon.planning import with_even_layers
    from swarm.scheduler.relays import shared_cost, shared_input

    x, model, relays = _uniform(["p0", "p1", "p2", "p3"]), _model(layers=6), {"p1": "p0", "p3": "p2"}
    made = plan_relayed(x, model, relays, CFG)
    even = with_even_layers(made, shared_input(x, relays, made), model, shared_cost(x, relays, made, model))
    index = {p: i for i, p in enumerate(["p0", "p1", "p2", "p3"])}
    layout = Layout(np.array([[index[s.peer_ids[0]]] for s in even.stages]), np.array([2, 2, 1, 1]))
    assert even.step_time_s == price(layout, x, relays, model).total_s
    plain = with_even_layers(made, shared_input(x, relays, made), model)  # FullCost: no tunnel
    count = tunnelled_messages(layout.grid, np.array([False, True, False, True]), model)
    assert even.step_time_s == pytest.approx(plain.step_time_s + count * TUNNEL_CALL_S)


def test_a_reachable_neighbours_boundary_link_is_a_reverse_connection():
    # b | d | a | c with a relayed by c, b by d: d -> a is not a's relay, but a keeps a second Attach to its
    # reachable neighbour d (NatWiring.second_neighbour), so no boundary link takes two legs: with the tunnel
    # free the layout prices as if every peer were reachable. The old planner priced d -> a as d -> c -> a.
    x, model = _uniform(["a", "b", "c", "d"], delay=0.005, bandwidth=1e6), _model(tied_bytes=0.0)
    relays = {"a": "c", "b": "d"}
    layout = Layout(np.array([[1], [3], [0], [2]]), np.ones(4, dtype=np.int64))
    direct = FullCost(x, model).evaluate(layout).total_s
    assert price(layout, x, relays, model, tunnel_s=0.0).total_s == pytest.approx(direct)
    # two NAT'd neighbours still talk through a relay: b | a | d | c prices a -> b and b -> a as two legs
    adjacent = Layout(np.array([[1], [0], [3], [2]]), np.ones(4, dtype=np.int64))
    assert price(adjacent, x, relays, model, tunnel_s=0.0).total_s > FullCost(x, model).evaluate(adjacent).total_s


@pytest.mark.parametrize("relay_of_1, relay_of_3", [("p0", "p0"), ("p0", "p2"), ("p2", "p0"), ("p2", "p2")])
def test_the_nat_experiments_half_nat_swarm_gets_at_most_one_nat_end(relay_of_1, relay_of_3):
    # `swarm experiment nat`'s half-nat setting as its peers measure it: 4 equal peers, 100 Mbit/s and 5 ms each
    # way, peers 1 and 3 NAT'd (whichever reachable peer each attached to before the first plan), the default
    # model's message sizes at batch 8 in 4 micro-batches. The old planner chose N-R-R-N for every assignment.
    x = _uniform(["p0", "p1", "p2", "p3"], delay=0.005, bandwidth=100e6 / 8)
    model = _model(forward_bytes=7313.0, backward_bytes=5412.0, tied_bytes=13872.0)
    relays = {"p1": relay_of_1, "p3": relay_of_3}
    made = plan_relayed(x, model, relays, CFG)
    order = [s.peer_ids[0] for s in made.stages]
    assert _ends(made, relays) == 1, order
    assert not any(relays.get(order[k]) and relays.get(order[k + 1]) for k in range(3)), order
