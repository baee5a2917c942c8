"""Who the planner lets into a plan (issue 27, relay-slot-fill): a joiner counts once the heartbeats reached it,
and a peer a plan names that never follows it is planned without and held back."""

from __future__ import annotations

import pytest

from swarm.daemon.joiners import JoinConfig, JoinWatch, unproven
from swarm.daemon.liveness import Liveness, LivenessConfig
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner
from tests.unit.daemon.test_planner_versions import SPEC, swarm
from tests.unit.daemon.test_repair import Clock, grid, ids, peer, record

A, B, C, D, E, F = (f"0{c}0000000000" for c in "abcdef")
STRANGERS = [f"5{i:02d}0000000000" for i in range(20)]


def test_unproven_is_the_unnamed_peers_that_never_answered_but_the_planner_itself():
    answered = {B, D}.__contains__
    assert unproven({A, B, C, D, E}, named={A, C}, answered=answered, me=E) == set(), "E is the planner"
    assert unproven({A, B, C, D, E}, named={A, C}, answered=answered, me=A) == {E}
    assert unproven({A, C}, named={A, C}, answered=lambda p: False, me=B) == set(), "named peers need no proof"


def test_liveness_answered_needs_an_answer_and_a_latest_ping_answered():
    clock, silent = Clock(), {B}
    live = Liveness(lambda pid: pid not in silent, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=clock)
    try:
        assert not live.answered(A), "never pinged: no proof"
        live.round([A, B])
        assert live.answered(A) and not live.answered(B)
        silent.add(A)
        clock.t += 1
        live.round([A, B])
        assert not live.answered(A), "its latest ping went unanswered"
        silent.clear()
        clock.t += 1
        live.round([A, B])
        assert live.answered(A) and live.answered(B)
        clock.t += 1
        live.round([B])
        clock.t += 1
        live.round([A, B])
        assert live.answered(A), "re-watched and answered again"
        silent.add(A)
        clock.t += 1
        live.round([B])
        assert not live.answered(A), "no longer watched: forgotten"
    finally:
        live.close()


def test_a_joiner_that_follows_in_time_is_never_held():
    clock = Clock()
    watch = JoinWatch(JoinConfig(deadline_s=10.0), clock=clock)
    plan = record(4, grid([A, C], [B]))
    assert watch.update(plan, [peer(A, 4, 0), peer(B, 4, 1), peer(C, 3)]) == frozenset()
    clock.t += 9
    assert watch.update(plan, [peer(A, 4, 0), peer(B, 4, 1), peer(C, 5, 0)]) == frozenset(), "a later plan counts"
    clock.t += 100
    assert watch.update(plan, [peer(A, 3, 0), peer(B, 4, 1), peer(C, 3, 0)]) == frozenset(), (
        "once followed, a lag is the heartbeats' business, not the join watch's"
    )


def test_a_joiner_that_never_follows_is_held_back_for_a_doubling_hold():
    clock = Clock()
    watch = JoinWatch(JoinConfig(deadline_s=10.0, hold_s=60.0, max_hold_s=100.0), clock=clock)
    plan = record(4, grid([A, C], [B]))
    peers = [peer(A, 4, 0), peer(B, 4, 1), peer(C, 0)]  # C answers pings but never switches
    assert watch.update(plan, peers) == frozenset()
    clock.t += 10
    assert watch.update(plan, peers) == frozenset(), "10 s is within the deadline"
    clock.t += 1
    assert watch.update(plan, peers) == {C}
    repaired = record(5, grid([A], [B]))
    clock.t += 59
    assert watch.update(repaired, peers) == {C}, "held 60 s"
    clock.t += 1
    assert watch.update(repaired, peers) == frozenset(), "released after its hold"
    grown = record(6, grid([A, C], [B]))
    watch.update(grown, peers)
    clock.t += 11
    assert watch.update(grown, peers) == {C}
    clock.t += 99
    assert watch.update(record(7, grid([A], [B])), peers) == {C}, "the second hold: 120 s, capped at 100"
    clock.t += 1
    assert watch.update(record(7, grid([A], [B])), peers) == frozenset()


