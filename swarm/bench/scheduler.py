"""`swarm bench scheduler`: our plans against a random and a greedy assignment on DT-FM's scenarios.

Two kinds of rows per scenario. `dtfm`: DT-FM's own cost model and grid (8 stages x 8 replicas,
data-parallel cost + 2 x pipeline cost), so the figure compares with DT-FM's published search. `full`: our
cost model (compute, compressed transfers, latency, micro-batch pacing, gradient averaging, memory) with a
free choice of stages, replicas and layer ranges, for DT-FM's scenarios and for larger synthetic swarms
spread over the worldwide scenario's regions. Random is the median of many shuffled grids; greedy is the
nearest-neighbour assignment (see `swarm.scheduler.baselines`); both use the even layer split.

The dtfm rows' random baseline draws as DT-FM's random_scheduler.py does (5000 shuffles of all devices,
consecutive blocks as stages in order, replica j paired with replica j) and shows the mean it prints next to
the median. Our DtfmCost matches DT-FM's published code to rounding on every grid we compared. With the sizes
DT-FM's scheduler code computes (activation 0.47125 GB, gradient 0.65 GB per stage, package data since the
scenarios file carried them) its quoted figures (DTFM_PUBLISHED) are reproducible: the datacenter optimum
is 3.440 s, and the random medians are 19.80 / 49.50 s for the datacenter and spot.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field, replace

import numpy as np

from swarm.flags import Flags, flag
from swarm.report import emit
from swarm.scheduler.baselines import baseline_shape, full_distance, greedy_layout, random_layouts
from swarm.scheduler.cost import DtfmCost, FullCost
from swarm.scheduler.localsearch import AnnealConfig
from swarm.scheduler.plans import ModelSpec, TransformerShape
from swarm.scheduler.scenarios import load_scenario, synthetic_worldwide
from swarm.scheduler.search import SearchConfig, search_dtfm, search_full

SCENARIOS = ("datacenter", "spot", "multi-universities", "regional", "worldwide")
# DT-FM's search as quoted in issue #5 (best, random median, solve seconds), from its published code
# (population 100, 4900 trials), under the sizes that code uses (see the module docstring).
DTFM_PUBLISHED = {
    "datacenter": (3.440, 19.80, 317.0),
    "spot": (43.547, 49.50, 401.0),
    "multi-universities": (16.087, 36.74, 308.0),
    "regional": (34.802, 55.00, 389.0),
    "worldwide": (49.218, 92.02, 319.0),
}
DTFM_RANDOM_DRAWS = 5000  # population of DT-FM's random_scheduler.py
COLUMNS = [
    "scenario",
    "peers",
    "cost_model",
    "ours_s",
    "random_s",
    "random_mean_s",
    "greedy_s",
    "solve_s",
    "shape",
    "vs_random",
    "vs_greedy",
    "dtfm_best_s",
    "dtfm_solve_s",
]


@dataclass(frozen=True)
class SchedulerBench:
    """`swarm bench scheduler`: our plans against random and greedy ones on DT-FM's scenarios."""

    seed: int = 0
    """seed of the search and of the random baselines"""
    random: int = 100
    """random assignments per full row; the median is shown"""
    dtfm_random: int = field(
        default=DTFM_RANDOM_DRAWS,
        metadata=flag(
            help=f"random grids per dtfm row, DT-FM's random scheduler draws {DTFM_RANDOM_DRAWS}; median and mean shown"
        ),
    )
    sizes: str = "256,1000"
    """peers of the synthetic worldwide swarms, comma-separated"""
    moves: int = 2000
    """annealing moves per refined candidate"""
    only: str | None = field(default=None, metadata=flag(choices=("dtfm", "full")))
    """run only the rows of one cost model (none: both)"""
    quick: bool = False
    """small budgets and one 128-peer swarm: a smoke test"""
    json: bool = False
    """print rows as JSON instead of a table"""


_FLAGS = Flags(SchedulerBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def _row(scenario: str, peers: int, cost_model: str, ours: float, randoms: list[float], greedy: float, solve: float):
    random_median = statistics.median(randoms)
    return {
        "scenario": scenario,
        "peers": peers,
        "cost_model": cost_model,
        "ours_s": round(ours, 4),
        "random_s": round(random_median, 4),
        "greedy_s": round(greedy, 4),
        "solve_s": round(solve, 2),
        "vs_random": round(random_median / ours, 2),
        "vs_greedy": round(greedy / ours, 2),
    }


def dtfm_row(name: str, cfg: SearchConfig, random_count: int) -> dict:
    """One scenario under DT-FM's cost model and grid."""
    scenario = load_scenario(name)
    stages, replicas = scenario.stages, scenario.replicas
    cost = DtfmCost(scenario.plan_input, scenario.activation_bytes, scenario.gradient_bytes, replicas)
    result = search_dtfm(cost, stages, replicas, cfg)
    n = scenario.plan_input.n_peers
    randoms = [
        cost.evaluate(layout).total_s for layout in random_layouts(n, stages, replicas, stages, random_count, cfg.seed)
    ]
    greedy = cost.evaluate(greedy_layout(cost.link_s, np.zeros(n), stages, replicas, stages)).total_s
    row = _row(name, n, "dtfm", result.breakdown.total_s, randoms, greedy, result.solve_s)
    best, _, solve = DTFM_PUBLISHED[name]
    row.update(
        shape=f"{stages}x{replicas}",
        random_mean_s=round(statistics.fmean(randoms), 4),
        dtfm_best_s=best,
        dtfm_solve_s=solve,
    )
    return row


def full_row(name: str, plan_input, model: ModelSpec, cfg: SearchConfig, random_count: int) -> dict:
    """One swarm under our cost model: our free plan against random and greedy on the even split."""
    cost = FullCost(plan_input, model)
    result = search_full(cost, plan_input, cfg)
    stages, replicas = baseline_shape(plan_input, model)
    n = plan_input.n_peers
    randoms = [
        cost.evaluate(layout).total_s
        for layout in random_layouts(n, stages, replicas, model.layers, random_count, cfg.seed)
    ]
    greedy = greedy_layout(full_distance(cost, replicas), plan_input.speeds_flops_per_s, stages, replicas, model.layers)
    row = _row(name, n, "full", result.breakdown.total_s, randoms, cost.evaluate(greedy).total_s, result.solve_s)
    row["shape"] = f"{result.layout.stages}x{result.layout.replicas} (baseline {stages}x{replicas})"
    return row


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    cfg = SearchConfig(seed=bench.seed, anneal=AnnealConfig(moves=bench.moves))
    if bench.quick:
        cfg = replace(cfg, chains=2, anneal=AnnealConfig(moves=200))
    random_count = min(bench.random, 20) if bench.quick else bench.random
    dtfm_random = min(bench.dtfm_random, 100) if bench.quick else bench.dtfm_random
    sizes = [128] if bench.quick else [int(x) for x in bench.sizes.split(",") if x]
    model = ModelSpec.transformer(TransformerShape())
    rows = []
    for name in SCENARIOS:
        if bench.only in (None, "dtfm"):
            rows.append(dtfm_row(name, cfg, dtfm_random))
        if bench.only in (None, "full"):
            rows.append(full_row(name, load_scenario(name).plan_input, model, cfg, random_count))
    if bench.only in (None, "full"):
        for size in sizes:
            swarm = synthetic_worldwide(size, seed=bench.seed)
            rows.append(full_row(f"synthetic-{size}", swarm, model, cfg, random_count))
    emit(rows, COLUMNS, bench.json, title="scheduler: predicted step time (s) of our plan, random (median), greedy")
    return 0
