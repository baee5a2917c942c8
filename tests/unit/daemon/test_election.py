"""Which peer plans: the lowest id holding a planner lease, else the lowest that never led (among the trusted
planners when set); a dead planner is replaced once its lease lapses, and the new one inherits the followed plan."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from swarm.compression import CodecConfig
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner, elected_planner
from swarm.model.gpt import ModelConfig
from swarm.peers.records import PeerAnnouncement, PlanRecord
from swarm.scheduler.sizes import model_spec
from tests.unit.daemon.test_planner_versions import SPEC as SPEC_2
from tests.unit.daemon.test_planner_versions import planner as make_planner
from tests.unit.daemon.test_planner_versions import swarm, two_stages

SPEC = model_spec(ModelConfig(), CodecConfig("fp32"), CodecConfig("fp32"))
A, B, C, D = "0a7e5055f7", "5350c96e50", "a1c0ffee00", "f00d000000"  # sorted as they are named


def peer(peer_id: str, started_at: float = 0.0) -> PeerAnnouncement:
    return PeerAnnouncement(
        peer_id=peer_id, address="127.0.0.1:5000", device="cpu", memory_bytes=1 << 30, compute_layers_per_s=1.0,
        started_at=started_at,
    )  # fmt: skip


def peer_at(peer_id: str, version: int, stage: int | None) -> PeerAnnouncement:
    layers = {} if stage is None else {"stage": stage, "layer_start": stage, "layer_end": stage + 1}
    return dataclasses.replace(peer(peer_id), plan_version=version, **layers)


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
    return Planner(PlanningConfig(min_peers=2, replicas=1), dht, SPEC, n_stages=2, clock=lambda: 0.0)


@pytest.mark.parametrize("trusted", [(), (B, C)])
def test_each_planner_sees_itself_as_leader_exactly_when_it_is_elected(trusted):
    peers = [peer(A), peer(B), peer(C)]
    leaders = [me for me in (A, B, C) if _planner(me, peers, trusted).is_leader(peers)]
    assert leaders == [elected_planner(peers, trusted)]


def test_a_peer_that_is_not_elected_publishes_nothing():
    peers = [peer(A), peer(B), peer(C)]
    assert _planner(B, peers).round() is None
    assert _planner(A, peers, trusted=(B,)).round() is None


# ---- the planner lease ----------------------------------------------------------------------------------------

NOW = 1_000_000.0  # DHT time of the tests' fake clocks


def leased(peer_id: str, until: float, **changes) -> PeerAnnouncement:
    return dataclasses.replace(peer(peer_id), planner_until=until, **changes)


def test_a_joiner_with_a_lower_id_does_not_depose_the_lease_holder():
    peers = [leased(B, NOW + 2), peer(C)]
    assert elected_planner(peers, now=NOW) == B
    assert elected_planner([*peers, peer(A)], now=NOW) == B, "A joined with a lower id: B keeps planning"


def test_a_dead_planner_is_replaced_once_its_lease_lapses_not_when_its_announcement_expires():
    peers = [leased(A, NOW + 3), peer(B), peer(C)]  # A died at NOW; its announcement lives on for 30 s
    assert elected_planner(peers, now=NOW + 2.9) == A
    assert elected_planner(peers, now=NOW + 3.0) == B, "lapsed: B, the lowest id that never led, takes over"


def test_a_lapsed_planner_that_comes_back_does_not_flip_leadership():
    peers = [leased(A, NOW - 1), leased(B, NOW + 3), peer(C)]  # A stalled past its lease; B took over
    assert elected_planner(peers, now=NOW) == B
    assert elected_planner(peers, now=NOW + 4) == C, "B died too: A stays out, C takes over"


def test_of_two_lease_holders_the_lowest_plans_and_everyone_lapsed_still_elects_someone():
    assert elected_planner([leased(B, NOW + 3), leased(A, NOW + 1), peer(C)], now=NOW) == A
    assert elected_planner([leased(B, NOW - 3), leased(A, NOW - 1)], now=NOW) == A, "nobody fresh: lowest of all"


def test_a_leaving_peer_is_not_elected_even_with_a_lease():
    assert elected_planner([leased(A, NOW + 3, leaving=True), peer(B)], now=NOW) == B


def test_trusted_planners_still_restrict_who_may_hold_the_lease():
    peers = [leased(A, NOW + 3), peer(B), peer(C)]  # A is not trusted: its lease does not count
    assert elected_planner(peers, trusted=(B, C), now=NOW) == B
    assert elected_planner([*peers, leased(C, NOW + 3)], trusted=(B, C), now=NOW) == C


class DHTClock:
    def __init__(self, t: float = NOW):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _leased_planner(me, records, clock, **config):
    dht, published = swarm(me, records, **config)
    dht.planner_until = 0.0
    dht.links = lambda: pytest.fail("searched anew instead of inheriting the followed plan")
    beats = []
    planner = make_planner(
        dht, SPEC_2, settle_s=5.0, clock=clock, dht_time=clock, reannounce=lambda: beats.append(dht.planner_until)
    )
    return planner, dht, published, beats


def test_the_planner_renews_its_lease_every_third_of_it_and_only_while_elected(monkeypatch):
    clock = DHTClock()
    monkeypatch.setattr("swarm.peers.dht.get_dht_time", clock)
    current = two_stages(4, A, B, trainer_ids=[])
    records = {"peers": [peer_at(A, 4, 0), peer_at(B, 4, 1)], "plan": [(A, current)]}
    planner, dht, published, beats = _leased_planner(A, records, clock)
    assert planner.round() is None and beats == [NOW + 3.0], "elected: leased at once"
    records["peers"][0] = dataclasses.replace(records["peers"][0], planner_until=dht.planner_until)
    clock.t += 0.5
    planner.round()
    assert not planner.renew_lease() and beats == [NOW + 3.0], "renewed at most every lease_s/3"
    clock.t += 0.5
    assert planner.renew_lease() and beats[-1] == NOW + 4.0
    # a lower id also holds a lease (say, after a partition): A is still a holder, but stops renewing
    records["peers"][0] = dataclasses.replace(records["peers"][0], planner_until=dht.planner_until)
    records["peers"].append(leased("00", NOW + 10))
    clock.t += 1
    assert planner.round() is None and not planner.leading
    assert not planner.renew_lease() and len(beats) == 2, "not elected: the lease is left to lapse"


def test_a_new_planner_inherits_the_followed_plan_within_a_lease_and_repairs_from_it(monkeypatch):
    clock = DHTClock()
    monkeypatch.setattr("swarm.peers.dht.get_dht_time", clock)
    # A planned plan 5 (stages A | B, standby C) and died at NOW: its lease runs out at NOW + 3
    old = two_stages(5, A, B, trainer_ids=[], unused_peer_ids=[C])
    records = {
        "peers": [leased(A, NOW + 3, plan_version=5, stage=0, layer_start=0, layer_end=1), peer_at(B, 5, 1),
                  peer_at(C, 5, None)],
        "plan": [(A, old)],
    }  # fmt: skip
    planner, dht, published, beats = _leased_planner(B, records, clock)
    assert planner.round() is None and published == [] and beats == [], "A's lease holds: B waits"
    clock.t = NOW + 3.0
    planner.round()
    assert beats == [NOW + 6.0], "B leads and leases"
    assert published == [(6, old.document.to_wire())], (
        "the followed stages under the next version: no search, no settle wait"
    )
    records["peers"] = records["peers"][1:]  # A's announcement expires (or the heartbeats find it silent)
    planner.round()
    assert [v for v, _ in published] == [6, 7]
    assert [s["peer_ids"] for s in published[1][1]["stages"]] == [[C], [B]], "repaired: the standby takes A's place"


def test_readers_take_the_new_planners_plans_as_soon_as_the_old_lease_lapses(monkeypatch):
    clock = DHTClock()
    monkeypatch.setattr("swarm.peers.dht.get_dht_time", clock)
    peers = [leased(B, NOW + 3, plan_version=5), leased(C, NOW + 6), peer(A)]  # A: a lower-id joiner
    records = {"peers": peers, "plan": [(B, two_stages(5, B, C)), (C, two_stages(6, B, C)), (A, two_stages(9, A, B))]}
    dht, _ = swarm(D, records)
    assert dht.get_plan(2).version == 5, "B holds the lowest lease"
    clock.t = NOW + 3
    assert dht.get_plan(2).version == 6, "B's lease lapsed: C's plan, not the joiner A's"


def test_only_a_plan_matching_what_its_followers_serve_is_inherited(monkeypatch):
    clock = DHTClock()
    monkeypatch.setattr("swarm.peers.dht.get_dht_time", clock)
    genuine = two_stages(5, A, B)
    forged = PlanRecord(
        version=5, document={**two_stages(5, C, B).document.to_wire(), "x": 1}, created_at=0.5
    )  # C in A's place
    peers = [peer_at(A, 5, 0), peer_at(B, 5, 1), peer(C), peer_at(D, 4, 0)]
    dht, _ = swarm(C, {"peers": peers, "plan": [(D, forged), (A, genuine), (D, two_stages(4, D, B))]})
    assert dht.followed_plan(2, peers) == genuine, "most peers follow 5, and only A's 5 names them where they serve"
    dht, _ = swarm(C, {"peers": peers, "plan": [(A, genuine)]}, trusted_planners=(C,))
    assert dht.followed_plan(2, peers) is None, "with trusted planners only theirs count"


def test_a_lapsed_planner_silent_to_one_ping_is_repaired_around_at_once_but_one_that_answers_is_not(monkeypatch):
    from swarm.daemon.liveness import Liveness, LivenessConfig

    clock = DHTClock(NOW + 3.0)  # A's lease lapsed just now
    monkeypatch.setattr("swarm.peers.dht.get_dht_time", clock)
    old = two_stages(5, A, B, trainer_ids=[], unused_peer_ids=[C])
    announced = [leased(A, NOW + 3, plan_version=5, stage=0, layer_start=0, layer_end=1), peer_at(B, 5, 1),
                 peer_at(C, 5, None)]  # fmt: skip
    for answers, stages in ((False, [[C], [B]]), (True, [[A], [B]])):
        pinged = []
        planner, dht, published, _ = _leased_planner(B, {"peers": list(announced), "plan": [(A, old)]}, clock)
        ping = lambda pid, pinged=pinged, answers=answers: pinged.append(pid) or answers  # noqa: E731
        planner.liveness = Liveness(ping, LivenessConfig(), clock=clock)
        planner.round()
        assert [s["peer_ids"] for s in published[0][1]["stages"]] == stages
        assert pinged.count(A) == 2, "one ping by the watch, one for the lapsed lease"
        planner.liveness.close()
