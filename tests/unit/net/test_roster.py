"""The daemon's roster: stage peers from the plan, addresses from the announcements, trainers from the plan
(or the run's allowlist), and the even split's roster as the trainer's discover_route picks it."""

from __future__ import annotations

import threading

import grpc
import pytest

from swarm.daemon.roster import (
    AddressBook,
    delegated_trainers,
    retry_refused,
    roster_from_announcements,
    roster_from_plan,
)
from swarm.peers.records import PeerAnnouncement, PlanRecord


def ann(pid: str, port: int, stage: int | None = None, started: float = 1.0, version: int = 0) -> PeerAnnouncement:
    return PeerAnnouncement(
        peer_id=pid, address=f"127.0.0.1:{port}", device="cpu", memory_bytes=1, compute_layers_per_s=1.0,
        stage=stage, layer_start=None if stage is None else stage, layer_end=None if stage is None else stage + 1,
        plan_version=version, started_at=started,
    )  # fmt: skip


def plan(**extra) -> PlanRecord:
    stages = [
        {"layer_start": 0, "layer_end": 2, "peer_ids": ["a"]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": ["b", "c"]},
    ]
    return PlanRecord(version=3, document={"stages": stages, "unused_peer_ids": ["d"], **extra}, created_at=1.0)


PEERS = [ann("a", 1001), ann("b", 1002), ann("c", 1003), ann("d", 1004)]


def test_plan_roster_takes_stage_peers_addresses_and_trainers():
    roster = roster_from_plan(plan(trainer_ids=["t1", "t2"]), PEERS)
    assert roster.route(0) == (("127.0.0.1:1001", "127.0.0.1:1002"), ("a", "b"))
    assert roster.trainers == {"t1", "t2"}
    assert roster.plan_peers == {"a", "b", "c", "d"}


def test_plan_without_trainer_ids_is_public_unless_the_run_names_its_trainers():
    assert roster_from_plan(plan(), PEERS).trainers is None
    assert roster_from_plan(plan(), PEERS, allowed_trainers=["t"]).trainers == {"t"}
    assert roster_from_plan(plan(trainer_ids=["t", "x"]), PEERS, allowed_trainers=["t"]).trainers == {"t"}


def test_plan_roster_waits_for_every_stage_address():
    assert roster_from_plan(plan(), PEERS[1:]) is None
    own = roster_from_plan(plan(), PEERS[1:], known={"a": "127.0.0.1:9"})
    assert own.replica_addresses(0) == ("127.0.0.1:9",)


def test_even_split_roster_is_the_first_announcer_of_each_stage():
    peers = [ann("late", 1, stage=0, started=5.0), ann("s0", 2, stage=0, started=1.0), ann("s1", 3, stage=1)]
    roster = roster_from_announcements(peers, 2)
    assert roster.route(0)[1] == ("s0", "s1") and roster.trainers is None
    assert roster_from_announcements(peers, 3) is None


class FakeDHT:
    def __init__(self, peers):
        self.peers_now, self.reads = peers, 0

    def peers(self):
        self.reads += 1
        return self.peers_now


def test_address_book_resolves_and_rate_limits_misses():
    dht = FakeDHT(PEERS)
    book = AddressBook(dht, refresh_s=3600)
    assert book("127.0.0.1:1002") == "b"
    assert book("127.0.0.1:1") is None and book("127.0.0.1:2") is None
    assert dht.reads == 1


class Refused(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def test_state_fetch_is_retried_while_the_holder_does_not_know_the_plan_yet():
    answers = [Refused(grpc.StatusCode.PERMISSION_DENIED), Refused(grpc.StatusCode.PERMISSION_DENIED), {"w": 1}]

    def fetch(x):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return {**answer, "x": x}

    assert retry_refused(threading.Event(), fetch, 7, poll_s=0.001) == {"w": 1, "x": 7}
    with pytest.raises(Refused):  # other failures are not retried
        retry_refused(threading.Event(), lambda: (_ for _ in ()).throw(Refused(grpc.StatusCode.UNAVAILABLE)))


def test_an_owned_runs_roster_keeps_only_the_trainers_the_owner_delegates_now():
    # the plan still names t2, whom the owner revoked after the planner published it: the stage refuses t2 now
    assert roster_from_plan(plan(trainer_ids=["t1", "t2"]), PEERS, delegated_trainers={"t1"}).trainers == {"t1"}
    assert roster_from_plan(plan(trainer_ids=["t2"]), PEERS, delegated_trainers={"t1"}).trainers == frozenset()
    assert roster_from_plan(plan(), PEERS, delegated_trainers={"t1"}).trainers == {"t1"}  # no trainer_ids: the owner's
    assert roster_from_plan(plan(trainer_ids=["t1"]), PEERS, delegated_trainers=None).trainers == {"t1"}  # unowned


def test_the_address_book_says_when_the_delegation_moved_and_the_roster_must_be_made_again():
    from swarm.runtime.policy import CallPolicy

    delegated = {"now": frozenset({"t1", "t2"})}
    book = AddressBook(FakeDHT(PEERS), delegated=lambda: delegated["now"])
    mine = ann("a", 1001)
    roster = book.plan_roster(plan(trainer_ids=["t1", "t2"]), mine)
    assert roster.trainers == {"t1", "t2"} and not book.delegation_changed()
    CallPolicy(roster).check_step("Step", "t2")  # served while delegated
    delegated["now"] = frozenset({"t1"})  # the owner revokes t2
    assert book.delegation_changed() and book.delegation_changed()  # until the roster is made again
    roster = book.plan_roster(plan(trainer_ids=["t1", "t2"]), mine)
    assert roster.trainers == {"t1"} and not book.delegation_changed()
    with pytest.raises(Exception, match="t2 is not one"):
        CallPolicy(roster).check_step("Step", "t2")
    assert not AddressBook(FakeDHT(PEERS)).delegation_changed()  # an unowned run: never


def test_delegated_trainers_are_the_owners_current_ones_and_none_outside_an_owned_run():
    from swarm.peers.manifest import RunAuthority

    class Owned:
        def authority(self):
            return RunAuthority(planners=frozenset({"p"}), trainers=frozenset({"t1"}), revoked=frozenset({"t2"}))

    class Unowned:
        def authority(self):
            return None

    assert delegated_trainers(Owned()) == {"t1"} and delegated_trainers(Unowned()) is None
