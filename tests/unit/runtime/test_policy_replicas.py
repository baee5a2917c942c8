"""The plan's roster with replicas: chains are the columns, a stage talks only to its own chain's neighbours,
sums gradients only with its own stage's replicas, and takes Reduce only from a trainer."""

from __future__ import annotations

import grpc
import pytest

from swarm.net.stream import CallRefused
from swarm.proto import stage_pb2
from swarm.runtime.policy import CallPolicy, Roster

PEERS = (("p0", "q0"), ("p1", "q1"), ("p2", "q2"))
ADDRS = (("a0", "b0"), ("a1", "b1"), ("a2", "b2"))
ROSTER = Roster(PEERS, ADDRS, frozenset({"t"}), frozenset({"spare"}))


def denied(fn, *args, match: str) -> None:
    with pytest.raises(CallRefused, match=match) as e:
        fn(*args)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED


def call(chain: int, stage: int, route=None, peers=None) -> stage_pb2.CallInfo:
    addresses, ids = ROSTER.route(chain)
    return stage_pb2.CallInfo(stage=stage, chain=chain, route=list(route or addresses), route_peers=list(peers or ids))


def test_roster_stores_replicas_nested_and_reads_chains_as_columns():
    assert ROSTER.n_stages == 3 and ROSTER.n_replicas == 2
    assert ROSTER.replicas(1) == ("p1", "q1") and ROSTER.replica_addresses(2) == ("a2", "b2")
    assert ROSTER.route(1) == (("b0", "b1", "b2"), ("q0", "q1", "q2"))
    assert ROSTER.plan_peers == {"spare", *(p for r in PEERS for p in r)}
    flat = Roster(("p0", "p1"), ("a0", "a1"), None, frozenset())
    assert (
        flat.stage_peers == (("p0",), ("p1",))
        and flat.n_replicas == 1
        and flat.route(0) == (("a0", "a1"), ("p0", "p1"))
    )
    with pytest.raises(IndexError):
        ROSTER.route(2)


def test_roster_refuses_too_many_routes_or_mismatched_replicas():
    # uneven counts are routes now (below); counts whose lcm exceeds MAX_ROUTES are not
    many = (("p0", "q0", "r0", "s0"), ("p1", "q1", "r1", "s1", "t1"))
    with pytest.raises(ValueError, match="routes, more than"):
        Roster(many, many, None, frozenset())
    with pytest.raises(ValueError, match="same replicas"):
        Roster((("p0", "q0"), ("p1", "q1")), (("a0", "b0"), ("a1",)), None, frozenset())
    with pytest.raises(ValueError):
        Roster((), (), None, frozenset())


def test_route_must_be_exactly_the_chain_the_call_names():
    policy = CallPolicy(ROSTER)
    policy.check_route(call(0, 1))
    policy.check_route(call(1, 1))
    denied(policy.check_route, call(0, 1, route=ROSTER.route(1)[0]), match="route 0")  # route 1's addresses, route 0
    mixed = stage_pb2.CallInfo(stage=1, chain=0, route=["a0", "b1", "a2"], route_peers=["p0", "q1", "p2"])
    denied(policy.check_route, mixed, match="route")
    beyond = stage_pb2.CallInfo(stage=1, chain=2, route=["a0"] * 3, route_peers=["p0"] * 3)
    denied(policy.check_route, beyond, match="2 routes")
    policy.check_route(call(1, 1), "q0", "Forward", own="q1")
    denied(policy.check_route, call(0, 1), "p0", "Forward", "q1", match="route 0's peer of stage 1 is p1, not this")


def test_forward_and_backward_only_from_the_same_chain():
    policy = CallPolicy(ROSTER)
    policy.check_sender("Forward", 1, "q0")  # any replica of the sending stage passes the pre-body check ...
    policy.check_route(call(1, 1), "q0", "Forward")
    policy.check_route(call(1, 1), "q2", "Backward")
    policy.check_route(call(0, 0), "t", "Forward")  # the trainer's end of the chain
    policy.check_route(call(1, 2), "t", "Backward")
    # ... the call info then holds it to its own route: q0 (route 1) may not feed route 0's stage 1
    denied(policy.check_route, call(0, 1), "q0", "Forward", match="route 0 into stage 1 only from its peer of stage 0")
    denied(policy.check_route, call(1, 0), "p1", "Backward", match="only from its peer of stage 1")
    denied(policy.check_sender, "Forward", 1, "q1", match="peer of stage 0")  # a same-stage replica is no sender
    denied(policy.check_sender, "Forward", 2, "stranger", match="peer of stage 1")


