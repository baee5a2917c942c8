"""A taker copies a stage's state only from its most advanced replicas (`most_advanced`): a replica with fewer
steps than another sat out steps or copied stale state, and copying it would leave the stage's replicas apart."""

from __future__ import annotations

from swarm.daemon.replication import most_advanced


def test_a_replica_behind_another_is_never_a_source():
    # the churn run's case: p1 (one step behind) copying plan 4's stage 0 from p5 (17 steps, stale) and p4 (21)
    assert most_advanced(["p5", "p4"], {"p5": 17, "p4": 21}, me="p1") == ["p4"]
    assert most_advanced(["a", "b", "c"], {"a": 9, "b": 9, "c": 8}, me="x") == ["a", "b"], "equals keep their order"


def test_this_peers_own_host_and_unknown_counts_stay():
    assert most_advanced(["me", "a", "b"], {"a": 5, "b": 4}, me="me") == ["me", "a"], "own host offered: not behind"
    assert most_advanced(["a", "b"], {"a": None, "b": 3}, me="x") == ["a", "b"], "an unknown count is not stale"
    assert most_advanced(["a"], {}, me="x") == ["a"] and most_advanced([], {}, me="x") == []
