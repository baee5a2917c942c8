"""Local search on a partition: swap peers between stage groups (or with unused peers), keep what helps.

Simulated annealing with a fixed number of moves, so a seed gives the same plan on any machine. Moves
evaluate the cost with the current pipeline order (cheap: only the touched groups and boundaries are new);
when that rejects a move and the order search is cheap, the order is re-solved before giving up, since a
swap can make another order better.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from swarm.scheduler.graph import EXACT_TSP_MAX_NODES
from swarm.scheduler.objective import Objective

__all__ = ["AnnealConfig", "Partition", "anneal"]


@dataclass(frozen=True)
class AnnealConfig:
    """How hard the local search tries."""

    moves: int = 2000
    """Swap attempts (the budget that makes the search deterministic)."""
    start_temperature: float = 0.02
    """Initial temperature as a fraction of the starting cost (a worse move of that size passes ~1/e)."""
    end_temperature: float = 1e-4
    """Final temperature, same unit; the schedule is geometric in between."""
    pool_move_share: float = 0.3
    """Share of moves that swap a stage member with an unused peer, when there are unused peers."""
    patience: int | None = 600
    """Stop after this many moves without a new best (None: use every move)."""
    reorder_every: int = 50
    """Re-solve the pipeline order after this many accepted moves."""
    time_limit_s: float | None = None
    """Safety stop in wall time; when it triggers the result depends on the machine's speed."""


@dataclass
class Partition:
    """Stage groups (each sorted), their pipeline order, unused peers, and the cost in that order."""

    groups: list[np.ndarray]
    order: list[int]
    unused: np.ndarray
    cost: float

    def copy(self) -> Partition:
        return Partition([g.copy() for g in self.groups], list(self.order), self.unused.copy(), self.cost)


def _sorted_swap(group: np.ndarray, old: int, new: int) -> np.ndarray:
    out = group.copy()
    out[np.flatnonzero(out == old)[0]] = new
    out.sort()
    return out


def anneal(
    objective: Objective,
    start: Partition,
    classes: np.ndarray,
    cfg: AnnealConfig,
    rng: np.random.Generator,
) -> Partition:
    """Improves `start` by swaps; returns the best partition seen (its cost in its own order)."""
    cur = start.copy()
    best = cur.copy()
    s = len(cur.groups)
    if cfg.moves <= 0 or (s < 2 and len(cur.unused) == 0) or not math.isfinite(cur.cost):
        return best
    t0 = cfg.start_temperature * cur.cost
    t1 = cfg.end_temperature * cur.cost
    deadline = None if cfg.time_limit_s is None else time.perf_counter() + cfg.time_limit_s
    cheap_order = objective.reorder_on_reject(s) and s <= EXACT_TSP_MAX_NODES
    accepted, last_best = 0, 0
    for move in range(cfg.moves):
        if cfg.patience is not None and move - last_best > cfg.patience:
            break
        if deadline is not None and move % 64 == 0 and time.perf_counter() > deadline:
            break
        temperature = t0 * (t1 / t0) ** (move / cfg.moves) if t0 > 0 else 0.0
        threshold = cur.cost - temperature * math.log(rng.random() + 1e-300)
        groups = list(cur.groups)
        unused = cur.unused
        if len(unused) and (s < 2 or rng.random() < cfg.pool_move_share):
            a = int(rng.integers(s))
            old = int(groups[a][rng.integers(len(groups[a]))])
            k = int(rng.integers(len(unused)))
            new = int(unused[k])
            if classes[old] == classes[new]:
                continue
            groups[a] = _sorted_swap(groups[a], old, new)
            unused = unused.copy()
            unused[k] = old
        else:
            a, b = (int(x) for x in rng.choice(s, size=2, replace=False))
            pa = int(groups[a][rng.integers(len(groups[a]))])
            pb = int(groups[b][rng.integers(len(groups[b]))])
            if classes[pa] == classes[pb]:
                continue
            groups[a] = _sorted_swap(groups[a], pa, pb)
            groups[b] = _sorted_swap(groups[b], pb, pa)
        bound = objective.lower_bound(groups)
        if bound > threshold:
            continue
        order = cur.order
        cost = objective.score(groups, order)
        if cost > threshold and cheap_order:
            order = objective.best_order(groups, hint=order)
            cost = objective.score(groups, order)
        if cost > threshold:
            continue
        cur = Partition(groups, list(order), unused, cost)
        accepted += 1
        if accepted % cfg.reorder_every == 0 and not cheap_order:
            order = objective.best_order(cur.groups, hint=cur.order)
            reordered = objective.score(cur.groups, order)
            if reordered < cur.cost:
                cur.order, cur.cost = order, reordered
        if cur.cost < best.cost - 1e-12:
            best, last_best = cur.copy(), move
    order = objective.best_order(best.groups, hint=best.order)
    reordered = objective.score(best.groups, order)
    if reordered < best.cost:
        best.order, best.cost = order, reordered
    return best
