"""Bans: peers the run's trainers evicted are planned without, for the run; a stranger's ban counts for nothing."""

from __future__ import annotations

import pytest

from swarm.daemon.bans import RunBans
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner
from swarm.peers.records import MAX_BANNED, TrainerAnnouncement
from tests.unit.daemon.test_planner_versions import SPEC, swarm
from tests.unit.daemon.test_repair import A, B, C, Clock, grid, ids, peer, record

T, STRANGER = "0t0000000000", "0s0000000000"


def test_a_trainer_announcement_carries_its_bans_checked():
    ann = TrainerAnnouncement(T, 1.0, banned=[B])
    assert ann.banned == (B,) and TrainerAnnouncement.from_wire(ann.to_wire()) == ann
    assert TrainerAnnouncement.from_wire({"peer_id": T}).banned == (), "an older trainer's record"
    with pytest.raises(ValueError, match="banned"):
        TrainerAnnouncement(T, banned=["not a peer id!"])
    with pytest.raises(ValueError, match="banned"):
        TrainerAnnouncement(T, banned=[f"p{i}" for i in range(MAX_BANNED + 1)])
    with pytest.raises(ValueError, match="banned"):
        TrainerAnnouncement.from_wire({"peer_id": T, "banned": "0b0000000000"})


def test_only_the_plans_trainers_ban_and_bans_outlive_their_announcement():
    bans = RunBans()
    plan = record(3, grid([A], [B]).replace(trainer_ids=(T,)))
    assert bans.update([TrainerAnnouncement(STRANGER, banned=[A])], plan) == frozenset(), "not a trainer of the plan"
    assert bans.update([TrainerAnnouncement(T, banned=[B])], None) == frozenset(), "no plan vouches for anyone yet"
    assert bans.update([TrainerAnnouncement(T, banned=[B, T])], plan) == {B}, "a trainer does not ban itself"
    assert bans.update([], plan) == {B}, "remembered after the trainer's announcement is gone"


def test_the_planner_repairs_the_plan_without_a_banned_peer_and_never_plans_it_again():
    current = record(3, grid([A], [B], unused=[C]).replace(trainer_ids=(T,)))
    records = {
        "peers": [peer(A, 3, 0), peer(B, 3, 1), peer(C, 3)],
        "plan": [(A, current)],
        "trainers": [TrainerAnnouncement(T, banned=[B])],
    }
    dht, published = swarm(A, records)
    clock = Clock()
    planner = Planner(PlanningConfig(min_peers=2, replicas=1), dht, SPEC, 2, settle_s=5.0, clock=clock)
    planner.round()
    assert [ids(p) for _, p in published] == [[[A], [C]]], "C, the standby, takes the banned peer's place"
    records["trainers"] = [TrainerAnnouncement(T)]  # the trainer restarted and forgot: the planner has not
    clock.t += 10
    planner.round()
    assert all(B not in sum(ids(p), []) for _, p in published)
