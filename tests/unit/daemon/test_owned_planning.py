"""In an owned run plan authority and trainer names come only from the owner's delegation: a stranger with a
ground low id and a lease is neither followed nor elected, stranger trainers are never named, Sybils cannot
freeze re-planning, and failover among the delegated planners stays automatic. No DHT process: the records are
served from memory (`test_planner_versions.swarm`)."""

from __future__ import annotations

import dataclasses
import logging

from hivemind.utils.crypto import RSAPrivateKey

from swarm.peers.fields import MAX_PLAN_VERSION
from swarm.peers.manifest import RunDelegation, RunManifest
from swarm.peers.owned import OwnedRun
from swarm.peers.records import TrainerAnnouncement
from tests.unit.daemon.test_planner_versions import peer, planner, swarm, two_stages

OWNER = RSAPrivateKey()
P1, P2, T = "5a" * 12, "6b" * 12, "7c" * 12  # the delegated planners and trainer
STRANGER = "00000" + "1" * 19  # a ground low id, below every delegate
SYBILS = [f"{i:05x}" + "0" * 19 for i in range(20)]
NOW = 1e6  # the fake swarm's DHT time (leases are compared with it)


def manifest(planners=(P1,), trainers=(T,)) -> RunManifest:
    return RunManifest.create(
        OWNER, name="owned", created_at=1.0, model={"layers": 2}, codecs={"fw_codec": "fp32", "bw_codec": "fp32"},
        lr=1e-3, warmup_steps=1, total_steps=10, planners=planners, trainers=trainers,
    )  # fmt: skip


def owned(me: str, records: dict, m: RunManifest | None = None):
    """A fake SwarmDHT of the owned run `m` (default: planner P1, trainer T) over `records`; delegations are
    records["delegations"]."""
    dht, published = swarm(me, records)
    read = lambda kind: list(records.get(kind, []))
    dht._run = OwnedRun(m or manifest(), read, store=lambda *_: True, warn=dht._warn)
    return dht, published


def leased(pid: str, version: int = 0, until: float = NOW + 3.0):
    return dataclasses.replace(peer(pid, version), planner_until=until)


def test_a_stranger_with_a_ground_low_id_and_a_lease_is_not_followed_and_is_named_once(caplog):
    good = two_stages(2, P1, P2)
    hijack = two_stages(99, STRANGER, P2, trainer_ids=[STRANGER])
    records = {
        "peers": [peer(P1, 2), peer(P2, 2), leased(STRANGER)],
        "plan": [(P1, good), (STRANGER, hijack)],
        "trainers": [TrainerAnnouncement(STRANGER)],
    }
    dht, _ = owned(P2, records)
    with caplog.at_level(logging.WARNING, logger="swarm.peers.dht"):
        for _ in range(5):  # five polls
            assert dht.get_plan(2, check_trainers=False) == good
    refused = [r.getMessage() for r in caplog.records if "refusing plan 99" in r.getMessage()]
    assert len(refused) == 1 and STRANGER in refused[0] and "delegated" in refused[0]
    assert dht.plan_authority(records["peers"]) == {P1}
    assert dht.trainers() == [], "a stranger's trainer announcement is not the owner's trainer"


def test_a_stranger_is_never_elected_whatever_its_id_or_lease():
    records = {"peers": [leased(STRANGER), peer(P1), peer(P2)]}
    stranger, _ = owned(STRANGER, records)
    assert not planner(stranger, dht_time=lambda: NOW).is_leader(records["peers"])
    p1, _ = owned(P1, records)
    assert planner(p1, dht_time=lambda: NOW).is_leader(records["peers"]), "the delegate plans despite the lease"


def test_sixteen_stranger_trainers_with_low_ids_leave_only_the_delegated_trainer_in_the_plan():
    strangers = [TrainerAnnouncement(f"{i:02x}" + "0" * 22) for i in range(16)]
    records = {"peers": [peer(P1), peer(P2)], "trainers": [*strangers, TrainerAnnouncement(T)]}
    dht, published = owned(P1, records)
    assert planner(dht, dht_time=lambda: NOW).round() is not None
    assert [wire.get("trainer_ids") for _, wire in published] == [[T]]


