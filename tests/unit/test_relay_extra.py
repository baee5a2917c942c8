"""What a plan's relayed links add to its predicted step (`relay_extra_s`): priced on one plan's own layout and
measurements, published by the live planner, validated as a plan key, followed into the route."""

from __future__ import annotations

import math

import numpy as np
import pytest

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.peers.plan import MAX_RELAY_EXTRA_S
from swarm.peers.records import PeerAnnouncement, PlanRecord, validate_plan
from swarm.scheduler import ModelSpec, Peer, PlanInput
from swarm.scheduler.cost import FullCost, Layout
from swarm.scheduler.plans import Plan, StagePlan
from swarm.scheduler.relays import TUNNEL_CALL_S, relay_extra_s
from swarm.scheduler.sizes import model_spec
from tests.unit.daemon.test_planner_versions import planner, swarm

MODEL = ModelSpec(
    layers=4, flops_per_layer=1e9, forward_bytes=4e5, backward_bytes=4e5, gradient_bytes_per_layer=1e3,
    memory_bytes_per_layer=1e3, micro_batches=4, full_duplex=True,
)  # fmt: skip


def _chain(order: str) -> Plan:
    """Plan of one stage per peer in `order`, one layer each (the breakdown is not read)."""
    stages = tuple(StagePlan(i, i + 1, (p,)) for i, p in enumerate(order))
    layout = Layout(np.array([["abcd".index(p)] for p in order]), np.ones(4, dtype=np.int64))
    return Plan(stages, FullCost(_input(), MODEL).evaluate(layout), "full")


def _input() -> PlanInput:
    # a, b behind NAT, both relayed by c; every link 5 ms and 10 MB/s except the legs through c, slower
    ids = "abcd"
    delay, bw = np.full((4, 4), 0.005), np.full((4, 4), 1e7)
    bw[0, 2] = bw[2, 1] = bw[1, 2] = bw[2, 0] = 5e6
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bw, np.inf)
    return PlanInput(tuple(Peer(p, 1e12, 1e12) for p in ids), delay, bw)


RELAYS = {"a": "c", "b": "c", "c": None, "d": None}


def test_one_relayed_link_adds_its_two_legs_over_the_direct_link():
    x = _input()
    # a | b | c | d: a<->b is relayed both ways through c (a->c->b and b->c->a), c shared by those 2 links
    extra = relay_extra_s(_chain("abcd"), x, RELAYS, MODEL)
    legs = x.delay_s.copy(), x.bandwidth_bytes_per_s.copy()
    for i, j in [(0, 1), (1, 0)]:  # priced by hand: the sum of the two legs, each at half of c's rate
        legs[0][i, j] = x.delay_s[i, 2] + x.delay_s[2, j]
        legs[1][i, j] = 1.0 / (2 * (1.0 / x.bandwidth_bytes_per_s[i, 2] + 1.0 / x.bandwidth_bytes_per_s[2, j]))
    layout = Layout(np.array([[0], [1], [2], [3]]), np.ones(4, dtype=np.int64))
    by_hand = FullCost(PlanInput(x.peers, *legs), MODEL).evaluate(layout).total_s
    direct = FullCost(x, MODEL).evaluate(layout).total_s
    # and the tunnel's fixed cost per message into a or b, counted by hand (M = 4 micro-batches, untied model):
    # a (stage 0): 4 backward from b + the trainer's 4 Forward, Grads, Step = 10; b (stage 1): 4 forward from a +
    # 4 backward from c (its relay: the reverse connection) + Grads, Step = 10
    assert extra == pytest.approx(by_hand - direct + 20 * TUNNEL_CALL_S) and extra > 0
    assert relay_extra_s(_chain("abcd"), x, RELAYS, MODEL, tunnel_s=0.0) == pytest.approx(by_hand - direct)


def test_a_plan_without_relayed_links_pays_only_its_tunnels():
    # c relays a, d relays b: a | c | d | b, each NAT'd peer at an end beside its relay (a reverse connection):
    # no two legs, but every message into a or b passes the tunnel. By hand: a (first stage): 4 backward from c,
    # the trainer's 4 Forward, Grads, Step = 10; b (last): 4 forward from d, the trainer's 4 Backward starts and
    # PutLabels, Grads, Step = 11
    ends = relay_extra_s(_chain("acdb"), _input(), {"a": "c", "b": "d"}, MODEL)
    assert ends == pytest.approx(21 * TUNNEL_CALL_S, abs=1e-12)
    assert relay_extra_s(_chain("acdb"), _input(), {"a": "c", "b": "d"}, MODEL, tunnel_s=0.0) is None
    assert relay_extra_s(_chain("abcd"), _input(), {}, MODEL) is None  # everyone reachable


