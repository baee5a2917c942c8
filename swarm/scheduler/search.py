"""The planner: choose stages, replicas, peers, pipeline order and layer ranges that minimise a step's time.

Search, for each cost model:

1. Peers that are interchangeable (same links, speed and memory) form classes; classes are chained by
   nearest neighbour (a few chains from different ends), fastest peers first inside a class.
2. Shapes (ours only): every number of stages S the model allows, with R = peers // S replicas and a few
   smaller R (dropping the slowest peers); each is screened with two cuts of each chain (pipelines along
   the chain, or groups as chain neighbourhoods) scored in chain order; the best shapes go on.
3. Constructions: a dynamic program over segments of each chain (see `construct`) yields one partition per
   bound on a group's own cost; each is scored with its best pipeline order.
4. The best few are improved by simulated annealing (swaps, deterministic move budget).
5. The winner gets its exact cost: bottleneck pairings across boundaries, open-path TSP order and
   (ours) uneven layer ranges within memory limits.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from swarm.scheduler.baselines import baseline_shape, greedy_layout
from swarm.scheduler.construct import equivalence_classes, interleave, peer_chains, segment_partitions
from swarm.scheduler.cost import INFEASIBLE, DtfmCost, FullCost, Layout, even_layers
from swarm.scheduler.localsearch import AnnealConfig, Partition, anneal
from swarm.scheduler.objective import DtfmObjective, FullObjective, Objective
from swarm.scheduler.plans import Breakdown, ModelSpec, Plan, PlanInput, StagePlan

__all__ = [
    "PeerSpeeds",
    "SearchConfig",
    "SearchResult",
    "layout_to_plan",
    "plan",
    "plan_dtfm",
    "plan_layout",
    "refined",
    "search_dtfm",
    "search_full",
]


@dataclass(frozen=True)
class SearchConfig:
    """How the planner searches; the defaults plan 64 peers in a few seconds on one core."""

    seed: int = 0
    """Everything random in the search draws from this seed: same seed, same plan."""
    chains: int = 6
    """Peer chains the constructions cut (different starting classes, one speed-major)."""
    polish: int = 2
    """Best constructions refined by annealing."""
    constructed_shapes: int = 8
    """Ours: shapes (stages x replicas) that get the segment constructions after screening."""
    shapes: int = 3
    """Ours: shapes, of those, whose best constructions are annealed."""
    anneal_all_shapes_below: int = 16
    """Ours: swarms of at most this many peers anneal every constructed shape (cheap, and more exact)."""
    shape_margin: float = 1.3
    """Ours, larger swarms: only shapes screened within this factor of the best get constructions."""
    replica_fractions: tuple[float, ...] = (1.0, 0.75, 0.5, 0.34)
    """Ours: replica counts tried per number of stages, as fractions of peers // stages."""
    stages: int | None = None
    """Ours: plan exactly this many stages (None: the search chooses)."""
    max_replicas: int | None = None
    """Ours: at most this many replicas per stage (the live runtime serves one pipeline: 1)."""
    max_bounds: int = 48
    """Bounds on a group's own cost tried by the segment dynamic program."""
    anneal: AnnealConfig = field(default_factory=AnnealConfig)

    def __post_init__(self) -> None:
        if min(self.chains, self.polish, self.shapes, self.constructed_shapes) < 1:
            raise ValueError("chains, polish, shapes and constructed_shapes must be >= 1")
        if not all(0 < f <= 1 for f in self.replica_fractions):
            raise ValueError("replica_fractions must lie in (0, 1]")


@dataclass(frozen=True, eq=False)
class SearchResult:
    """The best layout found, its cost, the peers it leaves out and what the search took."""

    breakdown: Breakdown
    layout: Layout
    unused: np.ndarray
    solve_s: float
    candidates: int
    """Partitions scored (constructions and screened shapes; annealing moves not counted)."""


def _rank(objective: Objective, partitions: list[list[np.ndarray]], keep: int) -> list[Partition]:
    """Scores partitions in their best order and keeps the `keep` cheapest distinct ones."""
    scored, seen = [], set()
    for groups in partitions:
        groups = [np.sort(g) for g in groups]
        signature = tuple(sorted(g.tobytes() for g in groups))
        if signature in seen:
            continue
        seen.add(signature)
        order = objective.best_order(groups, hint=list(range(len(groups))))
        scored.append(Partition(groups, order, np.empty(0, dtype=np.int64), objective.score(groups, order)))
    scored.sort(key=lambda p: p.cost)
    return scored[:keep]


