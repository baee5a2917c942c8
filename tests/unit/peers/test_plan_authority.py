"""Readers take a plan only from its authority: the trusted planners when named, else the elected planner
(the lowest announced id). A forged plan v500 from anyone else is ignored, and so is an invalid plan from the
authority, with one warning, while readers keep the last good one. No DHT process: the records are served
from memory in place of the DHT's."""

from __future__ import annotations

import logging

import pytest

from swarm.peers.dht import SwarmDHT
from swarm.peers.dht_config import DHTConfig
from swarm.peers.entries import RunKeys
from swarm.peers.records import PeerAnnouncement, PlanRecord, TrainerAnnouncement

A, B, M = "0a0000000000", "0b0000000000", "0f0000000000"  # A is elected; M is the attacker


def peer(pid: str, plan_version: int = 0) -> PeerAnnouncement:
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0, plan_version=plan_version)


def plan(version: int, *ids: str, layers: int = 2, **extra) -> PlanRecord:
    stages = [{"layer_start": i, "layer_end": i + 1, "peer_ids": [pid]} for i, pid in enumerate(ids)]
    stages[-1]["layer_end"] = layers
    return PlanRecord(version=version, document={"stages": stages, **extra}, created_at=float(version))


def reader(records: dict[str, list], **config) -> SwarmDHT:
    dht = SwarmDHT.__new__(SwarmDHT)  # the record logic only: no DHT process
    dht.config, dht.peer_id, dht._warned = DHTConfig(**config), "reader", set()
    dht._keys = RunKeys.of_run("run")
    dht._parse_all = lambda key, kind: list(records.get(kind, []))
    return dht


def test_a_higher_plan_from_a_peer_that_is_not_elected_is_ignored():
    good = plan(2, A, B)
    forged = plan(500, M, B)  # the attacker routes every trainer through itself
    dht = reader({"peers": [peer(A), peer(B), peer(M)], "plan": [(A, good), (M, forged)]})
    assert dht.get_plan(2) == good


def test_trusted_planners_are_the_only_authority_when_named():
    records = {"peers": [peer(A), peer(B), peer(M)], "plan": [(A, plan(2, A, B)), (B, plan(3, B, A))]}
    assert reader(records, trusted_planners=(B,)).get_plan(2).version == 3
    assert reader(records, trusted_planners=(M,)).get_plan(2) is None
    assert reader(records).get_plan(2).version == 2, "without trusted planners: the elected (lowest) id"


def test_an_invalid_plan_from_the_authority_is_skipped_with_one_warning_and_the_last_good_one_kept(caplog):
    good, crashing = plan(2, A, B), plan(3, A, B, layers=1000000)
    dht = reader({"peers": [peer(A), peer(B)], "plan": [(A, good), (A, crashing)]})
    with caplog.at_level(logging.WARNING, logger="swarm.peers.dht"):
        for _ in range(5):  # five polls
            assert dht.get_plan(2) == good
    skipped = [r for r in caplog.records if "skipping plan 3" in r.getMessage()]
    assert len(skipped) == 1 and "plan.stages[1].layer_end" in skipped[0].getMessage()


def test_a_plan_naming_an_unannounced_peer_or_trainer_is_not_followed():
    records = {"peers": [peer(A), peer(B)], "trainers": [TrainerAnnouncement("t1")]}
    assert reader({**records, "plan": [(A, plan(2, A, M))]}).get_plan(2) is None
    named = plan(2, A, B, trainer_ids=["t2"])
    assert reader({**records, "plan": [(A, named)]}).get_plan(2) is None
    assert reader({**records, "plan": [(A, named)]}).get_plan(2, check_trainers=False) == named


def test_a_poll_for_a_newer_plan_reads_the_trainers_only_once_one_is_out():
    reads: list[str] = []
    named = plan(2, A, B, trainer_ids=["t1"])
    records = {"peers": [peer(A), peer(B)], "trainers": [TrainerAnnouncement("t1")], "plan": [(A, named)]}
    dht = reader(records)
    dht._parse_all = lambda key, kind: reads.append(kind) or list(records.get(kind, []))
    peers = dht.peers()
    reads.clear()
    assert dht.get_plan(2, peers=peers, newer_than=2) is None
    assert reads == ["plan"], "nothing newer than the followed plan: the trainers are not read"
    reads.clear()
    assert dht.get_plan(2, peers=peers, newer_than=1) == named
    assert reads == ["plan", "trainers"], "a newer plan is validated as before, its trainers included"
    unnamed = plan(3, A, B, trainer_ids=["t9"])  # a newer plan that names an unannounced trainer
    records["plan"] = [(A, named), (A, unnamed)]
    assert dht.get_plan(2, peers=peers, newer_than=2) is None, "the newer plan is invalid: not followed"
    assert dht.get_plan(2, peers=peers, newer_than=1) == named, "an older valid plan, still newer than followed"


def test_trainers_outside_the_allowed_list_are_not_seen():
    records = {"trainers": [TrainerAnnouncement("t1"), TrainerAnnouncement("t2")]}
    assert [t.peer_id for t in reader(records).trainers()] == ["t1", "t2"]
    assert [t.peer_id for t in reader(records, allowed_trainers=("t2",)).trainers()] == ["t2"]


def test_the_newest_version_counts_the_authoritys_invalid_plans_too():
    dht = reader({"peers": [peer(A), peer(B)], "plan": [(A, plan(2, A, B)), (A, plan(7, A, M)), (M, plan(99, M))]})
    assert dht.newest_plan_version([peer(A), peer(B)]) == 7


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65])
def test_trusted_and_allowed_ids_are_checked(bad):
    with pytest.raises(ValueError, match="trusted_planners"):
        DHTConfig(trusted_planners=(bad,))
    with pytest.raises(ValueError, match="allowed_trainers"):
        DHTConfig(allowed_trainers=(bad,))


def test_the_run_secret_is_never_shown():
    assert "hunter2" not in repr(DHTConfig(run_secret="hunter2"))
    assert "hunter2" not in str(DHTConfig(run_secret="hunter2"))


def test_the_node_remembers_the_newest_plan_it_stored_for_the_planners_heartbeats():
    dht = reader({})
    dht._owner = b"owner"
    stored = []
    dht._store = lambda key, subkey, value, ttl: stored.append(subkey) or len(stored) != 3  # the third store fails
    document = plan(1, A, B).document
    assert dht.publish_plan(5, document) and dht.published_plan == 5
    assert dht.publish_plan(4, document) and dht.published_plan == 5, "an older version stored later: still 5"
    assert not dht.publish_plan(9, document) and dht.published_plan == 5, "a version not stored is not said"
    assert len(stored) == 3
