"""The scheduler with peers behind NAT: relayed links cost their two legs, relays are shared, and the planner
places reachable peers between unreachable ones (swarm.scheduler.relays)."""

from __future__ import annotations

import numpy as np
import pytest

from peers.records import LinkMeasurement, PeerAnnouncement
from swarm.daemon.planning import swarm_plan_input
from swarm.scheduler import ModelSpec, Peer, PlanInput, SearchConfig, plan
from swarm.scheduler.cost import FullCost, Layout
from swarm.scheduler.relays import (
    TUNNEL_CALL_S,
    plan_relayed,
    price,
    relay_shares,
    relayed_input,
    relays_of,
    tunnelled_messages,
)


def _input(ids, delay, bandwidth, burst=None) -> PlanInput:
    peers = tuple(Peer(pid, 1e12, 1e12) for pid in ids)
    return PlanInput(peers, np.asarray(delay, float), np.asarray(bandwidth, float), burst)


def _uniform(ids, delay=0.01, bandwidth=1e6) -> PlanInput:
    n = len(ids)
    return _input(ids, np.full((n, n), delay), np.full((n, n), bandwidth))


def test_a_relayed_link_is_the_sum_of_its_two_legs():
    # a, b behind NAT with relay c; c reachable. a->b goes a->c->b, b->a goes b->c->a.
    delay = [[0, 0.5, 0.01], [0.5, 0, 0.03], [0.02, 0.04, 0]]
    bw = [[1, 7, 100.0], [7, 1, 200.0], [300.0, 50.0, 1]]
    burst = np.array([[0, 9, 40.0], [9, 0, 70.0], [60.0, 30.0, 0]])
    x = _input("abc", delay, bw, burst)
    out = relayed_input(x, {"a": "c", "b": "c", "c": None})
    assert out.delay_s[0, 1] == pytest.approx(0.01 + 0.04)  # a->c then c->b
    assert out.delay_s[1, 0] == pytest.approx(0.03 + 0.02)  # b->c then c->a
    assert out.bandwidth_bytes_per_s[0, 1] == pytest.approx(1 / (1 / 100 + 1 / 50))
    assert out.bandwidth_bytes_per_s[1, 0] == pytest.approx(1 / (1 / 200 + 1 / 300))
    assert out.burst_bytes[0, 1] == 30.0 and out.burst_bytes[1, 0] == 60.0
    # links with a reachable end are direct (reverse connections), untouched
    for i, j in [(0, 2), (2, 0), (1, 2), (2, 1)]:
        assert out.delay_s[i, j] == x.delay_s[i, j] and out.bandwidth_bytes_per_s[i, j] == x.bandwidth_bytes_per_s[i, j]
    # a relay carrying 2 links at once gives each half its rate
    shared = relayed_input(x, {"a": "c", "b": "c"}, shares={2: 2})
    assert shared.bandwidth_bytes_per_s[0, 1] == pytest.approx(0.5 / (1 / 100 + 1 / 50))
    assert shared.delay_s[0, 1] == pytest.approx(0.05)


def test_the_destinations_relay_carries_each_direction():
    x = _uniform("abcd")
    d = x.delay_s.copy()
    d[0, 2], d[2, 1] = 0.1, 0.2  # a->c->b: b's relay is c
    d[1, 3], d[3, 0] = 0.3, 0.4  # b->d->a: a's relay is d
    out = relayed_input(_input("abcd", d, x.bandwidth_bytes_per_s), {"a": "d", "b": "c"})
    assert out.delay_s[0, 1] == pytest.approx(0.3) and out.delay_s[1, 0] == pytest.approx(0.7)


def test_a_link_into_an_unreachable_peer_takes_its_relay_unless_the_relay_sends():
    x = _uniform("abcd")
    d = x.delay_s.copy()
    d[0, 2], d[2, 1] = 0.1, 0.2
    out = relayed_input(_input("abcd", d, x.bandwidth_bytes_per_s), {"b": "c"})
    assert out.delay_s[0, 1] == pytest.approx(0.3)  # reachable a -> b: through b's relay c
    assert out.delay_s[3, 1] == pytest.approx(0.01 + 0.2)
    assert out.delay_s[2, 1] == 0.2  # c is b's relay: the reverse connection, one leg
    assert out.delay_s[1, 0] == 0.01 and out.delay_s[1, 3] == 0.01  # b dials out directly


