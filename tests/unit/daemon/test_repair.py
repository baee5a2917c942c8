"""Plan repair: a lost place goes to a standby and nobody else moves; a full search only without a standby.
The planner repairs at once (no settle wait), and heartbeats make a silent peer gone before its record expires."""

from __future__ import annotations

import threading

import pytest

from swarm.daemon.liveness import Liveness, LivenessConfig
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner
from swarm.daemon.repair import repair_plan, standby_pool
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement, PlanRecord
from tests.unit.daemon.test_planner_versions import SPEC, swarm

A, B, C, D, E, F = (f"0{c}0000000000" for c in "abcdef")


def grid(*rows: list[str], unused: list[str] = ()) -> PlanDocument:
    """A plan of len(rows) stages, row s = the replicas of stage s (one layer each)."""
    stages = [{"layer_start": s, "layer_end": s + 1, "peer_ids": list(r)} for s, r in enumerate(rows)]
    wire = {"stages": stages, "unused_peer_ids": list(unused), "trainer_ids": ["t"], "step_time_s": 1.0}
    return PlanDocument.from_wire(wire)


def ids(plan: PlanDocument | dict) -> list[list[str]]:
    """Each stage's replicas, of a plan or of a published one's wire dict."""
    plan = PlanDocument.from_wire(plan) if isinstance(plan, dict) else plan
    return [list(s.peer_ids) for s in plan.stages]


def test_a_dead_replica_goes_to_the_first_standby_and_nobody_else_moves():
    plan = grid([A, B], [C, D], unused=[E, F])
    fixed = repair_plan(plan, alive={A, C, D, E, F})  # B died (gone from the announcements)
    assert ids(fixed) == [[A, E], [C, D]]
    assert list(fixed.unused_peer_ids) == [F]
    assert fixed.columns() == [[A, C], [E, D]], "E takes B's column: chain 1"
    assert fixed.trainer_ids == ("t",) and fixed.step_time_s == 1.0, "every other key kept"
    assert ids(plan) == [[A, B], [C, D]], "the input is not changed"


def test_a_dead_sole_holder_is_replaced():
    fixed = repair_plan(grid([A], [B], [C], unused=[D]), alive={A, C, D})
    assert ids(fixed) == [[A], [D], [C]] and list(fixed.unused_peer_ids) == []


def test_a_leaving_peer_is_replaced_while_still_announced():
    fixed = repair_plan(grid([A, B], [C, D], unused=[E]), alive={A, B, C, D, E}, gone={C})
    assert ids(fixed) == [[A, B], [E, D]]


def test_without_a_standby_there_is_no_repair_when_no_stage_can_spare_a_replica():
    assert repair_plan(grid([A], [B], unused=[C]), alive={B}, gone=set()) is None, "the standby left too"
    assert repair_plan(grid([A], [B], [D], unused=[C]), alive={B, C}) is None, "two stages lost, one standby"
    assert repair_plan(grid([A], [B], unused=[C]), alive={A, B, C}, gone={B, C}) is None, "the standby is gone too"


def test_nothing_lost_leaves_stages_and_standbys_unchanged():
    plan = grid([A, B], [C, D], unused=[F, E])
    fixed = repair_plan(plan, alive={A, B, C, D, E, F})
    assert ids(fixed) == ids(plan) and list(fixed.unused_peer_ids) == [F, E], "standby order kept"


def test_joiners_are_left_for_grow_plan_and_gone_standbys_are_dropped():
    fixed = repair_plan(grid([A], [B], unused=[C, D]), alive={A, B, D, F, E})
    assert ids(fixed) == [[A], [B]]
    assert list(fixed.unused_peer_ids) == [D], "the plan's standbys stay (C left); joiners E, F are grow_plan's"


def test_several_losses_and_a_preferred_standby():
    plan = grid([A, B], [C, D], unused=[E, F])
    fixed = repair_plan(plan, alive={B, C, E, F}, order=[F])
    assert ids(fixed) == [[F, B], [C, E]], "F preferred (say, fastest), then the plan's order"
    assert standby_pool(plan, {A, B, C, D, E, F, "0z"}, {E}) == [F, "0z"]


def peer(pid: str, version: int = 0, stage: int | None = None, leaving: bool = False) -> PeerAnnouncement:
    layers = {} if stage is None else {"stage": stage, "layer_start": stage, "layer_end": stage + 1}
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0, plan_version=version, leaving=leaving, **layers)


