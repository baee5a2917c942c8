"""Uneven replicas (issue 12): a joiner becomes one more replica of the busiest stage, a loss without a standby
drops a replica or re-assigns one, and the trainer's route takes rows of different lengths."""

from __future__ import annotations

import pytest

from swarm.daemon.repair import busiest_stage, grow_plan, repair_plan
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement, PlanRecord
from swarm.peers.routes import PlanRoutes, Route, n_routes

A, B, C, D, E, F, G, H = (f"0{c}0000000000" for c in "abcdefgh")


def plan_wire(*rows: list[str], layers: list[int] | None = None, unused: list[str] = ()) -> dict:
    """A plan's wire dict of len(rows) stages; stage s holds `layers[s]` layers (1 each by default)."""
    layers = layers or [1] * len(rows)
    bounds = [sum(layers[:s]) for s in range(len(rows) + 1)]
    stages = [{"layer_start": bounds[s], "layer_end": bounds[s + 1], "peer_ids": list(r)} for s, r in enumerate(rows)]
    return {"stages": stages, "unused_peer_ids": list(unused), "trainer_ids": ["t"], "step_time_s": 1.0}


def plan_of(*rows: list[str], layers: list[int] | None = None, unused: list[str] = ()) -> PlanDocument:
    return PlanDocument.from_wire(plan_wire(*rows, layers=layers, unused=unused))


def rows(plan: PlanDocument) -> list[list[str]]:
    return [list(s.peer_ids) for s in plan.stages]


def test_the_joiner_goes_to_the_stage_with_the_most_time_per_sample_by_speeds():
    plan = plan_of([A], [B])
    assert rows(grow_plan(plan, {A: 4.0, B: 1.0, C: 9.0})) == [[A], [B, C]], "B is slower: stage 1 is busiest"
    assert rows(grow_plan(plan, {A: 1.0, B: 4.0, C: 9.0})) == [[A, C], [B]]
    assert rows(plan) == [[A], [B]], "the input is not changed"


def test_the_busiest_stage_weighs_layers_against_the_sum_of_replica_speeds():
    plan = plan_of([A, B], [C], layers=[3, 2])  # stage 0: 3 / (1 + 1) = 1.5; stage 1: 2 / 1 = 2
    speeds = {A: 1.0, B: 1.0, C: 1.0}
    assert busiest_stage(plan, speeds) == 1
    assert busiest_stage(plan_of([A, B], [C], layers=[5, 2]), speeds) == 0, "5 / 2 > 2 / 1"
    assert busiest_stage(plan_of([A], [B], [C]), speeds) == 0, "ties go to the lowest stage"


def test_unknown_speeds_count_at_the_median():
    plan = plan_of([A], [B], [C])
    # B unannounced: the median of 1, 4, 10 is 4, so stage 0 (A at 1/s) is the busiest
    assert busiest_stage(plan, {A: 1.0, C: 4.0, D: 10.0}) == 0
    assert busiest_stage(plan, {A: 5.0, C: 4.0, D: 1.0}) == 1, "median 4 for B: stage 1 ties stage 2, lowest wins"


def test_joiners_are_placed_in_id_order_each_seeing_the_previous_growth():
    plan = plan_of([A], [B])
    grown = grow_plan(plan, {A: 1.0, B: 1.0, E: 1.0, D: 1.0, C: 1.0})
    assert rows(grown) == [[A, C, E], [B, D]], "C to stage 0 (tie), D to stage 1, E to stage 0"
    assert list(grown.unused_peer_ids) == [] and list(grown.trainer_ids) == ["t"]
    again = grow_plan(plan, {C: 1.0, E: 1.0, D: 1.0, A: 1.0, B: 1.0})
    assert rows(again) == rows(grown), "deterministic: the order of the speeds does not matter"


def test_the_plans_standbys_stay_standbys():
    grown = grow_plan(plan_of([A], [B], unused=[C]), {A: 1.0, B: 1.0, C: 9.0, D: 1.0})
    assert rows(grown) == [[A, D], [B]] and list(grown.unused_peer_ids) == [C]


def test_no_stage_grows_past_max_routes_and_a_joiner_that_fits_nowhere_stays_on_standby():
    plan = plan_of([A, B, C], [D, E])  # 6 routes
    speeds = dict.fromkeys([A, B, C, D, E, F, G], 1.0)
    speeds[A] = speeds[B] = speeds[C] = 0.1  # stage 0 is by far the busiest
    grown = grow_plan(plan, speeds, max_routes=6)
    assert rows(grown) == [[A, B, C, F], [D, E]], "(4, 2) needs 4 routes"
    assert list(grown.unused_peer_ids) == [G], "(5, 2) needs 10 routes, (4, 3) 12: G fits nowhere"
    assert n_routes([len(r) for r in rows(grown)]) <= 6


def test_growth_within_the_default_bound():
    grown = grow_plan(plan_of([A], [B]), dict.fromkeys([A, B, C, D, E, F, G, H], 1.0))
    assert [len(r) for r in rows(grown)] == [4, 4], "C..H alternate between the stages"
    busy = plan_of([A, B, C, D], [E, F, G], layers=[9, 1])  # (4, 3): 12 routes; stage 0 is far busier
    assert rows(grow_plan(busy, dict.fromkeys([A, H], 1.0)))[1] == [E, F, G, H], "(5, 3) needs 15: stage 1"


def test_without_a_standby_a_lost_replica_is_dropped_and_the_stage_serves_with_fewer():
    fixed = repair_plan(plan_of([A, B, C], [D, E]), alive={A, C, D, E})
    assert rows(fixed) == [[A, C], [D, E]] and list(fixed.unused_peer_ids) == []
    assert rows(repair_plan(plan_of([A, B], [C, D]), alive={A, B, C})) == [[A, B], [C]]


