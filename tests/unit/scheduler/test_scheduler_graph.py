"""Bottleneck assignment and open-path TSP against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from swarm.scheduler.graph import EXACT_TSP_MAX_NODES, bottleneck_assignment, open_path_tsp, path_length


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_bottleneck_matches_brute_force(n):
    rng = np.random.default_rng(n)
    for _ in range(30):
        w = rng.integers(0, 12, (n, n)).astype(float)  # ties on purpose
        value, perm = bottleneck_assignment(w)
        best = min(max(w[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert value == best
        assert sorted(perm) == list(range(n))
        assert w[np.arange(n), perm].max() == value


@pytest.mark.parametrize("n", [20, 40, 300])
def test_bottleneck_large_is_a_valid_pairing(n):
    w = np.random.default_rng(n).random((n, n))
    value, perm = bottleneck_assignment(w)
    assert sorted(perm) == list(range(n))
    assert w[np.arange(n), perm].max() == value
    # No pairing can avoid the largest row minimum or column minimum.
    assert value >= max(w.min(axis=1).max(), w.min(axis=0).max())


@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_open_path_tsp_is_exact_when_small(n):
    rng = np.random.default_rng(10 + n)
    for symmetric in (True, False):
        d = rng.random((n, n))
        if symmetric:
            d = d + d.T
        length, order = open_path_tsp(d)
        best = min(path_length(d, p) for p in itertools.permutations(range(n)))
        assert length == pytest.approx(best)
        assert sorted(order) == list(range(n))
        assert path_length(d, order) == pytest.approx(length)


def test_open_path_tsp_heuristic_beats_its_start():
    n = EXACT_TSP_MAX_NODES + 8
    rng = np.random.default_rng(3)
    points = rng.random((n, 2))
    d = np.linalg.norm(points[:, None] - points[None, :], axis=2)
    start = list(rng.permutation(n))
    length, order = open_path_tsp(d, start=start)
    assert sorted(order) == list(range(n))
    assert length <= path_length(d, start)
    assert length == pytest.approx(path_length(d, order))