def record(version: int, plan: PlanDocument) -> PlanRecord:
    return PlanRecord(version=version, document=plan, created_at=1.0)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_planner_repairs_at_once_and_searches_only_without_a_standby():
    current = record(3, grid([A, B], [C, D], unused=[E]).replace(trainer_ids=()))
    announced = [peer(A, 3, 0), peer(B, 3, 0), peer(C, 3, 1), peer(D, 3, 1), peer(E, 3)]
    records = {"peers": announced, "plan": [(A, current)]}
    dht, published = swarm(A, records)
    clock = Clock()
    planner = Planner(
        PlanningConfig(min_peers=2, replicas=2), dht, SPEC, 2, settle_s=5.0, probe_wait_s=0.0, clock=clock
    )
    assert planner.round() is None, "nothing changed"
    records["peers"] = [p for p in announced if p.peer_id != D]  # D's record expired
    planner.round()
    assert [v for v, _ in published] == [4], "repaired in the same round: no settle wait"
    assert ids(published[0][1]) == [[A, B], [C, E]]
    # E dies too: no standby is left, so stage 1 serves with one replica fewer, again at once
    records["peers"] = [p for p in records["peers"] if p.peer_id != E]
    planner.round()
    assert [v for v, _ in published] == [4, 5] and ids(published[1][1]) == [[A, B], [C]]
    # C dies: stage 1 has none left and takes stage 0's last replica, B
    records["peers"] = [p for p in records["peers"] if p.peer_id != C]
    planner.round()
    assert [v for v, _ in published] == [4, 5, 6] and ids(published[2][1]) == [[A], [B]]
    # a new peer C joins, then B dies: C (not yet placed) takes B's place... (C joined: stage 0, the tie)
    records["peers"] = [*records["peers"], peer(C)]
    planner.round()
    assert ids(published[3][1]) == [[A, C], [B]], "the joiner became a replica of the busiest stage"
    # B dies: nobody can take stage 1 but C (stage 0 has two): a re-assignment, not a search
    records["peers"] = [p for p in records["peers"] if p.peer_id != B]
    planner.round()
    assert ids(published[4][1]) == [[A], [C]]
    # C dies: stage 1 is empty and stage 0 has one replica: only a full search (after the settle wait) helps
    records["peers"] = [p for p in records["peers"] if p.peer_id != C]
    assert planner.round() is None, "a full search waits for the set to settle"
    clock.t += 6
    planner.round()
    assert [v for v, _ in published] == [4, 5, 6, 7, 8, 9]
    assert [p for s in published[-1][1]["stages"] for p in s["peer_ids"]] == [A], "one peer: one stage"


def test_a_leaving_peer_is_planned_without_while_announced():
    current = record(3, grid([A], [B], unused=[C]).replace(trainer_ids=()))
    records = {"peers": [peer(A, 3, 0), peer(B, 3, 1, leaving=True), peer(C, 3)], "plan": [(A, current)]}
    dht, published = swarm(A, records)
    Planner(PlanningConfig(min_peers=2, replicas=1), dht, SPEC, 2, settle_s=5.0, clock=Clock()).round()
    assert [ids(p) for _, p in published] == [[[A], [C]]]


def test_heartbeats_make_a_silent_peer_gone_after_3_s_and_eligible_again_when_it_answers():
    clock, silent = Clock(), {B}
    pinged: list[str] = []

    def ping(pid: str) -> bool:
        pinged.append(pid)
        return pid not in silent

    live = Liveness(ping, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=clock)
    for _ in range(4):  # t = 100, 101, 102, 103: silent for 3 s, not more
        assert live.round([A, B])
        assert live.gone() == frozenset()
        clock.t += 1
    assert live.gone() == {B}, "t = 104: silent for more than 3 s"
    assert not Liveness(ping, clock=clock).gone(), "a new monitor gives a grace period"
    assert live.round([A, B]) and live.gone() == {B}, "still silent at t = 104"
    before = len(pinged)
    assert not live.round([A, B]) and len(pinged) == before, "at most one round per second"
    silent.clear()
    clock.t += 1
    assert live.round([A, B]) and live.gone() == frozenset(), "it answers: eligible again"
    clock.t += 1
    live.round([A])
    assert B not in live._last_answer, "an unwatched peer is forgotten"
    live.close()


