"""`swarm plan`'s flags, and its plans for a DT-FM scenario or a JSON file.

Reads the swarm into a `PlanInput`, runs the planner and prints the plan (or its JSON). The same code path
serves simulations and live swarms: only where the `PlanInput` comes from differs (`--dht`, the live swarm's
announcements and link probes, is read by `swarm.daemon.live_plan`, the command's entry point).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, fields, replace

import numpy as np

from swarm.flags import Flags, flag
from swarm.scheduler.cost import FullCost
from swarm.scheduler.localsearch import AnnealConfig
from swarm.scheduler.plans import ModelSpec, Plan, PlanInput, TransformerShape
from swarm.scheduler.scenarios import GB, SCENARIO_NAMES, load_scenario, scenario_data
from swarm.scheduler.search import SearchConfig, plan, plan_dtfm, plan_layout

__all__ = [
    "PLAN_FLAGS",
    "PlanCommand",
    "PlanSource",
    "ShapeFlags",
    "add_arguments",
    "describe",
    "describe_per_link",
    "per_link_plan",
    "run",
]

_PEERS_SHOWN = 6  # replicas listed per stage before eliding


_SOURCE = "where the swarm comes from (one of)"
_SHAPE = TransformerShape()


@dataclass(frozen=True)
class PlanSource:
    """Where `swarm plan` reads the swarm from: exactly one of a scenario, an input file and the live DHT."""

    scenario: str | None = field(
        default=None,
        metadata=flag(help=f"one of DT-FM's simulated swarms: {', '.join(SCENARIO_NAMES)} (or its index 0-5)"),
    )
    input: str | None = field(default=None, metadata=flag(metavar="FILE.json"))
    """peers (peer_id, compute_flops_per_s, memory_bytes), delay_s (or delay_ms) and bandwidth_bytes_per_s (or
    bandwidth_gbps) matrices; see --save-input for an example"""
    dht: tuple[str, ...] = field(default=(), metadata=flag(nargs="+", metavar="MADDR"))
    """read the live swarm (announcements and link probes) through these DHT nodes, as `swarm bootstrap` prints
    them; shows the published plan and the one the planner would make now (the model flags then default to the
    swarm's default model and codecs)"""
    dht_address_file: str | None = field(default=None, metadata=flag(metavar="FILE"))
    """like --dht, the addresses from this file"""
    run_name: str = "swarm"
    """the live swarm's run name"""

    @property
    def live(self) -> bool:
        return bool(self.dht or self.dht_address_file)

    def check(self) -> None:
        """Exits unless exactly one of --scenario, --input and --dht (or --dht-address-file) names the swarm."""
        if len([x for x in (self.scenario, self.input, self.live) if x]) != 1:
            raise SystemExit("swarm plan: give exactly one of --scenario, --input or --dht")


def _unset(text: str, name: str) -> dict:
    """The flag of a `ShapeFlags` field: its help names `TransformerShape()`'s value, the first default."""
    return flag(help=f"{text} (none: {getattr(_SHAPE, name):g}; with --dht, the live swarm's)")


@dataclass(frozen=True)
class ShapeFlags:
    """The full cost model's model: a `TransformerShape` whose unset fields take a default shape's (a scenario's
    or file's: `TransformerShape()`; the live swarm's: its default model and codecs)."""

    layers: int | None = field(default=None, metadata=_unset("transformer layers", "layers"))
    hidden: int | None = field(default=None, metadata=_unset("hidden size", "hidden"))
    seq_len: int | None = field(default=None, metadata=_unset("tokens per sample", "seq_len"))
    micro_batch_size: int | None = field(default=None, metadata=_unset("samples per micro-batch", "micro_batch_size"))
    micro_batches: int | None = field(
        default=None, metadata=_unset("micro-batches per step over all replicas", "micro_batches")
    )
    forward_bits: float | None = field(
        default=None, metadata=_unset("bits per activation element on the wire, forward (AQ-SGD)", "forward_bits")
    )
    backward_bits: float | None = field(
        default=None, metadata=_unset("bits per activation-gradient element on the wire, backward", "backward_bits")
    )
    gradient_bits: float | None = field(
        default=None, metadata=_unset("bits per weight-gradient element averaged between replicas", "gradient_bits")
    )

    def shape(self, default: TransformerShape) -> TransformerShape:
        """`default` with the fields these flags set."""
        return replace(
            default, **{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        )


@dataclass(frozen=True)
class DtfmGrid:
    """DT-FM's cost model: its fixed grid and the sizes it prices."""

    stages: int = 8
    """stages of DT-FM's grid"""
    replicas: int = 8
    """replicas of DT-FM's grid"""
    activation_gb: float | None = None
    """activation size per step, GB (none: the scenario's, else DT-FM's 0.47125)"""
    gradient_gb: float | None = None
    """gradient size per stage in GB (none: the scenario's, else DT-FM's 0.65)"""


@dataclass(frozen=True)
class PlanCommand:
    """`swarm plan`: where the swarm comes from, the cost model and its model, and the search."""

    source: PlanSource = field(default_factory=PlanSource, metadata=flag(group=_SOURCE))
    cost_model: str = field(default="full", metadata=flag(choices=("full", "dtfm")))
    """full: ours (compute, compressed transfers, latency, micro-batch pacing, gradient averaging, memory; free
    stages and layer ranges); dtfm: DT-FM's data-parallel + 2 x pipeline cost on its fixed grid"""
    seed: int = 0
    """search seed: the same seed gives the same plan"""
    moves: int = 2000
    """annealing moves per refined candidate"""
    json: bool = False
    """print the plan as JSON (the form published in the DHT)"""
    save_input: str | None = field(default=None, metadata=flag(metavar="FILE.json"))
    """also write the swarm as a --input file"""
    per_link: bool = False
    """full cost model: choose each link's codec inside the search (the default codecs' ladder, fp32 down to the
    default floors, priced at their wire bits: swarm-peer's default per-link policy) and print each boundary's
    codecs, beside the step of placing at --forward-bits/--backward-bits first and choosing the codecs after"""
    model: ShapeFlags = field(default_factory=ShapeFlags, metadata=flag(group="model (full cost model)"))
    dtfm: DtfmGrid = field(default_factory=DtfmGrid, metadata=flag(group="DT-FM cost model"))


PLAN_FLAGS = Flags(PlanCommand)
"""`swarm plan`'s flags."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    PLAN_FLAGS.add_to(parser)


def _read_input(source: PlanSource) -> tuple[PlanInput, str, float | None, float | None]:
    if source.scenario:
        scenario = load_scenario(source.scenario)
        return scenario.plan_input, scenario.name, scenario.activation_bytes, scenario.gradient_bytes
    return PlanInput.load(source.input), source.input, None, None


def describe(result: Plan, plan_input: PlanInput, source: str) -> str:
    b = result.breakdown
    regions = {p.peer_id: p.region for p in plan_input.peers}
    used = result.n_stages * result.n_replicas
    lines = [
        f"plan for {source}: cost model {result.cost_model}, {result.n_stages} stages x {result.n_replicas} "
        f"replicas ({used} of {plan_input.n_peers} peers)",
        f"predicted step time {b.total_s:.3f} s",
    ]
    if result.cost_model == "full":
        steady = b.steady_s / b.pace_s if b.pace_s > 0 else 0
        lines.append(
            f"  compute {b.compute_s:.3f} s + transfer {b.transfer_s:.3f} s + latency {b.latency_s:.3f} s "
            f"+ steady {b.steady_s:.3f} s ({steady:.0f} x {b.pace_s * 1e3:.1f} ms) + sync {b.sync_s:.3f} s"
        )
    else:
        lines.append(f"  data-parallel {b.sync_s:.3f} s + 2 x pipeline {b.transfer_s:.3f} s")
    lines.append("stage  layers   replicas (peer, region)")
    for s, stage in enumerate(result.stages):
        shown = [f"{pid} ({regions[pid]})" if regions[pid] else pid for pid in stage.peer_ids[:_PEERS_SHOWN]]
        more = len(stage.peer_ids) - _PEERS_SHOWN
        tail = f" ... (+{more})" if more > 0 else ""
        lines.append(f"{s:>5}  {stage.layer_start:>2}-{stage.layer_end - 1:<4}  {', '.join(shown)}{tail}")
    if result.unused_peer_ids:
        lines.append(f"unused: {len(result.unused_peer_ids)} peers")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """A scenario's or an input file's plan (the live swarm's, `--dht`, is `swarm.daemon.live_plan`'s)."""
    cfg = PLAN_FLAGS.from_args(args)
    cfg.source.check()
    if cfg.source.live:
        raise SystemExit("swarm plan --dht: the live swarm is read by swarm.daemon.live_plan")
    shape = cfg.model.shape(TransformerShape())
    plan_input, source, activation_bytes, gradient_bytes = _read_input(cfg.source)
    if cfg.save_input:
        plan_input.save(cfg.save_input)
    search = SearchConfig(seed=cfg.seed, anneal=AnnealConfig(moves=cfg.moves))
    grid = cfg.dtfm
    if cfg.cost_model == "dtfm":
        if plan_input.n_peers != grid.stages * grid.replicas:
            print(
                f"swarm plan: DT-FM's grid needs stages x replicas = {grid.stages * grid.replicas} peers, "
                f"the swarm has {plan_input.n_peers}",
                file=sys.stderr,
            )
            return 2
        workload = scenario_data()["workload"]  # DT-FM's GPT-3 XL sizes unless the input or a flag says otherwise
        activation = grid.activation_gb * GB if grid.activation_gb is not None else activation_bytes or 0
        activation = activation or workload["activation_gb"] * GB
        gradient = grid.gradient_gb * GB if grid.gradient_gb is not None else gradient_bytes or 0
        gradient = gradient or workload["gradient_gb"] * GB
        result = plan_dtfm(plan_input, activation, gradient, grid.stages, grid.replicas, shape.layers, search)
    elif cfg.per_link:
        result, compared = per_link_plan(plan_input, shape, search)
        if cfg.json:
            print(json.dumps(result.to_dict() | {"per_link": compared}, indent=1))
        else:
            print(describe(result, plan_input, source))
            print(describe_per_link(compared))
        return 0
    else:
        result = plan(plan_input, ModelSpec.transformer(shape), search)
    if cfg.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(describe(result, plan_input, source))
    return 0


def per_link_plan(plan_input: PlanInput, shape: TransformerShape, search: SearchConfig) -> tuple[Plan, dict]:
    """The plan with each link's codec chosen inside the search (`bits.wire_bits_ladder`), and what it is against
    placing at the shape's bits first: that placement's step at its bits, and again with each of its links then
    given its quickest codec. Also each boundary's codecs (its slowest pair's, each way)."""
    from swarm.scheduler.bits import wire_bits_ladder  # torch, through the codecs: only when asked

    spec = ModelSpec.transformer(shape)
    ladder = replace(spec, link_ladder=wire_bits_ladder(spec.message_elements))
    inside = plan(plan_input, ladder, search)
    placed = plan(plan_input, spec, search)
    cost = FullCost(plan_input, ladder)
    after = cost.evaluate(plan_layout(placed, plan_input)).total_s
    layout = plan_layout(inside, plan_input)
    codecs = []
    for a, b in zip(layout.grid, layout.grid[1:], strict=False):
        worst = int(np.argmax(cost.pace_s[a, b]))
        p, q = int(a[worst]), int(b[worst])
        codecs.append(
            f"{ladder.link_ladder.forward[cost.forward_rung[p, q]].label}/"
            f"{ladder.link_ladder.backward[cost.backward_rung[p, q]].label}"
        )
    compared = {
        "inside_step_s": inside.step_time_s,
        "placed_step_s": placed.step_time_s,
        "after_step_s": after,
        "placed_bits": [shape.forward_bits, shape.backward_bits],
        "codecs": codecs,
    }
    return inside, compared


def describe_per_link(compared: dict) -> str:
    fw, bw = compared["placed_bits"]
    lines = [
        f"codecs chosen inside the search: {compared['inside_step_s']:.3f} s a step; placed at {fw:g}/{bw:g} bits "
        f"first: {compared['placed_step_s']:.3f} s, its links then at their quickest codecs: "
        f"{compared['after_step_s']:.3f} s",
        "boundary  codecs (forward/backward, its slowest pair's)",
    ]
    lines += [f"{b:>8}  {c}" for b, c in enumerate(compared["codecs"])]
    return "\n".join(lines)
