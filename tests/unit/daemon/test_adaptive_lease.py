"""The planner's lease stretches while its renewals come late, so a loaded planner keeps it instead of lapsing and
flapping with another delegated planner ("ignoring plan N: not the plan authority"); it shrinks back after."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.daemon.lease import LEASE_CEILING_S, AdaptiveLease
from swarm.daemon.planning import elected_planner
from tests.unit.daemon.test_election import NOW, A, B, DHTClock, _leased_planner, peer_at, two_stages


def test_prompt_renewals_keep_the_configured_lease_and_late_ones_stretch_it_within_the_ceiling():
    lease = AdaptiveLease(3.0)
    for t in range(10):
        assert lease.claim(float(t)) == 3.0  # every second: a third of the lease
    assert lease.claim(15.0) == 18.0  # 6 s late: three times the gap
    lease.stored(7.0)  # its store took 7 s
    assert lease.claim(16.0) == 21.0
    lease.stored(0.0)
    assert lease.claim(100.0) == LEASE_CEILING_S
    for t in range(101, 140):
        lease.claim(float(t))
    assert lease.length_s == 3.0, "back to the configured lease once renewals are prompt"
    lease.forget()
    assert lease.claim(500.0) == 3.0, "a new term: the gap since the last term is no lateness"


def test_a_planner_whose_renewals_stall_keeps_its_lease_where_a_fixed_lease_lapsed(monkeypatch):
    clock = DHTClock()
    monkeypatch.setattr("swarm.peers.dht.get_dht_time", clock)
    records = {"peers": [peer_at(A, 4, 0), peer_at(B, 4, 1)], "plan": [(A, two_stages(4, A, B, trainer_ids=[]))]}
    planner, dht, published, beats = _leased_planner(A, records, clock)
    planner.round()
    assert beats == [NOW + 3.0]
    clock.t += 2.5  # the renewal thread stalled 2.5 s (a loaded machine): late, but still in time
    assert planner.renew_lease() and beats[-1] == pytest.approx(NOW + 2.5 + 3 * 2.5), "stretched at once: 7.5 s"
    clock.t += 4.0  # stalled again, 4 s
    fixed = dataclasses.replace(records["peers"][0], planner_until=NOW + 2.5 + 3.0)
    assert elected_planner([fixed, records["peers"][1]], now=clock.t) == B, "a fixed 3 s lease lapsed: B took over"
    held = dataclasses.replace(records["peers"][0], planner_until=beats[-1])
    assert elected_planner([held, records["peers"][1]], now=clock.t) == A, "the stretched lease holds"
    assert planner.renew_lease() and beats[-1] - clock.t == pytest.approx(3 * 4.0)
    for _ in range(40):  # prompt renewals again: the lease shrinks back to the configured 3 s
        clock.t += 1.0
        assert planner.renew_lease()
    assert beats[-1] - clock.t == pytest.approx(3.0)
