"""Routes through uneven replica counts: counts, one-to-one, even load, per-stage numbering."""

from __future__ import annotations

import pytest

from swarm.peers.routes import MAX_ROUTES, fits, local_micro, n_routes, route_replicas, stage_numbering, uneven
from swarm.proto import stage_pb2


def test_equal_counts_are_the_straight_chains():
    assert n_routes([2, 2, 2]) == 2
    assert [route_replicas(c, [2, 2, 2]) for c in range(2)] == [(0, 0, 0), (1, 1, 1)]
    assert not uneven([2, 2, 2])


@pytest.mark.parametrize("counts", [[2, 3], [2, 3, 2], [1, 2, 1], [3, 4], [1, 1, 6]])
def test_routes_are_distinct_and_load_every_replica_evenly(counts):
    c = n_routes(counts)
    routes = [route_replicas(r, counts) for r in range(c)]
    assert len(set(routes)) == c
    for s, r_s in enumerate(counts):
        load = [sum(1 for route in routes if route[s] == r) for r in range(r_s)]
        assert load == [c // r_s] * r_s


def test_too_many_routes_and_empty_stages_are_refused():
    with pytest.raises(ValueError, match="more than"):
        n_routes([5, 7])
    assert MAX_ROUTES < 35
    with pytest.raises(ValueError, match="at least one"):
        n_routes([2, 0])
    with pytest.raises(IndexError):
        route_replicas(2, [2, 2])


def test_numbering_counts_each_replicas_micro_batches_in_route_order():
    counts = [2, 3]
    numbering = stage_numbering({r: 1 for r in range(6)} | {0: 2}, counts)
    for s, r_s in enumerate(counts):
        for replica in range(r_s):
            mine = [key for key in numbering if key[0] % r_s == replica]
            assert [numbering[k][0][s] for k in mine] == list(range(len(mine)))
            assert {numbering[k][1][s] for k in mine} == {len(mine)}


def test_with_equal_counts_the_numbering_is_the_routes_own():
    numbering = stage_numbering({0: 3, 1: 2}, [2, 2])
    for (route, k), (index, count) in numbering.items():
        assert index == (k, k)
        assert count == ((3, 3) if route == 0 else (2, 2))


def test_local_micro_reads_the_per_stage_fields_when_present():
    plain = stage_pb2.CallInfo(micro_batch=2, num_micro_batches=5)
    assert local_micro(plain, 1) == (2, 5)
    uneven_info = stage_pb2.CallInfo(micro_batch=2, num_micro_batches=5, stage_micro=[2, 0], stage_micro_count=[5, 1])
    assert local_micro(uneven_info, 1) == (0, 1)


@pytest.mark.parametrize("counts", [[2, 3], [5, 7], [2, 0], [], [1, 12], [3, 4, 6]])
def test_fits_says_yes_exactly_where_n_routes_answers(counts):
    try:
        n_routes(counts)
        legal = True
    except ValueError:
        legal = False
    assert fits(counts) == legal