def test_a_planner_that_publishes_pings_every_peer_at_once_with_the_new_version():
    current = record(3, grid([A, B], [C, D], unused=[E]).replace(trainer_ids=()))
    announced = [peer(A, 3, 0), peer(B, 3, 0), peer(C, 3, 1), peer(D, 3, 1), peer(E, 3)]
    records = {"peers": announced, "plan": [(A, current)]}
    dht, published = swarm(A, records)
    publish = dht.publish_plan

    def publish_and_count(version, plan):
        publish(version, plan)
        dht.published_plan = max(dht.published_plan, version)

    dht.publish_plan = publish_and_count
    said, done = [], threading.Condition()

    def ping(pid: str) -> bool:  # what status_prober(newest_plan=...) says with each ping
        with done:
            said.append((pid, dht.published_plan))
            done.notify_all()
        return True

    clock = Clock()
    live = Liveness(ping, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=clock)
    planner = Planner(
        PlanningConfig(min_peers=2, replicas=2), dht, SPEC, 2, settle_s=5.0, probe_wait_s=0.0, clock=clock,
        liveness=live,
    )  # fmt: skip
    assert planner.round() is None and sorted(said) == [(p, 0) for p in (A, B, C, D, E)], "one round, no news"
    records["peers"] = [p for p in announced if p.peer_id != D]  # D's record expired: a repair is published
    planner.round()  # within one second of the last round: only the publish pings
    assert [v for v, _ in published] == [4]
    with done:
        assert done.wait_for(lambda: len(said) == 8, timeout=30), said
    assert sorted(said[5:]) == [(p, 4) for p in (B, C, E)], "every announced peer but itself, told version 4"
    live.close()


def test_a_raising_prober_counts_as_silence():
    clock = Clock()

    def ping(pid: str) -> bool:
        raise RuntimeError("broken")

    live = Liveness(ping, clock=clock)
    for _ in range(4):  # one round a second (a single 3.5 s gap would be the watcher's own stall, not silence)
        live.round([A])
        clock.t += 1.0
    assert live.gone() == {A}
    live.close()


def test_a_watcher_that_was_stalled_does_not_count_its_own_stall_as_everyones_silence():
    """Under load the planner once declared every peer silent: its heartbeat rounds were late, not the peers."""
    clock, silent = Clock(), set()
    live = Liveness(lambda pid: pid not in silent, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=clock)
    live.round([A, B])
    clock.t += 1
    live.round([A, B])
    clock.t += 30  # this process was descheduled for 30 s: no round, no evidence either way
    assert live.gone() == frozenset(), "a stall of the watcher is nobody's silence"
    silent.update({A, B})  # and the first round after the stall times out on the loaded machine
    assert live.round([A, B]) and live.gone() == frozenset(), "one unanswered round is not 3 s of silence"
    assert live.stalled_s == pytest.approx(28.0)
    silent.discard(A)
    for _ in range(3):  # B stays silent through 3 on-schedule rounds: gone, A is not
        clock.t += 1
        live.round([A, B])
    clock.t += 1
    assert live.gone() == {B}
    live.close()


def test_one_slow_ping_over_the_whole_window_is_not_gone():
    """min_misses: silence needs that many consecutive unanswered pings, not one ping that took the window."""
    clock = Clock()
    live = Liveness(lambda pid: False, LivenessConfig(every_s=1.0, gone_after_s=3.0, min_misses=2), clock=clock)
    live.round([A])
    clock.t += 2.0
    live.round([A])  # on schedule (2 s is within max_gap_s)
    clock.t += 2.0
    assert live.gone() == {A}, "2 misses over 4 s: gone"
    fresh = Liveness(lambda pid: False, LivenessConfig(every_s=1.0, gone_after_s=3.0, min_misses=3), clock=clock)
    fresh.round([A])
    clock.t += 2.0
    fresh.round([A])
    clock.t += 2.0
    assert fresh.gone() == frozenset(), "2 misses of 3 needed"
    with pytest.raises(ValueError, match="min_misses"):
        LivenessConfig(min_misses=0)
    live.close()
    fresh.close()


def test_the_planner_repairs_around_a_peer_that_stops_answering_before_its_record_expires():
    current = record(3, grid([A, B], [C, D], unused=[E]).replace(trainer_ids=()))
    announced = [peer(A, 3, 0), peer(B, 3, 0), peer(C, 3, 1), peer(D, 3, 1), peer(E, 3)]
    dht, published = swarm(A, {"peers": announced, "plan": [(A, current)]})
    clock = Clock()
    live = Liveness(lambda pid: pid != C, clock=clock)
    planner = Planner(PlanningConfig(min_peers=2, replicas=2), dht, SPEC, 2, settle_s=5.0, clock=clock, liveness=live)
    for _ in range(4):
        planner.round()
        clock.t += 1
    assert published == [], "3 s of silence is not yet gone"
    planner.round()
    assert [ids(p) for _, p in published] == [[[A, B], [E, D]]], "C's place goes to E; its record is still there"
    live.close()


