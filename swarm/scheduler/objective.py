"""The search's view of a cost model: per-group terms, per-boundary terms, and the score of an order.

A plan's cost splits into terms of one stage group (its all-reduce, its slowest replica, its memory) and
terms of two consecutive groups (the best pairing of their replicas). The search changes one or two groups
at a time, so both kinds are cached by group content and only the touched ones are recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from swarm.scheduler.cost import INFEASIBLE, DtfmCost, FullCost, GroupStats, Layout, allocate_layers
from swarm.scheduler.graph import bottleneck_assignment, open_path_tsp
from swarm.scheduler.plans import Breakdown

__all__ = ["BoundaryTerm", "DtfmObjective", "FullObjective", "Objective"]

_CACHE_LIMIT = 200_000  # entries per cache before it is cleared (memory stays bounded on long searches)


@dataclass(frozen=True, eq=False)
class BoundaryTerm:
    """Best pairing of two groups' replicas: a[r] sends to b[perm[r]]."""

    weight: float
    """What the order search minimises the sum of."""
    fill_s: float = 0.0
    pace_s: float = 0.0
    perm: np.ndarray | None = None


def _key(group: np.ndarray) -> bytes:
    return group.tobytes()


class Objective:
    """Common caching; subclasses say what a group and a boundary cost and how they add up."""

    name = ""
    symmetric = True

    def reorder_on_reject(self, stages: int) -> bool:
        """Whether to re-solve the order for a move the current order rejects (when that is cheap)."""
        return stages <= 8

    def __init__(self) -> None:
        self._groups: dict[bytes, object] = {}
        self._boundaries: dict[tuple[bytes, bytes], BoundaryTerm] = {}

    def group(self, g: np.ndarray):
        key = _key(g)
        found = self._groups.get(key)
        if found is None:
            if len(self._groups) > _CACHE_LIMIT:
                self._groups.clear()
            found = self._groups[key] = self._group(g)
        return found

    def boundary(self, a: np.ndarray, b: np.ndarray) -> BoundaryTerm:
        key = (_key(a), _key(b))
        found = self._boundaries.get(key)
        if found is None:
            if len(self._boundaries) > _CACHE_LIMIT:
                self._boundaries.clear()
            found = self._boundaries[key] = self._boundary(a, b)
            if self.symmetric and found.perm is not None:
                inverse = np.empty_like(found.perm)
                inverse[found.perm] = np.arange(len(found.perm))
                self._boundaries[key[::-1]] = BoundaryTerm(found.weight, found.fill_s, found.pace_s, inverse)
        return found

    def weights(self, groups: list[np.ndarray]) -> np.ndarray:
        """Boundary weights between every two groups (the order search's distance matrix)."""
        s = len(groups)
        w = np.zeros((s, s))
        for i in range(s):
            for j in range(s):
                if i != j and (not self.symmetric or i < j):
                    w[i, j] = self.boundary(groups[i], groups[j]).weight
                    if self.symmetric:
                        w[j, i] = w[i, j]
        return w

    def score(self, groups: list[np.ndarray], order: list[int]) -> float:
        """Cost of the groups laid out in `order` (best pairings, and for ours the best layer ranges)."""
        raise NotImplementedError

    def group_term(self, g: np.ndarray) -> float:
        """A group's own cost as one number, for constructions that bound it (its "max" part)."""
        raise NotImplementedError

    def positional_weight(self, a: np.ndarray, b: np.ndarray) -> float:
        """Boundary weight when a[r] is paired with b[r]: an upper bound of `boundary(a, b).weight`."""
        raise NotImplementedError

    def lower_bound(self, groups: list[np.ndarray]) -> float:
        """A cost no order can beat, from the groups alone (lets the search reject moves early)."""
        return 0.0

    def best_order(self, groups: list[np.ndarray], hint: list[int] | None = None) -> list[int]:
        return open_path_tsp(self.weights(groups), start=hint)[1]

    def finish(self, groups: list[np.ndarray]) -> tuple[Breakdown, Layout | None]:
        """The exact cost of a partition with its best order, pairings and layers, and that layout."""
        raise NotImplementedError

    def _group(self, g: np.ndarray):
        raise NotImplementedError

    def _boundary(self, a: np.ndarray, b: np.ndarray) -> BoundaryTerm:
        raise NotImplementedError