def search_dtfm(cost: DtfmCost, stages: int, replicas: int, cfg: SearchConfig | None = None) -> SearchResult:
    """Best S x R grid of all peers under DT-FM's cost (data-parallel + 2 x pipeline)."""
    cfg = cfg or SearchConfig()
    start = time.perf_counter()
    n = cost.link_s.shape[0]
    if n != stages * replicas:
        raise ValueError(f"DT-FM's grid needs exactly stages x replicas = {stages * replicas} peers, got {n}")
    rng = np.random.default_rng(cfg.seed)
    objective = DtfmObjective(cost)
    classes = equivalence_classes(cost.link_s, cost.allreduce_s)
    chains = peer_chains(cost.link_s, classes, np.zeros(n), cfg.chains, rng)
    partitions = [p for chain in chains for p in segment_partitions(objective, chain, stages, replicas, cfg.max_bounds)]
    best = _polish(objective, _rank(objective, partitions, cfg.polish), classes, cfg, rng)
    breakdown, layout = objective.finish(best.groups)
    # Never worse than the greedy baseline: keep its layout if it happens to be cheaper.
    greedy = greedy_layout(cost.link_s, np.zeros(n), stages, replicas, stages)
    greedy_cost = cost.evaluate(greedy)
    if greedy_cost.total_s < breakdown.total_s:
        breakdown, layout = greedy_cost, greedy
    return SearchResult(breakdown, layout, best.unused, time.perf_counter() - start, len(partitions))


def _polish(objective: Objective, starts: list[Partition], classes: np.ndarray, cfg: SearchConfig, rng) -> Partition:
    results = [anneal(objective, p, classes, cfg.anneal, rng) for p in starts]
    return min(results, key=lambda p: p.cost)


def _shapes(n: int, model: ModelSpec, cfg: SearchConfig) -> list[tuple[int, int]]:
    shapes = []
    for stages in range(1, min(model.layers, n) + 1):
        if cfg.stages is not None and stages != cfg.stages:
            continue
        top = n // stages
        for replicas in sorted({max(1, math.floor(top * f)) for f in cfg.replica_fractions}, reverse=True):
            shapes.append((stages, min(replicas, cfg.max_replicas or replicas)))
    return sorted(set(shapes), key=shapes.index)


def _allowed(layout: Layout, cfg: SearchConfig) -> bool:
    return (cfg.stages is None or layout.stages == cfg.stages) and (
        cfg.max_replicas is None or layout.replicas <= cfg.max_replicas
    )


def _peer_classes(cost: FullCost, plan_input: PlanInput) -> np.ndarray:
    # Peers are interchangeable when links, speed, memory and reach (a relays.TunnelCost's) all match.
    columns = [plan_input.speeds_flops_per_s, plan_input.memories_bytes]
    if (unreachable := getattr(cost, "unreachable", None)) is not None:
        columns.append(unreachable.astype(float))
    extra = np.stack(columns, axis=1)
    return equivalence_classes(cost.fill_s, cost.pace_s, cost.round_trip_s, extra=extra)


def _fastest(chain: np.ndarray, speeds: np.ndarray, memories: np.ndarray, count: int) -> np.ndarray:
    """The chain restricted to its `count` fastest peers (ties: more memory), chain order kept."""
    rank = np.lexsort((-memories, -speeds))
    keep = np.zeros(len(speeds), dtype=bool)
    keep[rank[:count]] = True
    return chain[keep[chain]]


def _screen(cost, chains, speeds, memories, shapes) -> list[tuple[float, int, int, list[np.ndarray]]]:
    """Scores every shape by two cuts of two chains, in chain order; infeasible shapes are dropped."""
    screened = []
    for stages, replicas in shapes:
        objective = FullObjective(cost, stages, replicas)
        best_cost, best_groups = INFEASIBLE, None
        for chain in chains[:2]:
            kept = _fastest(chain, speeds, memories, stages * replicas)
            for block in sorted({1, replicas}):  # pipelines along the chain, or groups as neighbourhoods
                groups = [np.sort(g) for g in interleave(kept, stages, replicas, block)]
                value = objective.score(groups, list(range(stages)))
                if value < best_cost:
                    best_cost, best_groups = value, groups
        if best_groups is not None and math.isfinite(best_cost):
            screened.append((best_cost, stages, replicas, best_groups))
    screened.sort(key=lambda item: item[0])
    return screened


