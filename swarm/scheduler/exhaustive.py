"""Every plan of a tiny swarm, scored one by one: the ground truth the search is tested against.

Enumerates which peers are used, their partition into stage groups, the pipeline order, each stage's
arrangement of replicas (which fixes the pairing with the previous stage) and (ours) every split of the
layers. Exponential: meant for up to about eight peers.
"""

from __future__ import annotations

import itertools

import numpy as np

from swarm.scheduler.cost import INFEASIBLE, DtfmCost, FullCost, Layout
from swarm.scheduler.plans import Breakdown

__all__ = ["exhaustive_dtfm", "exhaustive_full"]


def _partitions(items: list[int], size: int):
    """Unordered partitions of `items` into blocks of `size` (the block holding items[0] comes first)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [x for x in rest if x not in others]
        for tail in _partitions(remaining, size):
            yield [(first, *others), *tail]


def _grids(peers: list[int], stages: int, replicas: int):
    """Every grid of these peers: partition, order of stages, arrangement of each later stage."""
    for partition in _partitions(peers, replicas):
        for order in itertools.permutations(range(stages)):
            first = partition[order[0]]
            later = [list(itertools.permutations(partition[k])) for k in order[1:]]
            for rows in itertools.product(*later):
                yield np.array([first, *rows], dtype=np.int64)


def exhaustive_dtfm(cost: DtfmCost, stages: int, replicas: int) -> tuple[float, Layout]:
    """The cheapest grid of all peers under DT-FM's cost."""
    n = cost.link_s.shape[0]
    best, best_layout = INFEASIBLE, None
    for grid in _grids(list(range(n)), stages, replicas):
        layout = Layout(grid, np.ones(stages, dtype=np.int64))
        value = cost.evaluate(layout).total_s
        if value < best:
            best, best_layout = value, layout
    return best, best_layout


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield np.array([bounds[i + 1] - bounds[i] for i in range(parts)], dtype=np.int64)


def exhaustive_full(cost: FullCost) -> tuple[Breakdown, Layout]:
    """The cheapest plan under our cost model over every shape, subset, order, pairing and layer split."""
    m = cost.model
    n = len(cost.speeds)
    best, best_layout = INFEASIBLE, None
    for stages in range(1, min(m.layers, n) + 1):
        splits = list(_compositions(m.layers, stages))
        for replicas in range(1, n // stages + 1):
            steady = cost.steady_factor(replicas)
            for subset in itertools.combinations(range(n), stages * replicas):
                for grid in _grids(list(subset), stages, replicas):
                    # Layer-independent parts once per grid, then every split.
                    stats = [cost.group_stats(row, stages) for row in grid]
                    caps = np.array([st.max_layers for st in stats])
                    unit = m.flops_per_layer / np.array([st.speed_flops_per_s for st in stats])
                    fills = [float(cost.fill_s[grid[s], grid[s + 1]].max()) for s in range(stages - 1)]
                    paces = [float(cost.pace_s[grid[s], grid[s + 1]].max()) for s in range(stages - 1)]
                    link_pace, fill = max(paces, default=0.0), sum(fills)
                    tied, rate = cost.tied_s(grid), cost.rate_bound_s(grid)
                    for layers in splits:
                        if (layers > caps).any():
                            continue
                        compute = layers * unit
                        sync = max(float(st.sync_table_s[k]) for st, k in zip(stats, layers, strict=True))
                        pace = max(compute.max(), link_pace, cost.round_trip_pace(compute, fills, steady))
                        phases = compute.sum() + fill + steady * pace + max(sync, tied) + m.step_overhead_s
                        value = max(phases, (steady + 1) * link_pace, rate)
                        if value < best - 1e-12:
                            best, best_layout = value, Layout(grid, layers)
    if best_layout is None:
        return Breakdown(total_s=INFEASIBLE), None
    return cost.evaluate(best_layout), best_layout