def test_a_missing_or_unreachable_relay_makes_the_link_infeasible():
    x = _uniform("abc")
    out = relayed_input(x, {"a": "zz", "b": "a"})  # a's relay is not planned; b's relay (a) is unreachable
    for i, j in [(1, 0), (2, 0), (0, 1), (2, 1)]:
        assert out.bandwidth_bytes_per_s[i, j] == 1.0 and out.delay_s[i, j] == 3600.0, (i, j)
    assert out.delay_s[0, 2] == 0.01  # out to the reachable c still works
    assert relayed_input(x, {"a": None}) is x


def test_full_cost_prices_the_relayed_boundary_as_two_legs():
    model = ModelSpec(
        layers=2,
        flops_per_layer=1.0,
        forward_bytes=1000.0,
        backward_bytes=1000.0,
        gradient_bytes_per_layer=1.0,
        memory_bytes_per_layer=1.0,
    )
    x = _uniform("abc", delay=0.01, bandwidth=1e4)
    direct = FullCost(x, model).evaluate(Layout(np.array([[0], [1]]), np.array([1, 1])))
    layout, relays = Layout(np.array([[0], [1]]), np.array([1, 1])), {"a": "c", "b": "c"}
    legs = FullCost(relayed_input(x, relays), model).evaluate(layout)
    # by hand: each direction 1000 B at 1e4 B/s + 10 ms (no burst, 1 micro-batch, half duplex), over one link
    # or over the relay's two legs
    assert direct.total_s == pytest.approx(2 * (0.1 + 0.01), rel=1e-6)
    assert legs.total_s == pytest.approx(2 * (0.2 + 0.02), rel=1e-6)
    # priced with the layout's sharing: c carries a->b and b->a at once, so each gets half its rate
    assert price(layout, x, relays, model, tunnel_s=0.0).total_s == pytest.approx(2 * (0.4 + 0.02), rel=1e-6)
    # and the tunnel per message into a or b: a 1 backward, the trainer's Forward, Grads, Step; b 1 forward, the
    # trainer's Backward start and PutLabels, Grads, Step
    by_hand = 2 * (0.4 + 0.02) + 9 * TUNNEL_CALL_S
    assert price(layout, x, relays, model).total_s == pytest.approx(by_hand, rel=1e-6)


def test_relay_shares_count_the_layouts_relayed_links():
    x = _uniform("abcde")
    relays = {"a": "c", "b": "c", "d": "c"}
    # a | b | d in a chain: a<->b and b<->d are relayed (4 directed links), all through c
    assert relay_shares(Layout(np.array([[0], [1], [3]]), np.array([1, 1, 1])), x, relays) == {2: 4}
    # a | c | b: nothing relayed
    assert relay_shares(Layout(np.array([[0], [2], [1]]), np.array([1, 1, 1])), x, relays) == {}
    # a and b replicas of one stage: they average through c both ways; e's gradients to b take the reverse
    # connection of b's second Attach (e is its reachable pipeline neighbour), not c
    assert relay_shares(Layout(np.array([[0, 1], [2, 4]]), np.array([1, 1])), x, relays) == {2: 2}


def _model(layers=4) -> ModelSpec:
    return ModelSpec(
        layers=layers,
        flops_per_layer=1e9,
        forward_bytes=4e5,
        backward_bytes=4e5,
        gradient_bytes_per_layer=1e3,
        memory_bytes_per_layer=1e3,
        micro_batches=4,
        full_duplex=True,
    )


def _order(made):
    return [s.peer_ids[0] for s in made.stages]


def test_the_planner_places_reachable_peers_between_unreachable_ones():
    # a behind NAT relayed by c, b by d: a reachable neighbour's calls take the reverse connection (the announced
    # relay's or the second Attach's), so any order without two NAT'd neighbours has no two-legs link; the tunnels'
    # price then keeps a NAT'd peer off one end (N-R-N-R: the trainer's PutLabels and Backward starts go direct)
    ids = ["a", "b", "c", "d"]
    relays = {"a": "c", "b": "d", "c": None, "d": None}
    cfg = SearchConfig(seed=0, stages=4, max_replicas=1)
    made = plan_relayed(_uniform(ids), _model(), relays, cfg)
    order = _order(made)
    assert not any(order[k] in "ab" and order[k + 1] in "ab" for k in range(3)), order
    assert sum(order[k] in "ab" for k in (0, 3)) == 1, order
    # and it costs what the all-reachable swarm costs but the tunnel's fixed cost per message into a or b
    reachable = plan(_uniform(ids), _model(), cfg).breakdown.total_s
    grid = np.array([[ids.index(p)] for p in order])
    count = tunnelled_messages(grid, np.array([True, True, False, False]), _model())
    assert count == 20  # each NAT'd stage: 4 forward or Forward, 4 backward, Grads, Step (none is the last)
    assert made.breakdown.total_s == pytest.approx(reachable + count * TUNNEL_CALL_S)