def test_a_relay_that_cannot_carry_its_links_prices_at_the_bound():
    # b's relay is a, itself behind NAT: the link is infeasible, priced at the bound (never NaN or inf)
    assert relay_extra_s(_chain("abcd"), _input(), {"a": "c", "b": "a"}, MODEL) == MAX_RELAY_EXTRA_S


PEERS = [PeerAnnouncement(p, "127.0.0.1:5000", "cpu", 1 << 30, 1.0) for p in "abcd"]


def _record(**extra) -> PlanRecord:
    stages = [{"layer_start": 2 * i, "layer_end": 2 * i + 2, "peer_ids": [p]} for i, p in enumerate("abcd")]
    return PlanRecord(version=1, document={"stages": stages, **extra}, created_at=1.0)


@pytest.mark.parametrize("good", [0, 0.0, 0.0171, MAX_RELAY_EXTRA_S])
def test_a_plan_may_carry_its_relay_extra(good):
    validate_plan(_record(relay_extra_s=good), 8, PEERS)


@pytest.mark.parametrize("bad", [-0.001, MAX_RELAY_EXTRA_S * 2, math.inf, math.nan, True, "0.1", [0.1], None])
def test_a_malformed_relay_extra_is_refused(bad):
    if bad is None:  # absent (or None): no relayed link, accepted
        validate_plan(_record(relay_extra_s=None), 8, PEERS)
        return
    with pytest.raises(ValueError, match="relay_extra_s|JSON"):  # NaN, inf: the record itself refuses them
        validate_plan(_record(relay_extra_s=bad), 8, PEERS)


def test_the_route_carries_the_followed_plans_relay_extra():
    following = [
        PeerAnnouncement(p, f"127.0.0.1:{5000 + i}", "cpu", 1 << 30, 1.0, plan_version=1, stage=i,
                         layer_start=2 * i, layer_end=2 * i + 2)
        for i, p in enumerate("abcd")
    ]  # fmt: skip
    relayed, direct = _record(relay_extra_s=0.25, step_time_s=1.0), _record(step_time_s=1.0)
    assert relayed.document.route_of(following, relayed.version).relay_extra_s == 0.25
    assert direct.document.route_of(following, direct.version).relay_extra_s is None


def test_the_live_planner_publishes_relay_extra_with_a_plan_that_relays_a_link():
    spec = model_spec(ModelConfig(n_layers=4, hidden_dim=32, n_heads=2, seq_len_tokens=16), *[CodecConfig("fp32")] * 2)
    ids = ["0a0000000000", "0b0000000000", "0c0000000000", "0d0000000000"]

    def ann(pid, relay=None):
        reach = "relay" if relay else "direct"
        return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0, reach=reach, relay=relay)

    for nat, relayed in ((ids[1:], True), ((), False)):  # three of four behind d's relay: two must meet
        peers = [ann(p, ids[0] if p in nat else None) for p in ids]
        dht, published = swarm(ids[0], {"peers": peers})
        planner(dht, spec, min_peers=4, n_stages=4).round()
        ((_, plan),) = published
        validate_plan(PlanRecord(version=1, document=plan, created_at=1.0), 4, peers)
        assert ("relay_extra_s" in plan) is relayed
        assert not relayed or 0 < plan["relay_extra_s"] < plan["step_time_s"]


def test_the_trainers_summary_carries_and_prints_it():
    from swarm.train.trainer import TrainSummary, format_summary

    base = dict(first_loss=5.0, final_loss=4.0, steps=3, wire_bytes=1, fp32_wire_bytes=4, sync_bytes=0)
    base |= dict(mean_step_s=0.3, seconds=1.0, stages=4, route=["a:1"], plan_version=2, replans=0, csv="c", plot=None)
    s = TrainSummary(**base, predicted_step_s=0.25, relay_extra_s=0.0125)
    assert "its relayed links add 0.013 s/step of it" in format_summary(s)
    assert "relayed links" not in format_summary(TrainSummary(**base, predicted_step_s=0.25))
