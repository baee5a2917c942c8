"""Issue 28 papercut: the trainer printed "2 stages x 2 replicas at A, B" for 3 peers, listing two addresses.
`PlanRoutes.describe` names every stage's replicas, uneven counts included."""

from __future__ import annotations

from swarm.peers.routes import PlanRoutes


def test_uneven_replicas_are_each_named_with_the_peer_count():
    routes = PlanRoutes(
        ["A", "B"], ["a", "b"], 3, replica_addresses=(("A", "C"), ("B",)), replica_peer_ids=(("a", "c"), ("b",))
    )
    assert routes.describe() == "2 stages over 3 peers: stage 0 at A, C; stage 1 at B"


def test_one_replica_per_stage():
    assert PlanRoutes(["A", "B"], ["a", "b"], 1).describe() == "2 stages over 2 peers: stage 0 at A; stage 1 at B"