PeerSpeeds = Callable[[Layout], "np.ndarray | None"]
"""What a finished layout's peers would compute at with the choices made on it (each stage's precision under the loss
budget, `swarm.scheduler.precision_choice.precision_speeds`): FLOP/s per peer, or None where nothing changes."""


def refined(cost: FullCost, layout: Layout, breakdown: Breakdown, speeds_for: PeerSpeeds | None) -> Breakdown:
    """`layout`'s predicted step with its peers at `speeds_for(layout)` (its layers as they are); `breakdown` as
    it is without a change."""
    speeds = None if speeds_for is None else speeds_for(layout)
    if speeds is None:
        return breakdown
    faster = copy.copy(cost)
    faster.speeds = np.asarray(speeds, dtype=float)
    return faster.evaluate(layout)


def search_full(
    cost: FullCost,
    plan_input: PlanInput,
    cfg: SearchConfig | None = None,
    shapes: list[tuple[int, int]] | None = None,
    speeds_for: PeerSpeeds | None = None,
) -> SearchResult:
    """Best plan under our cost model, free in stages, replicas, peers, order and layer ranges.

    `speeds_for`: choices made on a finished layout that change its peers' speeds (the stages' precisions under a
    loss budget): every annealed shape's best layout (and the greedy one) is finished, re-priced at those speeds,
    and the quickest so re-priced wins, so a shape whose bottleneck a lower precision lifts can beat one that is
    quicker in fp32. None: the annealing's best, as priced."""
    cfg = cfg or SearchConfig()
    start = time.perf_counter()
    n = plan_input.n_peers
    rng = np.random.default_rng(cfg.seed)
    speeds, memories = plan_input.speeds_flops_per_s, plan_input.memories_bytes
    classes = _peer_classes(cost, plan_input)
    distance = cost.fill_s + cost.steady_factor(1) * cost.pace_s
    chains = peer_chains(distance, classes, speeds, cfg.chains, rng)
    screened = _screen(cost, chains, speeds, memories, shapes or _shapes(n, cost.model, cfg))
    if not screened:
        raise ValueError("no plan fits: the model does not fit in the peers' memory for any number of stages")
    candidates = len(screened)
    small = n <= cfg.anneal_all_shapes_below
    if not small:
        # Bigger swarms: only shapes screened within a margin of the best get constructions.
        screened = [item for item in screened if item[0] <= cfg.shape_margin * screened[0][0]] or screened[:1]
    # Constructions for the most promising shapes; annealing for the best of those.
    constructed: list[tuple[float, FullObjective, list[Partition]]] = []
    for _, stages, replicas, seed_groups in screened[: cfg.constructed_shapes]:
        objective = FullObjective(cost, stages, replicas)
        partitions = [seed_groups]
        for chain in chains:
            kept = _fastest(chain, speeds, memories, stages * replicas)
            partitions += segment_partitions(objective, kept, stages, replicas, cfg.max_bounds)
        candidates += len(partitions)
        # Score in chain order first (cheap), then give the best few their best order.
        partitions.sort(key=lambda groups, o=objective: o.score(groups, list(range(len(groups)))))
        starts = _rank(objective, partitions[: 2 * cfg.polish], cfg.polish)
        for p in starts:
            used = np.zeros(n, dtype=bool)
            used[np.concatenate(p.groups)] = True
            p.unused = np.flatnonzero(~used)
        constructed.append((starts[0].cost, objective, starts))
    constructed.sort(key=lambda item: item[0])
    best: tuple[float, Partition, FullObjective] | None = None
    finalists: list[tuple[Breakdown, Layout | None, np.ndarray]] = []
    annealed = len(constructed) if small else cfg.shapes
    for _, objective, starts in constructed[:annealed]:
        found = _polish(objective, starts, classes, cfg, rng)
        if speeds_for is not None:  # every shape's best, finished and re-priced with the choices made on it
            breakdown, layout = objective.finish(found.groups)
            if layout is not None:
                finalists.append((refined(cost, layout, breakdown, speeds_for), layout, found.unused))
        if best is None or found.cost < best[0]:
            best = (found.cost, found, objective)
    _, partition, objective = best
    if finalists:
        breakdown, layout, unused = min(finalists, key=lambda item: item[0].total_s)
    else:
        breakdown, layout = objective.finish(partition.groups)
        unused = partition.unused
    # Never worse than the greedy baseline: keep its layout if it happens to be cheaper.
    greedy = _greedy_full(cost, plan_input)
    if greedy is not None and _allowed(greedy, cfg):
        greedy_cost = refined(cost, greedy, cost.evaluate(greedy), speeds_for)
        if layout is None or greedy_cost.total_s < breakdown.total_s:
            breakdown, layout = greedy_cost, greedy
            unused = np.setdiff1d(np.arange(n), greedy.grid.ravel())
    if layout is None:
        raise RuntimeError("completion of the best partition failed")
    return SearchResult(breakdown, layout, unused, time.perf_counter() - start, candidates)


