"""Structured starting partitions: peer chains, interleaved groups, and a dynamic program over segments.

Good plans are global patterns that single swaps cannot reach one step at a time: in a datacenter each stage
group takes one GPU from every machine (pipelines stay inside machines); across two campuses each group
stays inside one campus (all-reduces stay local); with spot instances the standalone GPUs fill whole groups
at one end of the pipeline while the machines' GPUs are interleaved. All are *segments* of a chain of
peers (neighbours on the chain are close on the network) cut into groups with an interleaving block:

    block 1:  group k takes chain positions k, k + L, k + 2L, ...   (pipelines run along the chain)
    block R:  group k takes positions kR .. kR + R - 1               (groups are chain neighbourhoods)

`segment_partitions` chooses the segments by dynamic programming: for each bound on a group's own cost it
finds the segments minimising the sum of boundary weights, which is exactly DT-FM's cost structure
(max over groups + sum over boundaries) and a good proxy of ours.
"""

from __future__ import annotations

import numpy as np

from swarm.scheduler.objective import Objective

__all__ = ["equivalence_classes", "interleave", "peer_chains", "segment_partitions"]

_EXACT_BOUNDARY_MAX_REPLICAS = 8  # larger grids' segment links use the positional pairing (an upper bound)
_EXACT_BOUNDARY_MAX_STAGES = 12


def _swappable(matrices: tuple[np.ndarray, ...], i: int, j: int) -> bool:
    keep = np.ones(matrices[0].shape[0], dtype=bool)
    keep[[i, j]] = False
    return all(
        np.array_equal(m[i, keep], m[j, keep]) and np.array_equal(m[keep, i], m[keep, j]) and m[i, j] == m[j, i]
        for m in matrices
    )


