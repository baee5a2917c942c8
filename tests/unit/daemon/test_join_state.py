"""A joiner made one more replica of a stage (issue 12) copies that stage's state from a live replica before it
announces that it serves: from its standby plan's holders, or (its first plan already names it) from the new
plan's other replicas. Daemon paths with stub DHT, servicer and host: no processes, no sockets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import swarm.daemon.liveness as liveness
import swarm.daemon.state_fetch as state_fetch
import swarm.runtime.checkpoint as checkpoint
from swarm.daemon.handover import StateHandover
from swarm.daemon.held import buddy_of
from swarm.daemon.peer import PeerConfig, PeerDaemon
from swarm.daemon.replication import served_by_replicas
from swarm.peers.records import PeerAnnouncement, PlanRecord

A, B, C, J = "0a0000000000", "0b0000000000", "0c0000000000", "0j0000000000"
ADDRESS = {A: "127.0.0.1:5000", B: "127.0.0.1:5001", C: "127.0.0.1:5002", J: "127.0.0.1:5009"}


def ann(pid: str, version: int, stage: int | None = None) -> PeerAnnouncement:
    layers = {} if stage is None else {"stage": stage, "layer_start": stage, "layer_end": stage + 1}
    return PeerAnnouncement(pid, ADDRESS[pid], "cpu", 1 << 30, 1.0, plan_version=version, **layers)


def record(version: int, *rows: list[str], unused: list[str] = (), trainers: list[str] = ()) -> PlanRecord:
    stages = [{"layer_start": s, "layer_end": s + 1, "peer_ids": list(r)} for s, r in enumerate(rows)]
    document = {"stages": stages, "unused_peer_ids": list(unused), **({"trainer_ids": trainers} if trainers else {})}
    return PlanRecord(version=version, document=document, created_at=1.0)


class Servicer:
    """The StageServicer calls `_apply_plan` makes, recorded."""

    def __init__(self, events: list):
        self.host = self.previous = None
        self.policy = SimpleNamespace(roster=None)
        self.events = events

    def swap(self, host, timeout_s, plan_version=0, roster=None):
        self.host = host
        self.events.append(("swap", plan_version))
        return True

    def set_roster(self, roster):
        pass

    def when_idle(self, change, timeout_s):
        change(self)
        return True


class _Host(SimpleNamespace):
    """A stage host as the plan switch uses it."""

    def restore(self, steps_done: int) -> None:
        self.steps_done = max(self.steps_done, steps_done)


def joiner(monkeypatch, peers: list[PeerAnnouncement], following: PlanRecord | None, trainers=()):
    """A PeerDaemon for J whose GetState fetches, state loads and announcements land in `events` (`trainers`:
    the trainers' announcements in the DHT)."""
    events: list = []
    daemon = PeerDaemon(PeerConfig())
    daemon.following = following
    announce = lambda a: events.append(("announce", a))  # noqa: E731
    daemon.dht = SimpleNamespace(peer_id=J, peers=lambda: list(peers), announce=announce, trainers=lambda: trainers)
    daemon.book = SimpleNamespace(plan_roster=lambda record, me: None)
    daemon.servicer = Servicer(events)
    daemon.channels = None
    daemon.handover = StateHandover(daemon.dht, daemon.channels, daemon.checkpoints, daemon._stop)
    daemon.announcement = ann(J, 0)
    daemon._make_host = lambda role, plan=None: _Host(role=role, worker=SimpleNamespace(step_count=7), steps_done=0)

    def fetch_state(channels, address, stage, version, *rest, **kw):
        events.append(("fetch", address, stage, version))
        return {"model.w": torch.ones(2), "meta.steps_done": torch.tensor([7.0])}

    def take_over(worker, tensors):
        events.append(("take_over", sorted(tensors)))
        return len(tensors), [], 7

    monkeypatch.setattr(state_fetch, "fetch_state", fetch_state)
    monkeypatch.setattr(checkpoint, "take_over", take_over)
    monkeypatch.setattr(liveness, "status_prober", lambda channels, addresses, **kw: lambda pid: True)
    return daemon, events


def test_a_standby_made_a_replica_copies_the_stage_from_its_live_replica_before_announcing(monkeypatch):
    standby = record(3, [A], [B], unused=[J])
    grown = record(4, [A], [B, J])
    peers = [ann(A, 4, 0), ann(B, 4, 1), ann(J, 3)]
    daemon, events = joiner(monkeypatch, peers, following=standby)
    daemon._apply_plan(grown)
    assert events[:2] == [("fetch", ADDRESS[B], 1, 3), ("take_over", ["meta.steps_done", "model.w"])]
    assert events[2] == ("swap", 4)
    announced = events[3][1]
    assert events[3][0] == "announce" and (announced.stage, announced.plan_version) == (1, 4), "serves after"
    assert daemon.servicer.host.steps_done == 7 and daemon.servicer.host.role.replica == 1


def test_a_standby_taking_a_banned_liars_place_copies_the_sibling_never_the_liar(monkeypatch):
    """Seen in `swarm experiment attacks`: B, evicted and banned, still announced and first in plan 3's order,
    handed the standby its state a step behind C's (B's eviction ran that step again without it); every audit
    after disputed J and C until the run stopped. A liar could hand over poisoned weights the same way."""
    from swarm.peers.records import TrainerAnnouncement

    trainer = "0t0000000000"
    before = record(3, [A], [B, C], unused=[J], trainers=[trainer])
    repaired = record(4, [A], [J, C], trainers=[trainer])
    peers = [ann(A, 4, 0), ann(B, 4), ann(C, 4, 1), ann(J, 3)]
    daemon, events = joiner(monkeypatch, peers, before, trainers=[TrainerAnnouncement(trainer, banned=[B])])
    daemon._apply_plan(repaired)
    assert [e for e in events if e[0] == "fetch"] == [("fetch", ADDRESS[C], 1, 3)]
    assert daemon.servicer.host.role.replica == 0


def test_a_joiner_whose_first_plan_names_it_copies_from_the_other_replicas(monkeypatch):
    """Regression: with no plan followed before (its start-up read failed), the joiner served initial weights."""
    grown = record(4, [A], [B, C, J])
    peers = [ann(A, 4, 0), ann(B, 4, 1), ann(C, 4, 1), ann(J, 0)]
    daemon, events = joiner(monkeypatch, peers, following=None)
    daemon._apply_plan(grown)
    fetches = [e for e in events if e[0] == "fetch"]
    assert fetches == [("fetch", ADDRESS[B], 1, 4)], "the new plan's first other replica, under that plan"
    assert [e[0] for e in events] == ["fetch", "take_over", "swap", "announce"]
    assert daemon.servicer.host.role.replica == 2


def test_a_fresh_swarms_first_plan_takes_nothing_over(monkeypatch):
    first = record(1, [A], [B, J])
    daemon, events = joiner(monkeypatch, [ann(A, 0), ann(B, 0), ann(J, 0)], following=None)
    daemon._apply_plan(first)
    assert [e[0] for e in events] == ["swap", "announce"], "nobody serves stage 1 yet: nothing to copy"


def test_served_by_replicas_needs_another_peer_serving_the_same_layers():
    plan = record(4, [A], [B, J])
    assert served_by_replicas(plan, 1, [ann(B, 3, 1)], J), "under any plan"
    assert not served_by_replicas(plan, 1, [ann(B, 3, 0)], J), "B serves other layers"
    assert not served_by_replicas(plan, 1, [ann(J, 3, 1), ann(A, 4, 0)], J), "only this peer, or another stage"


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (([A], [B, C, J]), {A: (1, B), B: (0, A), C: (0, A), J: (0, A)}),
        (([A, B, C], [J]), {A: (1, J), B: (1, J), C: (1, J), J: (0, A)}),
    ],
)
def test_buddies_of_an_uneven_plan_hold_another_stage(rows, expected):
    plan = record(1, *rows).document
    assert {p: buddy_of(plan, p) for p in expected} == expected


