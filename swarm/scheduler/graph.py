"""Combinatorial kernels of the scheduler: bottleneck assignment and the open-path travelling salesman.

Both appear inside the cost of a plan, not only in its search: a stage boundary runs at the pace of its
slowest replica-to-replica link, so the best pairing of two stages' replicas is the one whose worst link is
cheapest (a bottleneck assignment); and the pipeline visits every stage once without returning, so the best
order of stages is a shortest Hamiltonian path (an open-path TSP). DT-FM's cost model is defined with both.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["EXACT_TSP_MAX_NODES", "bottleneck_assignment", "open_path_tsp", "path_length"]

# Held-Karp costs O(2^n n^2): 12 nodes is ~0.6M steps, milliseconds in numpy; beyond, a local search.
EXACT_TSP_MAX_NODES = 12
_SMALL_MATCHING = 16  # up to this size, matchings run in Python / one assignment instead of sparse graphs
_DENSE_MATCHING = 256  # up to this size, dense assignments (scipy's C code) beat building sparse graphs
_MAX_LOG_FLOAT = 700.0  # float64 overflows past e^709


def _perfect_matching_small(allowed: np.ndarray) -> np.ndarray | None:
    """Kuhn's augmenting paths over bit masks; returns row -> column, or None when no perfect matching."""
    n = allowed.shape[0]
    masks = [int(sum(1 << j for j in np.flatnonzero(row))) for row in allowed]
    match_col = [-1] * n  # column -> row

    def augment(row: int, seen: int) -> tuple[bool, int]:
        free = masks[row] & ~seen
        while free:
            low = free & -free
            col = low.bit_length() - 1
            seen |= low
            free &= ~low
            if match_col[col] < 0:
                match_col[col] = row
                return True, seen
            ok, seen = augment(match_col[col], seen)
            if ok:
                match_col[col] = row
                return True, seen
        return False, seen

    for row in range(n):
        if not masks[row] or not augment(row, 0)[0]:
            return None
    perm = np.empty(n, dtype=np.int64)
    for col, row in enumerate(match_col):
        perm[row] = col
    return perm


def _perfect_matching(allowed: np.ndarray) -> np.ndarray | None:
    n = allowed.shape[0]
    if n <= _SMALL_MATCHING:
        return _perfect_matching_small(allowed)
    if n <= _DENSE_MATCHING:
        # A min-cost assignment on 0 (allowed) / 1 (forbidden) costs 0 exactly when a perfect matching exists.
        from scipy.optimize import linear_sum_assignment  # here: a peer that never plans replicas never loads scipy

        rows, cols = linear_sum_assignment(~allowed)
        if allowed[rows, cols].all():
            perm = np.empty(n, dtype=np.int64)
            perm[rows] = cols
            return perm
        return None
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_bipartite_matching

    perm = maximum_bipartite_matching(csr_matrix(allowed), perm_type="column")
    return None if (perm < 0).any() else perm.astype(np.int64)


def _bottleneck_by_ranks(weights: np.ndarray) -> tuple[float, np.ndarray] | None:
    """One min-sum assignment on (n + 1) ** rank: any pairing whose worst rank is r costs at least
    (n + 1) ** r, more than n pairs of rank < r together, so the min-sum pairing minimises the worst rank
    (hence the worst weight). Returns None when the powers would overflow a float."""
    n = weights.shape[0]
    values, ranks = np.unique(weights, return_inverse=True)
    if len(values) * math.log(n + 1) > _MAX_LOG_FLOAT:
        return None
    from scipy.optimize import linear_sum_assignment  # ~40 MB of RSS, loaded when a plan first pairs replicas

    rows, cols = linear_sum_assignment(float(n + 1) ** ranks.reshape(weights.shape))
    perm = np.empty(n, dtype=np.int64)
    perm[rows] = cols
    return float(weights[rows, cols].max()), perm