def test_average_only_from_another_replica_of_the_stage_and_reduce_only_from_a_trainer():
    policy = CallPolicy(ROSTER)
    policy.check_average(1, "q1", own="p1")
    denied(policy.check_average, 1, "p1", "p1", match="another replica")  # itself
    denied(policy.check_average, 1, "q0", "p1", match="another replica")  # a replica of another stage
    denied(policy.check_average, 1, "t", "p1", match="another replica")
    denied(policy.check_average, 5, "q1", "p1", match="another replica")
    policy.check_step("Reduce", "t")
    denied(policy.check_step, "Reduce", "q1", match="Reduce only from a trainer")
    denied(CallPolicy(None).check_average, 1, "q1", "p1", match="no plan roster")


def test_reduce_group_is_replicas_of_the_stage_at_their_plan_addresses():
    policy = CallPolicy(ROSTER)

    def group(peers, addresses, stage=1):
        return stage_pb2.ReduceRequest(stage=stage, group_peers=peers, group_addresses=addresses)

    policy.check_group(group(["p1", "q1"], ["a1", "b1"]), own="p1")
    policy.check_group(group(["q1"], ["b1"]), own="q1")
    denied(policy.check_group, group(["p1", "q1"], ["a1", "evil:1"]), "p1", match="plan addresses")
    denied(policy.check_group, group(["p1", "p1"], ["a1", "a1"]), "p1", match="distinct")
    denied(policy.check_group, group(["q1"], ["b1"]), "p1", match="this peer among them")
    denied(policy.check_group, group(["p1", "q0"], ["a1", "b0"]), "p1", match="replicas of stage 1")
    denied(policy.check_group, group(["p1"], ["a1", "b1"]), "p1", match="group")
    denied(policy.check_group, group(["p1"], ["a1"], stage=7), "p1", match="not in the plan")


# ---- uneven replica counts: routes -----------------------------------------------------------------------

UNEVEN = Roster((("p0",), ("p1", "q1"), ("p2", "q2", "r2")), (("a0",), ("a1", "b1"), ("a2", "b2", "c2")), None, ())


def uneven_call(route: int, stage: int) -> stage_pb2.CallInfo:
    addresses, ids = UNEVEN.route(route)
    return stage_pb2.CallInfo(stage=stage, chain=route, route=list(addresses), route_peers=list(ids))


def test_uneven_roster_reads_route_c_on_replica_c_mod_r():
    assert UNEVEN.counts == (1, 2, 3) and UNEVEN.n_routes == 6 and UNEVEN.n_replicas == 6
    assert UNEVEN.route(0) == (("a0", "a1", "a2"), ("p0", "p1", "p2"))
    assert UNEVEN.route(5) == (("a0", "b1", "c2"), ("p0", "q1", "r2"))
    assert len({UNEVEN.route(c) for c in range(6)}) == 6  # no two routes are the same peers
    with pytest.raises(IndexError):
        UNEVEN.route(6)


def test_uneven_forward_only_from_the_routes_replica_of_the_sending_stage():
    policy = CallPolicy(UNEVEN)
    policy.check_route(uneven_call(3, 2), "q1", "Forward", own="p2")  # route 3: replica 1 of stage 1 -> 0 of 2
    policy.check_route(uneven_call(3, 1), "p0", "Forward", own="q1")  # the shared stage-0 replica feeds both
    policy.check_route(uneven_call(4, 1), "q2", "Backward", own="p1")  # route 4: stage 2 replica 1 -> stage 1 r0
    # p1 is a replica of stage 1 (it passes the pre-body check) but not route 3's
    policy.check_sender("Forward", 2, "p1")
    denied(policy.check_route, uneven_call(3, 2), "p1", "Forward", match="route 3 into stage 2 only from its peer")
    denied(policy.check_route, uneven_call(3, 2), "q1", "Forward", "q2", match="route 3's peer of stage 2 is p2")
    denied(policy.check_route, uneven_call(4, 1), "r2", "Backward", match="only from its peer of stage 2")
    beyond = stage_pb2.CallInfo(stage=1, chain=6, route=["a0", "a1", "a2"], route_peers=["p0", "p1", "p2"])
    denied(policy.check_route, beyond, match="6 routes")
    mislabelled = uneven_call(3, 1)
    mislabelled.chain = 1  # route 3's peers under route 1's number
    denied(policy.check_route, mislabelled, match="route")