def _greedy_full(cost: FullCost, plan_input: PlanInput) -> Layout | None:
    try:
        stages, replicas = baseline_shape(plan_input, cost.model)
    except ValueError:
        return None
    distance = cost.fill_s + cost.steady_factor(replicas) * cost.pace_s
    return greedy_layout(distance, plan_input.speeds_flops_per_s, stages, replicas, cost.model.layers)


def layout_to_plan(
    layout: Layout, breakdown: Breakdown, plan_input: PlanInput, cost_model: str, unused: np.ndarray, version: int = 0
) -> Plan:
    """Names the peers of a layout and turns layer counts into ranges."""
    ids = [p.peer_id for p in plan_input.peers]
    bounds = np.concatenate([[0], np.cumsum(layout.layers)])
    stages = tuple(
        StagePlan(int(bounds[s]), int(bounds[s + 1]), tuple(ids[int(p)] for p in layout.grid[s]))
        for s in range(layout.stages)
    )
    return Plan(stages, breakdown, cost_model, version, tuple(ids[int(p)] for p in sorted(unused)))


def plan_layout(made: Plan, plan_input: PlanInput) -> Layout:
    """The plan `made` as a layout over `plan_input`'s peers (its stages' peers and layer counts):
    `layout_to_plan`'s inverse."""
    index = {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    grid = np.array([[index[pid] for pid in stage.peer_ids] for stage in made.stages])
    return Layout(grid, np.array([s.layer_end - s.layer_start for s in made.stages], dtype=np.int64))


def plan(plan_input: PlanInput, model: ModelSpec, cfg: SearchConfig | None = None, version: int = 0) -> Plan:
    """The live swarm's entry point: the best plan for these peers and this model under our cost model.

    Args:
        plan_input: peers and measured links (from a scenario, a JSON file, or the DHT).
        model: the model's figures (`ModelSpec.transformer(...)`).
        cfg: search settings; the seed makes the result reproducible.
        version: stamped on the plan so peers can tell a newer plan from an older one.

    Returns:
        A JSON-serialisable `Plan`: stages in pipeline order with layer ranges and one peer per replica,
        and the predicted step time with its breakdown.
    """
    result = search_full(FullCost(plan_input, model), plan_input, cfg)
    return layout_to_plan(result.layout, result.breakdown, plan_input, "full", result.unused, version)


def plan_dtfm(
    plan_input: PlanInput,
    activation_bytes: float,
    gradient_bytes: float,
    stages: int = 8,
    replicas: int = 8,
    layers: int = 24,
    cfg: SearchConfig | None = None,
) -> Plan:
    """The best grid under DT-FM's own cost model and grid (every peer used, equal layer ranges)."""
    cost = DtfmCost(plan_input, activation_bytes, gradient_bytes, replicas)
    result = search_dtfm(cost, stages, replicas, cfg)
    layout = replace(result.layout, layers=even_layers(layers, stages))
    return layout_to_plan(layout, result.breakdown, plan_input, "dtfm", result.unused)
