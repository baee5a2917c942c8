"""Which peer plans: the lowest announced id (among the trusted planners when set); the next one when it leaves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarm.compression import CodecConfig
from swarm.daemon.planning import Planner, elected_planner, model_spec
from swarm.model.gpt import ModelConfig
from swarm.peers.records import PeerAnnouncement

SPEC = model_spec(ModelConfig(), CodecConfig("fp32"), CodecConfig("fp32"))
A, B, C, D = "0a7e5055f7", "5350c96e50", "a1c0ffee00", "f00d000000"  # sorted as they are named


def peer(peer_id: str, started_at: float = 0.0) -> PeerAnnouncement:
    return PeerAnnouncement(
        peer_id=peer_id, address="127.0.0.1:5000", device="cpu", memory_bytes=1 << 30, compute_layers_per_s=1.0,
        started_at=started_at,
    )  # fmt: skip


def test_the_lowest_announced_id_plans_whatever_the_order_or_start_times():
    peers = [peer(C, started_at=1.0), peer(A, started_at=3.0), peer(B, started_at=2.0)]
    assert elected_planner(peers) == A
    assert elected_planner(reversed(peers)) == A


def test_when_the_planner_leaves_the_next_lowest_takes_over_and_so_on():
    peers = [peer(D), peer(B), peer(A), peer(C)]
    order = []
    while peers:
        planner = elected_planner(peers)
        order.append(planner)
        peers = [p for p in peers if p.peer_id != planner]
    assert order == [A, B, C, D]
    assert elected_planner(peers) is None


def test_only_trusted_planners_are_elected_when_some_are_named():
    peers = [peer(A), peer(B), peer(C), peer(D)]
    assert elected_planner(peers, trusted=(C, D)) == C
    assert elected_planner([p for p in peers if p.peer_id != C], trusted=(C, D)) == D


def test_nobody_plans_while_no_trusted_planner_is_announced():
    assert elected_planner([peer(A), peer(B)], trusted=(C,)) is None


def test_a_trusted_id_that_has_not_announced_cannot_be_elected():
    assert elected_planner([peer(B), peer(C)], trusted=(A, C)) == C


def _planner(me: str, peers: list[PeerAnnouncement], trusted: tuple[str, ...] = ()) -> Planner:
    def publish_plan(version, plan):
        raise AssertionError(f"{me} is not the planner but published plan {version}")

    dht = SimpleNamespace(
        peer_id=me,
        config=SimpleNamespace(trusted_planners=trusted),
        peers=lambda: list(peers),
        publish_plan=publish_plan,
    )
    return Planner(dht, SPEC, n_stages=2, min_peers=2, clock=lambda: 0.0)


@pytest.mark.parametrize("trusted", [(), (B, C)])
def test_each_planner_sees_itself_as_leader_exactly_when_it_is_elected(trusted):
    peers = [peer(A), peer(B), peer(C)]
    leaders = [me for me in (A, B, C) if _planner(me, peers, trusted).is_leader(peers)]
    assert leaders == [elected_planner(peers, trusted)]


def test_a_peer_that_is_not_elected_publishes_nothing():
    peers = [peer(A), peer(B), peer(C)]
    assert _planner(B, peers).round() is None
    assert _planner(A, peers, trusted=(B,)).round() is None