def test_replicas_flag_plans_that_many_replicas_of_every_stage_when_the_peers_allow():
    import numpy as np

    from swarm.daemon.planning import live_search
    from swarm.scheduler import Peer, PlanInput, plan

    n = 5
    peers = tuple(Peer(f"p{i}", 1e12, 1e12, "r") for i in range(n))
    inp = PlanInput(peers, np.full((n, n), 1e-3), np.where(np.eye(n, dtype=bool), np.inf, 1e8))
    made = plan(inp, SPEC, live_search(2, 0, replicas=2))
    assert [len(s.peer_ids) for s in made.stages] == [2, 2] and len(made.unused_peer_ids) == 1
    fewer = plan(inp, SPEC, live_search(2, 0, replicas=3))
    assert [len(s.peer_ids) for s in fewer.stages] == [2, 2], "5 peers hold 2 stages x 2 at most"
    assert [len(s.peer_ids) for s in plan(inp, SPEC, live_search(2)).stages] == [1, 1], "the default stays 1"


def test_with_replicas_set_a_joiner_becomes_a_replica_of_the_busiest_stage_at_once():
    current = record(3, grid([A], [B]).replace(trainer_ids=()))
    records = {"peers": [peer(A, 3, 0), peer(B, 3, 1)], "plan": [(A, current)]}
    dht, published = swarm(A, records)
    planner = Planner(PlanningConfig(min_peers=2, replicas=1), dht, SPEC, 2, settle_s=5.0, clock=Clock())
    records["peers"] = [*records["peers"], peer(C)]
    planner.round()
    assert [(v, ids(p), p["unused_peer_ids"]) for v, p in published] == [(4, [[A, C], [B]], [])], (
        "equal speeds and layers: the tie goes to stage 0; no settle wait, --replicas 1 does not cap growth"
    )
    records["peers"] = [peer(A, 4, 0), peer(B, 4, 1), peer(C, 4, 0), peer(D)]
    planner.round()
    assert ids(published[-1][1]) == [[A, C], [B, D]], "now stage 1 is the busiest"


def test_a_planner_with_a_standby_keeps_it_and_grows_with_the_joiner():
    current = record(3, grid([A], [B], unused=[C]).replace(trainer_ids=()))
    records = {"peers": [peer(A, 3, 0), peer(B, 3, 1), peer(C, 3), peer(D)], "plan": [(A, current)]}
    dht, published = swarm(A, records)
    Planner(PlanningConfig(min_peers=2, replicas=1), dht, SPEC, 2, settle_s=5.0, clock=Clock()).round()
    assert [(ids(p), p["unused_peer_ids"]) for _, p in published] == [([[A, D], [B]], [C])]


def test_a_planner_taking_over_from_a_dead_planner_re_plans_below_min_peers():
    old = record(2, grid([A], [B]).replace(trainer_ids=()))  # published by A, which died
    dht, published = swarm(B, {"peers": [peer(B, 2, 1)], "plan": [(A, old)]})
    Planner(
        PlanningConfig(min_peers=2, replicas=1), dht, SPEC, 2, settle_s=0.0, probe_wait_s=0.0, clock=Clock()
    ).round()
    assert [(v, ids(p)) for v, p in published] == [(3, [[B]])], "B follows plan 2: the swarm had a plan"


def test_the_planner_says_why_it_plans_without_a_peer_of_its_plan(caplog):
    import logging

    current = record(3, grid([A, B], [C, D], unused=[E]).replace(trainer_ids=()))
    announced = [peer(A, 3, 0), peer(B, 3, 0), peer(C, 3, 1), peer(D, 3, 1), peer(E, 3)]
    state = {"peers": announced, "plan": [(A, current)]}
    dht, _ = swarm(A, state)
    clock = Clock()
    live = Liveness(lambda pid: pid != C, clock=clock)
    planner = Planner(PlanningConfig(min_peers=2, replicas=2), dht, SPEC, 2, settle_s=5.0, clock=clock, liveness=live)
    with caplog.at_level(logging.INFO, logger="swarm.daemon.planning"):
        planner.round()  # the planner holds plan 3
        state["peers"] = [p for p in announced if p.peer_id != D]  # D's record lapses (a live peer's, say)
        for _ in range(6):
            clock.t += 1
            planner.round()
    lines = [r.getMessage() for r in caplog.records if "planning without" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    assert f"{D} (not announced (its DHT record lapsed))" in lines[0] and C not in lines[0]
    assert f"{C} (silent to the heartbeats)" in lines[-1], "C's silence is named once it counts"
    assert len(lines) == len(set(lines)), "logged once per change"
    live.close()