def equivalence_classes(*matrices: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """Class id per peer; two peers share a class when swapping them changes no matrix entry (nor `extra`).

    Why: peers of one class are interchangeable, so the search never swaps two of them, and chains keep
    them together. Peers are bucketed by their sorted rows and columns first, so only likely pairs are
    compared entry by entry.
    """
    n = matrices[0].shape[0]
    off = ~np.eye(n, dtype=bool)
    keys = []
    for i in range(n):
        parts = [np.sort(m[i, off[i]]).tobytes() + np.sort(m[off[i], i]).tobytes() for m in matrices]
        if extra is not None:
            parts.append(np.ascontiguousarray(extra[i]).tobytes())
        keys.append(b"".join(parts))
    classes = np.empty(n, dtype=np.int64)
    representatives: dict[bytes, list[int]] = {}
    count = 0
    for i in range(n):
        reps = representatives.setdefault(keys[i], [])
        for r in reps:
            if _swappable(matrices, i, r):
                classes[i] = classes[r]
                break
        else:
            classes[i] = count
            reps.append(i)
            count += 1
    return classes


def peer_chains(
    distance: np.ndarray, classes: np.ndarray, speeds: np.ndarray, count: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Orders of all peers in which consecutive peers are close (and, among equally close ones, as fast).

    Classes are chained by nearest neighbour from several starting classes (the most remote ones first,
    chain ends belong on the periphery), ties going to the faster class; inside a class peers go fastest
    first. With more than one class of speed, the last chain is speed-major instead (fastest classes first,
    near ones next to each other), which cuts into groups that do not wait for a slow member.
    """
    ids = np.unique(classes)
    members = {c: np.flatnonzero(classes == c) for c in ids}
    for c in ids:
        m = members[c]
        members[c] = m[np.lexsort((m, -speeds[m]))]
    k = len(ids)
    reps = np.array([members[c][0] for c in ids])
    rep_speed = speeds[reps]
    d = distance[np.ix_(reps, reps)].astype(np.float64).copy()
    np.fill_diagonal(d, np.inf)
    remoteness = np.where(np.isinf(d), 0.0, d).mean(axis=1)
    starts = list(np.argsort(-remoteness, kind="stable")[: max(1, count // 2)])
    others = [int(s) for s in rng.permutation(k) if s not in starts]
    starts += others[: max(0, count - len(starts))]
    speed_major = len(np.unique(rep_speed)) > 1 and count > 1
    chains = []
    for first in starts[: count - 1 if speed_major else count]:
        order, left = [int(first)], np.ones(k, dtype=bool)
        left[first] = False
        for _ in range(k - 1):
            row = np.where(left, d[order[-1]], np.inf)
            ties = np.flatnonzero(row <= row.min() * (1 + 1e-9))
            nxt = int(ties[np.argmax(rep_speed[ties])])
            order.append(nxt)
            left[nxt] = False
        chains.append(np.concatenate([members[ids[c]] for c in order]))
    if speed_major:
        near = {int(c): i for i, c in enumerate(_class_order(chains[0], classes))}
        order = sorted(range(k), key=lambda c: (-rep_speed[c], near[int(ids[c])]))
        chains.append(np.concatenate([members[ids[c]] for c in order]))
    return chains


def _class_order(chain: np.ndarray, classes: np.ndarray) -> list[int]:
    seen, out = set(), []
    for p in chain:
        c = int(classes[p])
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def interleave(peers: np.ndarray, groups: int, replicas: int, block: int) -> list[np.ndarray]:
    """Cuts `peers` (groups x replicas of them) into groups taking `block` consecutive peers in turn.

    When `block` does not divide `replicas`, the last round deals one chunk of the remainder to each group.
    Members stay in chain order, so member r of one group and member r of the next are chain neighbours
    (the positional pairing the segment search uses for large groups).
    """
    peers = np.asarray(peers, dtype=np.int64)
    rounds, rest = divmod(replicas, block)
    head = peers[: groups * block * rounds].reshape(rounds, groups, block).transpose(1, 0, 2)
    tail = peers[groups * block * rounds : groups * replicas].reshape(groups, rest)
    return list(np.concatenate([head.reshape(groups, rounds * block), tail], axis=1))


def _link_weight(objective: Objective, a: np.ndarray, b: np.ndarray, exact: bool) -> float:
    """A boundary's weight: exact (best pairing) or its upper bound pairing replicas by chain position."""
    if exact:
        return objective.boundary(np.sort(a), np.sort(b)).weight
    return objective.positional_weight(a, b)


def block_sizes(replicas: int, limit: int = 6) -> list[int]:
    """Interleaving blocks worth trying: 1, 2, 4, ... and the whole group."""
    sizes, b = [], 1
    while b < replicas and len(sizes) < limit - 1:
        sizes.append(b)
        b *= 2
    return [*sizes, replicas]


def segment_partitions(
    objective: Objective, chain: np.ndarray, stages: int, replicas: int, max_bounds: int = 48
) -> list[list[np.ndarray]]:
    """Partitions of the first stages x replicas peers of `chain` into segments, one per bound tried.

    For each bound t on a group's own cost (`objective.group_term`) a shortest path over chain positions
    picks segments (start, length, block) whose groups all stay under t and whose boundary weights (inside
    segments as cut, between segments by best pairing) sum to the least. Returns the distinct results.
    """
    blocks = block_sizes(replicas)
    # Exact pairings cost a matching each; the number of links grows as stages^3, so only small grids get them.
    exact = replicas <= _EXACT_BOUNDARY_MAX_REPLICAS and stages <= _EXACT_BOUNDARY_MAX_STAGES
    segments: list[tuple[int, int, list[np.ndarray], float, float]] = []  # start, length, groups, max, inner
    for start in range(stages):
        for length in range(1, stages - start + 1):
            peers = chain[start * replicas : (start + length) * replicas]
            seen = set()
            for block in blocks:
                groups = interleave(peers, length, replicas, block)
                signature = tuple(np.sort(g).tobytes() for g in groups)
                if signature in seen:
                    continue
                seen.add(signature)
                own = max(objective.group_term(np.sort(g)) for g in groups)
                inner = sum(_link_weight(objective, groups[i], groups[i + 1], exact) for i in range(length - 1))
                segments.append((start, length, groups, own, inner))
    ending = [[k for k, s in enumerate(segments) if s[0] + s[1] == p] for p in range(stages + 1)]
    starting = [[k for k, s in enumerate(segments) if s[0] == p] for p in range(stages)]
    links = {}
    for p in range(1, stages):
        links[p] = np.array(
            [
                [_link_weight(objective, segments[e][2][-1], segments[s][2][0], exact) for s in starting[p]]
                for e in ending[p]
            ]
        )
    own = np.array([s[3] for s in segments])
    inner = np.array([s[4] for s in segments])
    bounds = np.unique(own[np.isfinite(own)])
    if len(bounds) > max_bounds:
        bounds = bounds[np.unique(np.linspace(0, len(bounds) - 1, max_bounds).round().astype(int))]
    results, seen_results = [], set()
    for bound in bounds:
        allowed = own <= bound
        # best[k]: least weight of a path of segments covering positions [0, end of segment k) ending with k
        best = np.full(len(segments), np.inf)
        parent = np.full(len(segments), -1)
        for k in starting[0]:
            if allowed[k]:
                best[k] = inner[k]
        for p in range(1, stages):
            ends, starts = ending[p], starting[p]
            if not ends or not starts:
                continue
            total = best[ends][:, None] + links[p] + inner[starts][None, :]
            total[:, ~allowed[starts]] = np.inf
            choice = total.argmin(axis=0)
            value = total[choice, np.arange(len(starts))]
            for col, k in enumerate(starts):
                if value[col] < best[k]:
                    best[k], parent[k] = value[col], ends[choice[col]]
        finals = ending[stages]
        k = finals[int(np.argmin(best[finals]))]
        if not np.isfinite(best[k]):
            continue
        path = []
        while k >= 0:
            path.append(k)
            k = parent[k]
        partition = [np.sort(g) for k in reversed(path) for g in segments[k][2]]
        signature = tuple(sorted(g.tobytes() for g in partition))
        if signature not in seen_results:
            seen_results.add(signature)
            results.append(partition)
    return results
