"""What our plans are measured against: a random assignment and a greedy one, each on a fixed shape.

Both fill a grid of stages x replicas and keep its order and pairing as built: random is DT-FM's random
scheduler (a shuffled grid, stage s paired column by column with stage s + 1); greedy grows each stage group
around a seed peer from its nearest free peers, chains the groups by nearest neighbour and pairs each
replica with the nearest free replica of the next stage. Under our cost model both use the even layer
split on the shape a naive system picks: the fewest stages whose even split fits every peer's memory.
"""

from __future__ import annotations

import numpy as np

from swarm.scheduler.cost import FullCost, Layout, even_layers
from swarm.scheduler.plans import ModelSpec, PlanInput

__all__ = ["baseline_shape", "full_distance", "greedy_layout", "random_layouts"]


def baseline_shape(plan_input: PlanInput, model: ModelSpec) -> tuple[int, int]:
    """(stages, replicas) of the even split: the fewest stages whose largest share fits the smallest peer."""
    n = plan_input.n_peers
    smallest = float(plan_input.memories_bytes.min())
    for stages in range(1, min(model.layers, n) + 1):
        replicas = n // stages
        share = int(even_layers(model.layers, stages).max())
        if model.stage_memory_bytes(share, stages, replicas) <= smallest:
            return stages, replicas
    raise ValueError("the model does not fit in the smallest peer's memory even one layer per stage")


def random_layouts(n_peers: int, stages: int, replicas: int, layers: int, count: int, seed: int) -> list[Layout]:
    """`count` shuffled grids (the first stages x replicas peers of each shuffle), even layer split."""
    rng = np.random.default_rng(seed)
    split = even_layers(layers, stages)
    return [
        Layout(rng.permutation(n_peers)[: stages * replicas].reshape(stages, replicas), split) for _ in range(count)
    ]


def greedy_layout(distance: np.ndarray, speeds: np.ndarray, stages: int, replicas: int, layers: int) -> Layout:
    """Nearest-neighbour groups, chained and paired greedily, on the stages x replicas fastest peers.

    Args:
        distance: distance[i, j], the cost of peer i sending to peer j (its pipeline link time).
        speeds: peers' compute speeds; the fastest are kept when not all peers fit the shape.
        stages, replicas: the shape.
        layers: the model's layers (split evenly).
    """
    n = len(speeds)
    kept = np.sort(np.lexsort((np.arange(n), -speeds))[: stages * replicas])
    d = distance[np.ix_(kept, kept)] + distance[np.ix_(kept, kept)].T
    free = np.ones(len(kept), dtype=bool)
    groups = []
    for _ in range(stages):
        members = [int(np.flatnonzero(free)[0])]
        free[members[0]] = False
        while len(members) < replicas:
            total = d[members].sum(axis=0)
            nxt = int(np.where(free, total, np.inf).argmin())
            members.append(nxt)
            free[nxt] = False
        groups.append(members)
    mean = np.array([[d[np.ix_(a, b)].mean() for b in groups] for a in groups])
    order, left = [0], set(range(1, stages))
    while left:
        nxt = min(left, key=lambda k: (mean[order[-1], k], k))
        order.append(nxt)
        left.remove(nxt)
    rows = [groups[order[0]]]
    for k in order[1:]:
        candidates, row = list(groups[k]), []
        for p in rows[-1]:
            q = min(candidates, key=lambda c, p=p: (d[p, c], c))
            row.append(q)
            candidates.remove(q)
        rows.append(row)
    return Layout(kept[np.array(rows)], even_layers(layers, stages))


def full_distance(cost: FullCost, replicas: int) -> np.ndarray:
    return cost.fill_s + cost.steady_factor(replicas) * cost.pace_s