def test_when_unreachables_must_meet_the_relayed_link_is_priced_and_shared():
    # three of four behind NAT, all through d: some two must be adjacent
    ids = ["a", "b", "c", "d"]
    relays = {"a": "d", "b": "d", "c": "d"}
    cfg = SearchConfig(seed=0, stages=4, max_replicas=1)
    made = plan_relayed(_uniform(ids), _model(), relays, cfg)
    reachable = plan(_uniform(ids), _model(), cfg)
    assert made.breakdown.total_s > reachable.breakdown.total_s
    order = _order(made)
    hidden = {"a", "b", "c"}
    assert sum(order[k] in hidden and order[k + 1] in hidden for k in range(3)) == 1, order  # the fewest
    assert order[1] == "d" or order[2] == "d"


def test_plan_relayed_equals_plan_without_unreachable_peers():
    x = _uniform("abcd")
    cfg = SearchConfig(seed=3, stages=2)
    a, b = plan_relayed(x, _model(), {}, cfg), plan(x, _model(), cfg)
    assert a.to_dict() == b.to_dict()


def _announce(pid, port, **kw) -> PeerAnnouncement:
    return PeerAnnouncement(pid, f"127.0.0.1:{port}", "cpu", 10**9, 10.0, **kw)


def test_announcement_reach_and_relay_are_validated():
    a = _announce("a", 1, reach="relay", relay="c")
    assert PeerAnnouncement.from_wire(a.to_wire()) == a
    assert PeerAnnouncement.from_wire(_announce("b", 2).to_wire()).reach == "direct"
    for bad in (
        {"reach": "nat"},
        {"reach": "relay"},  # no relay named
        {"reach": "direct", "relay": "c"},
        {"reach": "relay", "relay": "a"},  # itself
        {"reach": "relay", "relay": "x" * 65},
        {"reach": "relay", "relay": 7},
        {"reach": None},
    ):
        with pytest.raises(ValueError):
            _announce("a", 1, **bad)


def test_the_live_plan_input_prices_relayed_links():
    hidden = [_announce(pid, port, reach="relay", relay="c") for pid, port in (("a", 1), ("b", 2))]
    peers = [*hidden, _announce("c", 3)]
    links = [LinkMeasurement(s, d, 0.02, 1e6, 1.0) for s in "abc" for d in "abc" if s != d and {s, d} != {"a", "b"}]
    x = swarm_plan_input(peers, links, _model()).plan_input
    assert relays_of(peers) == {"a": "c", "b": "c", "c": None}
    assert x.delay_s[0, 1] == pytest.approx(0.02) and x.bandwidth_bytes_per_s[0, 1] == pytest.approx(5e5)
    assert x.delay_s[0, 2] == pytest.approx(0.01) and x.bandwidth_bytes_per_s[0, 2] == pytest.approx(1e6)


def test_the_live_planner_shares_a_relay_among_the_links_it_carries():
    from tests.unit.daemon.test_planner_versions import SPEC, planner, swarm

    a, b, c, d = "0a0000000000", "0b0000000000", "0c0000000000", "0d0000000000"
    peers = [
        PeerAnnouncement(a, "127.0.0.1:5000", "cpu", 1 << 30, 1e-3),  # too slow to serve: it only relays
        *(PeerAnnouncement(p, f"127.0.0.1:{5001 + k}", "cpu", 1 << 30, 1.0, reach="relay", relay=a)
          for k, p in enumerate((b, c, d))),
    ]  # fmt: skip
    dht, published = swarm(a, {"peers": peers})
    made = planner(dht, min_peers=4).round()
    assert made is not None and published
    x = swarm_plan_input(peers, [], SPEC)
    cfg = SearchConfig(seed=0, stages=2, max_replicas=1, replica_fractions=(1.0,))
    shared = plan_relayed(x.direct_input, SPEC, x.relays, cfg)
    unshared = plan(x.plan_input, SPEC, cfg)  # what it published before: every relayed link as if alone
    assert made.breakdown.total_s == pytest.approx(shared.breakdown.total_s)
    assert a not in _order(shared) and a not in _order(unshared)  # two NAT'd stages: their link both ways via a
    assert shared.breakdown.total_s > unshared.breakdown.total_s  # a carries two links: each at half its rate