def bottleneck_assignment(weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Pairs every row with a distinct column so that the most expensive pair is as cheap as possible.

    Why: replicas of consecutive stages exchange activations in lockstep, so the boundary takes as long as
    its worst pair; any permutation is realisable, so the best one is a bottleneck assignment.

    Args:
        weights: square matrix, weights[i, j] the cost of pairing row i with column j.

    Returns:
        (the worst pair's weight, perm) with perm[i] the column given to row i.
    """
    n = weights.shape[0]
    if n == 0:
        return 0.0, np.empty(0, dtype=np.int64)
    if n == 1:
        return float(weights[0, 0]), np.zeros(1, dtype=np.int64)
    # Every row and every column must use one of its entries: the largest row or column minimum bounds below.
    lower = max(weights.min(axis=1).max(), weights.min(axis=0).max())
    allowed = weights <= lower
    if allowed.all():
        return float(weights.max()), np.arange(n, dtype=np.int64)
    if n <= _DENSE_MATCHING:
        found = _bottleneck_by_ranks(weights)
        if found is not None:
            return found
    perm = _perfect_matching(allowed)
    if perm is not None:
        return float(lower), perm
    values = np.unique(weights[weights > lower])
    lo, hi = 0, len(values) - 1
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        found = _perfect_matching(weights <= values[mid])
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid - 1
    assert best is not None  # values[-1] is the global maximum: everything is allowed there
    return float(values[lo]), best


def path_length(dist: np.ndarray, order: list[int] | np.ndarray) -> float:
    """Length of the open path visiting `order` in turn."""
    order = np.asarray(order, dtype=np.int64)
    if len(order) < 2:
        return 0.0
    return float(dist[order[:-1], order[1:]].sum())


@functools.cache
def _subset_layers(n: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """For each subset size: the subsets, each subset without each node, and which nodes each subset has."""
    bits = 1 << np.arange(n)
    popcount = np.array([bin(m).count("1") for m in range(1 << n)])
    layers = []
    for size in range(2, n + 1):
        masks = np.flatnonzero(popcount == size)
        layers.append((masks, masks[:, None] ^ bits[None, :], (masks[:, None] & bits[None, :]) != 0))
    return tuple(layers)


def _held_karp(dist: np.ndarray) -> tuple[float, list[int]]:
    """Exact shortest Hamiltonian path with free ends, vectorised over all subsets of one size at a time."""
    n = dist.shape[0]
    full = 1 << n
    dp = np.full((full, n), np.inf)
    parent = np.full((full, n), -1, dtype=np.int64)
    dp[1 << np.arange(n), np.arange(n)] = 0.0
    dist_t = dist.T[None, :, :]
    for masks, prev, contains in _subset_layers(n):
        # cand[m, t, j]: the path over masks[m] ends at t, coming from j (the best path over prev[m, t]).
        cand = dp[prev] + dist_t
        best_j = cand.argmin(axis=2)
        best = np.take_along_axis(cand, best_j[:, :, None], axis=2)[:, :, 0]
        dp[masks] = np.where(contains, best, np.inf)
        parent[masks] = best_j
    end = int(dp[full - 1].argmin())
    cost = float(dp[full - 1, end])
    order, mask = [end], full - 1
    while len(order) < n:
        prev_node = int(parent[mask, order[-1]])
        mask ^= 1 << order[-1]
        order.append(prev_node)
    return cost, order[::-1]


def _improve_path(dist: np.ndarray, order: list[int]) -> list[int]:
    """2-opt (reverse a segment) and or-opt (move one node) until no move shortens the path.

    Works on a copy of `dist` padded with a free dummy node at both ends, which turns the open path into
    a closed one whose moves have simple constant-time gains.
    """
    n = len(order)
    pad = np.zeros((n + 1, n + 1))
    pad[:n, :n] = dist
    tour = [n, *order]  # closed tour through the dummy node n; the path is the tour cut at n
    size = n + 1
    improved = True
    while improved:
        improved = False
        for i in range(size - 1):
            a, b = tour[i], tour[i + 1]
            for j in range(i + 2, size):
                c, d = tour[j], tour[(j + 1) % size]
                if d == a:
                    continue
                # The gain counts the two replaced edges only (exact for symmetric costs); the full length
                # check keeps asymmetric costs honest, where reversing b..c also turns its inner edges.
                gain = pad[a, b] + pad[c, d] - pad[a, c] - pad[b, d]
                if gain > 1e-12:
                    cand = tour[: i + 1] + tour[i + 1 : j + 1][::-1] + tour[j + 1 :]
                    if _tour_length(pad, cand) < _tour_length(pad, tour) - 1e-12:
                        tour, improved = cand, True
                        a, b = tour[i], tour[i + 1]
        for i in range(1, size):
            node = tour[i]
            rest = tour[:i] + tour[i + 1 :]
            base = _tour_length(pad, tour)
            removed = (
                base - pad[tour[i - 1], node] - pad[node, tour[(i + 1) % size]] + pad[tour[i - 1], tour[(i + 1) % size]]
            )
            best_cost, best_pos = base, None
            for pos in range(len(rest)):
                p, q = rest[pos], rest[(pos + 1) % len(rest)]
                cost = removed - pad[p, q] + pad[p, node] + pad[node, q]
                if cost < best_cost - 1e-12:
                    best_cost, best_pos = cost, pos + 1
            if best_pos is not None:
                tour, improved = rest[:best_pos] + [node] + rest[best_pos:], True
    cut = tour.index(n)
    return tour[cut + 1 :] + tour[:cut]


def _tour_length(pad: np.ndarray, tour: list[int]) -> float:
    t = np.asarray(tour)
    return float(pad[t, np.roll(t, -1)].sum())


def open_path_tsp(dist: np.ndarray, start: list[int] | None = None) -> tuple[float, list[int]]:
    """Shortest path visiting every node once, from any node to any other (no return).

    Why: the pipeline's stages form a chain, and the chain's links are what it pays for; exact up to
    `EXACT_TSP_MAX_NODES` nodes, beyond that nearest-neighbour starts from every node refined by 2-opt and
    or-opt (plus `start`, a known good order, so the result is never worse than it).

    Args:
        dist: square matrix of link costs (symmetric in DT-FM's model, any in ours).
        start: an optional order to improve on.

    Returns:
        (path length, order of nodes).
    """
    n = dist.shape[0]
    if n <= 1:
        return 0.0, list(range(n))
    if n <= EXACT_TSP_MAX_NODES:
        return _held_karp(dist)
    candidates = [list(start)] if start is not None else []
    for first in range(n):
        order, left = [first], set(range(n)) - {first}
        while left:
            last = order[-1]
            nxt = min(left, key=lambda k: (dist[last, k], k))
            order.append(nxt)
            left.remove(nxt)
        candidates.append(order)
    candidates.sort(key=lambda o: path_length(dist, o))
    best = None
    for order in candidates[:3]:
        refined = _improve_path(dist, order)
        if best is None or path_length(dist, refined) < path_length(dist, best) - 1e-12:
            best = refined
    return path_length(dist, best), best