def test_a_joiner_dropped_by_a_repair_is_forgotten_and_judged_afresh_when_named_again():
    clock = Clock()
    watch = JoinWatch(JoinConfig(deadline_s=10.0), clock=clock)
    peers = [peer(A, 4, 0), peer(B, 4, 1), peer(C)]
    watch.update(record(4, grid([A, C], [B])), peers)
    clock.t += 8
    watch.update(record(5, grid([A], [B])), peers)  # C dropped (say, silent to the heartbeats)
    clock.t += 8
    assert watch.update(record(6, grid([A, C], [B])), peers) == frozenset(), "named again: a new deadline"
    with pytest.raises(ValueError):
        JoinConfig(deadline_s=0.0)


def planner_with(records: dict, clock: Clock, ping) -> tuple[Planner, list]:
    dht, published = swarm(A, records)
    live = Liveness(ping, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=clock)
    cfg = PlanningConfig(min_peers=2, replicas=2)
    return Planner(cfg, dht, SPEC, 2, settle_s=2.0, probe_wait_s=0.0, clock=clock, liveness=live), published


def test_strangers_that_never_answer_are_never_planned_and_make_no_plans():
    """relay-slot-fill: announced behind a relay that does not hold them, they never answer a ping."""
    clock = Clock()
    honest = [peer(A, 3, 0), peer(B, 3, 0), peer(C, 3, 1), peer(D, 3, 1), peer(E, 3)]
    records = {"peers": honest, "plan": [(A, record(3, grid([A, B], [C, D], unused=[E]).replace(trainer_ids=())))]}
    planner, published = planner_with(records, clock, lambda pid: pid not in STRANGERS)
    try:
        records["peers"] = [*honest, *(peer(s) for s in STRANGERS)]
        for _ in range(30):
            planner.round()
            clock.t += 1
        assert published == [], "no stranger was grown, and nothing was re-planned"
        records["peers"] = [*records["peers"], peer(F)]  # an honest joiner answers its first ping
        planner.round()
        assert [ids(p) for _, p in published] == [[[A, B, F], [C, D]]], "grown at its first answered ping"
    finally:
        planner.liveness.close()


def test_a_planned_joiner_that_never_follows_is_planned_without_and_not_grown_again_while_held():
    clock = Clock()
    honest = [peer(A, 3, 0), peer(B, 3, 1)]
    records = {"peers": [*honest, peer(C)], "plan": [(A, record(3, grid([A], [B]).replace(trainer_ids=())))]}
    planner, published = planner_with(records, clock, lambda pid: True)  # C answers pings but never switches
    try:
        planner.round()
        assert [(v, ids(p)) for v, p in published] == [(4, [[A, C], [B]])], "grown once it answered"
        records["peers"] = [peer(A, 4, 0), peer(B, 4, 1), peer(C)]
        deadline = planner.joins.cfg.deadline_s
        while clock.t <= 102 + deadline:  # the watch first sees plan 4 at its next round
            clock.t += 1
            planner.round()
        assert [(v, ids(p)) for v, p in published][1:] == [(5, [[A], [B]])], "planned without after its deadline"
        for _ in range(int(planner.joins.cfg.hold_s) - 5):
            clock.t += 1
            planner.round()
        assert len(published) == 2, "held back: not grown again, no plan churn"
    finally:
        planner.liveness.close()


def test_the_planners_own_stall_does_not_count_against_a_joiners_deadline():
    clock = Clock()
    records = {
        "peers": [peer(A, 3, 0), peer(B, 3, 1), peer(C)],
        "plan": [(A, record(3, grid([A], [B]).replace(trainer_ids=())))],
    }
    planner, published = planner_with(records, clock, lambda pid: True)
    try:
        planner.round()
        records["peers"] = [peer(A, 4, 0), peer(B, 4, 1), peer(C)]  # C, grown at plan 4, still pulling its state
        clock.t += 1
        planner.round()
        clock.t += 10 * planner.joins.cfg.deadline_s  # the planner's process was descheduled that long
        planner.round()
        assert len(published) == 1, "a stall of the planner is nobody's lateness"
        records["peers"] = [peer(A, 4, 0), peer(B, 4, 1), peer(C, 4, 0)]
        clock.t += 1
        planner.round()
        assert len(published) == 1 and not planner.joins.update(None, []), "C followed: never held"
    finally:
        planner.liveness.close()
