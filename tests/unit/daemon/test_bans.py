"""Bans: peers the run's trainers evicted are planned without, for the run; a stranger's ban counts for nothing."""

from __future__ import annotations

import pytest

from swarm.daemon.bans import RunBans, announced_bans, trusted_sources
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner
from swarm.peers.records import MAX_BANNED, TrainerAnnouncement
from tests.unit.daemon.test_planner_versions import SPEC, swarm
from tests.unit.daemon.test_repair import A, B, C, Clock, D, E, grid, ids, peer, record

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


def test_a_standby_taking_an_evicted_liars_place_copies_its_sibling_never_the_liar():
    """Seen in the attacks experiment: the standby that replaced a banned liar (still announced, first in the old
    plan's order) copied the liar's state, a step behind its sibling's (the liar's eviction ran that step again
    without it), and every audit after disputed the two replicas until the run stopped."""
    old = record(3, grid([B, A], [C]).replace(trainer_ids=(T,)))  # B, the liar, is replica 0 of stage 0
    new = record(4, grid([E, A], [C]).replace(trainer_ids=(T,)))  # E, the standby, takes B's place
    banned = announced_bans([TrainerAnnouncement(T, banned=[B]), TrainerAnnouncement(STRANGER, banned=[A])], new)
    assert banned == {B}, "only the plan's trainers ban"
    replicas, held = trusted_sources([B, A], [(B, 9), (D, 5)], new, (0, 1), banned)
    assert replicas == [A] and held == [(D, 5)]
    # a peer leaving the plan (not banned) still hands its stage over, after the replicas the new plan keeps
    assert trusted_sources([B, A], [], new, (0, 1), frozenset())[0] == [A, B]
    assert trusted_sources([B, A], [], None, (0, 1), frozenset())[0] == [B, A]
    assert announced_bans([TrainerAnnouncement(T, banned=[B])], old) == {B} and announced_bans([], None) == set()


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


def test_the_trainer_hands_one_suspects_to_every_driver_so_bans_survive_a_replan(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import swarm.runtime.driver
    from swarm.runtime.routing import NoLiveRoute
    from swarm.runtime.suspects import Suspects
    from swarm.train.trainer import TrainConfig, train
    from tests.unit.daemon.test_trainer_churn import TINY, FakeDriver, ann, plan

    given = []

    class Recording(FakeDriver):
        def __init__(self, *args, suspects=None, **kwargs):
            given.append(suspects)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(swarm.runtime.driver, "PipelineDriver", Recording)
    FakeDriver.made, FakeDriver.calls, FakeDriver.failure = [], [], NoLiveRoute("stage 1: peer p4 evicted")
    v1, v2 = plan(1, [["p1"], ["p4"]]), plan(2, [["p1"], ["p5"]])
    state = {"plan": v1, "peers": [ann("p1", 0, 1), ann("p4", 1, 1)]}

    def get_plan(n_layers=None, peers=None):
        if FakeDriver.failure is None:  # the planner's repair without the banned p4
            state["plan"], state["peers"] = v2, [ann("p1", 0, 2), ann("p5", 1, 2)]
        return state["plan"]

    dht = SimpleNamespace(peer_id="me", peers=lambda: state["peers"], get_plan=get_plan)
    cfg = TrainConfig(model=TINY, train_samples=8, batch_size=4, micro_batches=2, steps=2, out=str(tmp_path),
                      replan_timeout_s=30.0, eval_samples=0)  # fmt: skip
    suspects = Suspects()
    train(cfg, v1.document.route_of(state["peers"], 1), quiet=True, dht=dht, suspects=suspects)
    assert len(given) == 2 and all(s is suspects for s in given)