def test_sybils_and_a_killed_planner_hand_planning_to_the_other_delegate():
    m = manifest(planners=(P1, P2))
    current = two_stages(3, P1, P2)
    dead_p1 = leased(P1, 3, until=NOW - 1.0)  # killed: its lease lapsed, its announcement not expired yet
    sybils = [peer(s) for s in SYBILS]  # lower ids than every delegate, no lease
    records = {"peers": [dead_p1, peer(P2, 3), *sybils], "plan": [(P1, current)]}
    for sybil in SYBILS[:3]:
        dht, published = owned(sybil, records, m)
        assert not planner(dht, dht_time=lambda: NOW).is_leader(records["peers"]) and not published
    p2, _ = owned(P2, records, m)
    assert planner(p2, dht_time=lambda: NOW).is_leader(records["peers"]), "failover among the delegates"
    reader, _ = owned(SYBILS[0], records, m)
    assert reader.get_plan(2, check_trainers=False) == current, "readers keep the delegated planner's plan"


def test_with_one_delegate_dead_the_run_keeps_its_plan_and_the_sybils_never_plan():
    current = two_stages(3, P1, P2)
    records = {"peers": [leased(P1, 3, until=NOW - 1.0), peer(P2, 3), *(peer(s) for s in SYBILS)]}
    records["plan"] = [(P1, current)]
    for me in (P2, *SYBILS[:3]):
        dht, published = owned(me, records)
        assert planner(dht, dht_time=lambda: NOW).round() is None and not published
    dht, _ = owned(P2, records)
    assert dht.get_plan(2, check_trainers=False) == current


def test_announced_plan_versions_cannot_inflate_an_owned_runs_next_version():
    records = {
        "peers": [peer(P1, 3), peer(STRANGER, MAX_PLAN_VERSION), peer(P2)],
        "plan": [(P1, two_stages(3, P1, P2))],
    }
    dht, _ = owned(P1, records)
    assert planner(dht).next_version(records["peers"]) == 4


def test_the_owners_delegation_moves_planning_and_a_revoked_planner_is_refused():
    m = manifest(planners=(P1,))
    revoke = RunDelegation.create(OWNER, m, 1, planners=[P2], trainers=[T], revoked=[P1], created_at=2.0)
    records = {"peers": [peer(P1, 2), peer(P2, 2)], "plan": [(P1, two_stages(2, P1, P2))]}
    dht, _ = owned(P2, records, m)
    assert dht.plan_authority(records["peers"]) == {P1}
    records["delegations"] = [revoke]
    assert dht.authority(max_age_s=0.0).planners == {P2}, "re-read: the owner's delegation 1"
    assert dht.plan_authority(records["peers"]) == {P2}
    assert dht.get_plan(2) is None, "the revoked planner's plan no longer counts"
    assert planner(dht, dht_time=lambda: NOW).is_leader(records["peers"])
    # an old delegation replayed (the manifest's P1 again, or a forged one) changes nothing
    records["delegations"] = []
    assert dht.authority(max_age_s=0.0).planners == {P2}
    assert dht.plan_authority(records["peers"]) == {P2}


def test_a_foreign_delegation_in_the_dht_is_refused_by_name(caplog):
    m = manifest()
    other_owner = RSAPrivateKey()
    other = RunManifest.create(
        other_owner, name="other", created_at=1.0, model={}, codecs={"fw_codec": "fp32", "bw_codec": "fp32"},
        lr=1e-3, warmup_steps=1, total_steps=10, planners=[STRANGER], trainers=[STRANGER],
    )  # fmt: skip
    foreign = RunDelegation.create(other_owner, other, 7, planners=[STRANGER], trainers=[], created_at=2.0)
    dht, _ = owned(P2, {"peers": [peer(P1)], "delegations": [foreign]}, m)
    with caplog.at_level(logging.WARNING, logger="swarm.peers.dht"):
        assert dht.plan_authority([peer(P1)]) == {P1}
    assert any("refusing a delegation" in r.getMessage() for r in caplog.records)


def test_an_owned_run_with_no_planner_delegated_has_nobody_planning():
    m = manifest(planners=())
    records = {"peers": [peer(P1), peer(STRANGER)]}
    for me in (P1, STRANGER):
        dht, _ = owned(me, records, m)
        assert not planner(dht, dht_time=lambda: NOW).is_leader(records["peers"])
        assert dht.followed_plan(2, records["peers"]) is None
