"""A replica that sat out a step (its route was dropped: a neighbour died or was evicted) copies its replicas'
state when the next plan keeps its role; it must compare steps only once their open step is applied, or an
eviction's immediate re-plan lets it look level one step too early and the replicas diverge."""

from __future__ import annotations

import threading
import types

import pytest

from swarm.daemon import handover as handover_module
from swarm.daemon.handover import StateHandover


def _daemon(others: dict[str, str]) -> StateHandover:
    """A peer's handover with what `behind` reads: its id and the DHT's announcements (Status is `_status`)."""
    announced = [types.SimpleNamespace(peer_id=p, address=a) for p, a in others.items()]
    dht = types.SimpleNamespace(peer_id="me", peers=lambda: announced)
    return StateHandover(dht, None, None, threading.Event())


def _record(peer_ids):
    stage = types.SimpleNamespace(peer_ids=tuple(peer_ids))
    return types.SimpleNamespace(document=types.SimpleNamespace(stages=[stage]))


ROLE = types.SimpleNamespace(stage=0)


def _status(script):
    """peer_status answering from `script`: address -> list of (steps_done, step_open), one per poll (the last
    one repeats)."""
    polls = {a: 0 for a in script}

    def status(channels, address, timeout_s=2.0):
        if address not in script:
            return None
        replies = script[address]
        steps, is_open = replies[min(polls[address], len(replies) - 1)]
        polls[address] += 1
        return types.SimpleNamespace(steps_done=steps, step_open=is_open)

    return status, polls


def test_a_replica_finishing_the_step_this_one_sat_out_is_waited_for(monkeypatch):
    # the other replica is level (2 steps) while its third is open; once applied it is one ahead
    status, polls = _status({"b:1": [(2, True), (2, True), (3, False)]})
    monkeypatch.setattr(handover_module, "peer_status", status)
    behind = _daemon({"b": "b:1"}).behind(_record(["me", "b"]), ROLE, 2, settle_s=10.0)
    assert behind and polls["b:1"] == 3


def test_level_replicas_without_an_open_step_are_not_copied_and_a_silent_one_gives_nothing(monkeypatch):
    status, polls = _status({"b:1": [(2, False)]})
    monkeypatch.setattr(handover_module, "peer_status", status)
    daemon = _daemon({"b": "b:1", "c": "c:1"})  # c does not answer
    assert not daemon.behind(_record(["me", "b", "c"]), ROLE, 2, settle_s=10.0)
    assert polls["b:1"] == 1


@pytest.mark.timeout(30)
def test_the_wait_is_bounded_when_a_replicas_step_never_closes(monkeypatch):
    status, polls = _status({"b:1": [(4, True)]})
    monkeypatch.setattr(handover_module, "peer_status", status)
    assert _daemon({"b": "b:1"}).behind(_record(["me", "b"]), ROLE, 3, settle_s=0.3)
    assert polls["b:1"] >= 2