def test_a_standby_still_takes_the_lost_place_first():
    assert rows(repair_plan(plan_of([A, B], [C]), alive={A, C, D}, gone=set())) == [[A, D], [C]], "joiner D"
    fixed = repair_plan(plan_of([A, B], [C], unused=[E]), alive={A, C, E})
    assert rows(fixed) == [[A, E], [C]] and list(fixed.unused_peer_ids) == []


def test_a_stage_that_lost_every_replica_takes_the_standby_before_a_stage_that_keeps_one():
    fixed = repair_plan(plan_of([A, B], [C], unused=[E]), alive={B, E})
    assert rows(fixed) == [[B], [E]], "A is dropped (B stays), C's place takes the one standby"


def test_a_stage_that_lost_every_replica_takes_the_last_replica_of_the_stage_with_the_most():
    fixed = repair_plan(plan_of([A, B], [C], [D, E, F]), alive={A, B, D, E, F})
    assert rows(fixed) == [[A, B], [F], [D, E]], "stage 2 has the most: its last replica moves"
    tie = repair_plan(plan_of([A, B], [C], [D, E]), alive={A, B, D, E})
    assert rows(tie) == [[A], [B], [D, E]], "a tie goes to the lowest stage"


def test_no_repair_when_no_stage_can_spare_a_replica_or_the_routes_would_be_too_many():
    assert repair_plan(plan_of([A], [B], [C]), alive={A, B}) is None
    assert repair_plan(plan_of([A, B], [C, D]), alive={A}) is None, "stage 1 empty, stage 0 has one left"
    six = [f"0{i}a000000000" for i in range(6)], [f"0{i}b000000000" for i in range(6)]
    assert n_routes([6, 6]) == 6
    alive = set(six[0]) | set(six[1][1:])
    assert repair_plan(plan_of(*six), alive=alive) is None, "(6, 5) would need 30 routes: search again"


def ann(pid: str, version: int, stage: int) -> PeerAnnouncement:
    port = 5000 + "abcdefgh".index(pid[1]) + 10 * int(pid[2], 16)
    layers = {"stage": stage, "layer_start": stage, "layer_end": stage + 1}
    return PeerAnnouncement(pid, f"127.0.0.1:{port}", "cpu", 1 << 30, 1.0, plan_version=version, **layers)


def test_the_plans_route_takes_uneven_replica_rows():
    record = PlanRecord(version=7, document=plan_of([A], [B, C, D]), created_at=1.0)
    peers = [ann(A, 7, 0), ann(B, 7, 1), ann(C, 7, 1), ann(D, 6, 1)]
    assert record.document.route_of(peers, record.version) is None, "D still switching"
    peers[-1] = ann(D, 7, 1)
    route = record.document.route_of(peers, record.version)
    assert route.replica_counts == (1, 3) and route.n_replicas == 3
    assert route.replica_peer_ids == ((A,), (B, C, D))
    assert route.addresses == ["127.0.0.1:5000", "127.0.0.1:5001"], "route 0: replica 0 of every stage"
    addresses, ids = route.driver_args()
    assert ids == ([A], [B, C, D])
    assert addresses == (["127.0.0.1:5000"], ["127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"])
    assert route.nested() == (route.replica_addresses, route.replica_peer_ids)
    routes = route.routes()  # lcm(1, 3) = 3 routes, route c on replica c % 3 of stage 1: the driver's routes
    assert [r.index for r in routes] == [0, 1, 2] and [r.peers for r in routes] == [(A, B), (A, C), (A, D)]
    assert routes[2].addresses == ("127.0.0.1:5000", "127.0.0.1:5003")
    assert len({r.key for r in routes}) == 3 and routes[0].key == Route(9, ("elsewhere",) * 2, (A, B)).key


def test_route_replica_counts_flat_and_even():
    flat = PlanRoutes(["x", "y"], [A, B], 1)
    assert flat.replica_counts == (1, 1) and flat.n_replicas == 1
    assert flat.driver_args() == (["x", "y"], [A, B])
    assert flat.routes() == (Route(0, ("x", "y"), (A, B)),)
    even = PlanRoutes(["x", "y"], [A, B], 1, (("x", "z"), ("y", "w")), ((A, C), (B, D)))
    assert even.replica_counts == (2, 2) and even.n_replicas == 2


@pytest.mark.parametrize("counts", [(1, 2), (2, 3), (1, 2, 1)])
def test_a_published_uneven_plan_validates(counts):
    from swarm.peers.records import validate_plan

    names = iter([A, B, C, D, E, F, G, H])
    plan = plan_of(*[[next(names) for _ in range(n)] for n in counts])
    peers = [ann(p, 1, s) for s, row in enumerate(rows(plan)) for p in row]
    validate_plan(PlanRecord(version=1, document=plan, created_at=1.0), len(counts), peers)


def test_a_plan_needing_more_than_max_routes_is_refused():
    from swarm.peers.records import validate_plan

    names = [f"0{i}{j}000000000" for i in "abcdefgh" for j in "ab"]
    plan = plan_wire(names[:4], names[4:7], names[7:12])  # lcm(4, 3, 5) = 60
    peers = [ann(p, 1, s) for s, stage in enumerate(plan["stages"]) for p in stage["peer_ids"]]
    with pytest.raises(ValueError, match="routes"):
        validate_plan(PlanRecord(version=1, document=plan, created_at=1.0), 3, peers)