class DtfmObjective(Objective):
    """DT-FM's cost: max over groups of the all-reduce + 2 x the order's sum of bottleneck links."""

    name = "dtfm"

    def __init__(self, cost: DtfmCost):
        super().__init__()
        self.cost = cost

    def _group(self, g: np.ndarray) -> float:
        return self.cost.group_cost(g)

    def _boundary(self, a: np.ndarray, b: np.ndarray) -> BoundaryTerm:
        value, perm = bottleneck_assignment(self.cost.link_s[np.ix_(a, b)])
        return BoundaryTerm(value, perm=perm)

    def group_term(self, g: np.ndarray) -> float:
        return self.group(g)

    def positional_weight(self, a: np.ndarray, b: np.ndarray) -> float:
        return float(self.cost.link_s[a, b].max())

    def lower_bound(self, groups: list[np.ndarray]) -> float:
        return max(self.group(g) for g in groups)

    def score(self, groups: list[np.ndarray], order: list[int]) -> float:
        sync = max(self.group(g) for g in groups)
        path = sum(self.boundary(groups[a], groups[b]).weight for a, b in zip(order[:-1], order[1:], strict=True))
        return sync + 2 * path

    def finish(self, groups: list[np.ndarray]) -> tuple[Breakdown, Layout | None]:
        return self.cost.complete(groups)


class FullObjective(Objective):
    """Our cost model for one shape (stages x replicas): see `swarm.scheduler.cost`."""

    name = "full"

    def __init__(self, cost: FullCost, stages: int, replicas: int):
        super().__init__()
        self.cost = cost
        self.stages = stages
        self.replicas = replicas
        self.steady = cost.steady_factor(replicas)
        m = cost.model
        self.even_layers = m.layers / stages
        self.symmetric = bool(np.allclose(cost.pace_s, cost.pace_s.T) and np.allclose(cost.fill_s, cost.fill_s.T))
        self._scores: dict[tuple, float] = {}

    def reorder_on_reject(self, stages: int) -> bool:
        return stages <= 8 and self.replicas <= 4

    def _group(self, g: np.ndarray) -> GroupStats:
        return self.cost.group_stats(g, self.stages)

    def _boundary(self, a: np.ndarray, b: np.ndarray) -> BoundaryTerm:
        weight, fill, pace, perm = self.cost.boundary(a, b)
        return BoundaryTerm(weight, fill, pace, perm)

    def group_term(self, g: np.ndarray) -> float:
        """All-reduce plus steady compute of an even share of the layers; infinite if they cannot fit."""
        st = self.group(g)
        share = int(np.ceil(self.even_layers))
        if st.max_layers < 1:
            return INFEASIBLE
        share = min(share, st.max_layers)
        compute = share * self.cost.model.flops_per_layer / st.speed_flops_per_s
        return float(st.sync_table_s[share]) + (self.steady + 1) * compute

    def positional_weight(self, a: np.ndarray, b: np.ndarray) -> float:
        return float((self.cost.fill_s[a, b] + self.steady * self.cost.pace_s[a, b]).max())

    def score(self, groups: list[np.ndarray], order: list[int]) -> float:
        key = tuple(_key(groups[k]) for k in order)
        found = self._scores.get(key)
        if found is None:
            if len(self._scores) > _CACHE_LIMIT:
                self._scores.clear()
            found = self._scores[key] = self._score(groups, order)
        return found

    def _score(self, groups: list[np.ndarray], order: list[int]) -> float:
        m = self.cost.model
        stats = [self.group(groups[k]) for k in order]
        terms = [self.boundary(groups[a], groups[b]) for a, b in zip(order[:-1], order[1:], strict=True)]
        link_pace = max((t.pace_s for t in terms), default=0.0)
        layers = allocate_layers(stats, m.layers, m.flops_per_layer, self.steady, link_pace)
        if layers is None:
            return INFEASIBLE
        compute = layers * m.flops_per_layer / np.array([st.speed_flops_per_s for st in stats])
        fills = [t.fill_s for t in terms]
        pace = max(float(compute.max()), link_pace, self.cost.round_trip_pace(compute, fills, self.steady))
        sync = max(float(st.sync_table_s[n]) for st, n in zip(stats, layers, strict=True))
        return float(compute.sum()) + sum(fills) + self.steady * pace + sync

    def finish(self, groups: list[np.ndarray]) -> tuple[Breakdown, Layout | None]:
        return self.cost.complete(groups, [self.group(g) for g in groups])