def test_announcement_changes_from_two_threads_keep_each_others_fields():
    """The plan loop changes the role while the relay's thread changes the reach: neither writes back the other's
    field as it read it, and the last record announced carries both (a stale relay sends callers astray)."""
    import threading
    from types import SimpleNamespace

    from swarm.daemon.peer import PeerDaemon
    from swarm.peers.records import PeerAnnouncement

    announced: list[PeerAnnouncement] = []
    entered, release = threading.Event(), threading.Event()

    def announce(record):
        if record.stage == 1 and not entered.is_set():  # the role's announcement stalls in the DHT
            entered.set()
            release.wait(10)
        announced.append(record)
        return True

    daemon = PeerDaemon.__new__(PeerDaemon)
    daemon._announce_lock = threading.Lock()
    daemon.dht = SimpleNamespace(announce=announce)
    daemon.announcement = PeerAnnouncement("a" * 24, "127.0.0.1:5000", "cpu", 1, 1.0)
    role = threading.Thread(target=lambda: daemon.update_announcement(stage=1, layer_start=0, layer_end=2))
    role.start()
    assert entered.wait(10)
    relay = threading.Thread(target=lambda: daemon.update_announcement(reach="relay", relay="b" * 24))
    relay.start()
    release.set()
    role.join(10)
    relay.join(10)
    assert (daemon.announcement.stage, daemon.announcement.relay) == (1, "b" * 24)
    assert (announced[-1].stage, announced[-1].relay) == (1, "b" * 24)
