"""`swarm plan`'s flags, and its plans for a DT-FM scenario or a JSON file.

Reads the swarm into a `PlanInput`, runs the planner and prints the plan (or its JSON). The same code path
serves simulations and live swarms: only where the `PlanInput` comes from differs (`--dht`, the live swarm's
announcements and link probes, is read by `swarm.daemon.live_plan`, the command's entry point).
"""

from __future__ import annotations

import argparse
import json
import sys

from swarm.scheduler.localsearch import AnnealConfig
from swarm.scheduler.plans import ModelSpec, Plan, PlanInput, TransformerShape
from swarm.scheduler.scenarios import GB, SCENARIO_NAMES, load_scenario, scenario_data
from swarm.scheduler.search import SearchConfig, plan, plan_dtfm

__all__ = ["add_arguments", "check_source", "describe", "fill_model_defaults", "model_of", "run"]

_PEERS_SHOWN = 6  # replicas listed per stage before eliding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("where the swarm comes from (one of)")
    source.add_argument(
        "--scenario",
        help=f"one of DT-FM's simulated swarms: {', '.join(SCENARIO_NAMES)} (or its index 0-5)",
    )
    source.add_argument(
        "--input",
        metavar="FILE.json",
        help="peers (peer_id, compute_flops_per_s, memory_bytes), delay_s (or delay_ms) and "
        "bandwidth_bytes_per_s (or bandwidth_gbps) matrices; see --save-input for an example",
    )
    source.add_argument(
        "--dht",
        nargs="+",
        metavar="MADDR",
        help="read the live swarm (announcements and link probes) through these DHT nodes, as `swarm bootstrap` "
        "prints them; shows the published plan and the one the planner would make now (the model flags "
        "then default to the swarm's default model and codecs)",
    )
    source.add_argument("--dht-address-file", metavar="FILE", help="like --dht, the addresses from this file")
    source.add_argument("--run-name", default="swarm", help="the live swarm's run name (default 'swarm')")
    parser.add_argument(
        "--cost-model",
        choices=("full", "dtfm"),
        default="full",
        help="full: ours (compute, compressed transfers, latency, micro-batch pacing, gradient averaging, "
        "memory; free stages and layer ranges); dtfm: DT-FM's data-parallel + 2 x pipeline cost on its "
        "fixed grid (default: full)",
    )
    parser.add_argument("--seed", type=int, default=0, help="search seed: the same seed gives the same plan")
    parser.add_argument("--moves", type=int, default=2000, help="annealing moves per refined candidate (default 2000)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (the form published in the DHT)")
    parser.add_argument("--save-input", metavar="FILE.json", help="also write the swarm as a --input file")
    model = parser.add_argument_group("model (full cost model)")
    shape = TransformerShape()
    model.add_argument("--layers", type=int, default=None, help=f"transformer layers (default {shape.layers})")
    model.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {shape.hidden})")
    model.add_argument("--seq-len", type=int, default=None, help=f"tokens per sample (default {shape.seq_len})")
    model.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help=f"samples per micro-batch (default {shape.micro_batch_size})",
    )
    model.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help=f"micro-batches per step over all replicas (default {shape.micro_batches})",
    )
    model.add_argument(
        "--forward-bits",
        type=float,
        default=None,
        help=f"bits per activation element on the wire, forward (default {shape.forward_bits:g}, AQ-SGD)",
    )
    model.add_argument(
        "--backward-bits",
        type=float,
        default=None,
        help=f"bits per activation-gradient element on the wire, backward (default {shape.backward_bits:g})",
    )
    model.add_argument(
        "--gradient-bits",
        type=float,
        default=None,
        help=f"bits per weight-gradient element averaged between replicas (default {shape.gradient_bits:g})",
    )
    dtfm = parser.add_argument_group("DT-FM cost model")
    dtfm.add_argument("--stages", type=int, default=8, help="stages of DT-FM's grid (default 8)")
    dtfm.add_argument("--replicas", type=int, default=8, help="replicas of DT-FM's grid (default 8)")
    dtfm.add_argument(
        "--activation-gb",
        type=float,
        help="activation size per step, GB (default: the scenario's, else DT-FM's 0.47125)",
    )
    dtfm.add_argument(
        "--gradient-gb", type=float, help="gradient size per stage in GB (default: the scenario's, else DT-FM's 0.65)"
    )


def _read_input(args) -> tuple[PlanInput, str, float | None, float | None]:
    chosen = [x for x in (args.scenario, args.input, args.dht or args.dht_address_file) if x]
    if len(chosen) != 1:
        raise SystemExit("swarm plan: give exactly one of --scenario, --input or --dht")
    if args.scenario:
        scenario = load_scenario(args.scenario)
        return scenario.plan_input, scenario.name, scenario.activation_bytes, scenario.gradient_bytes
    return PlanInput.load(args.input), args.input, None, None


def model_of(args) -> ModelSpec:
    return ModelSpec.transformer(
        TransformerShape(
            layers=args.layers,
            hidden=args.hidden,
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            micro_batches=args.micro_batches,
            forward_bits=args.forward_bits,
            backward_bits=args.backward_bits,
            gradient_bits=args.gradient_bits,
        )
    )


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


def check_source(args: argparse.Namespace) -> None:
    """Exits unless exactly one of --scenario, --input and --dht (or --dht-address-file) names the swarm."""
    if len([x for x in (args.scenario, args.input, args.dht or args.dht_address_file) if x]) != 1:
        raise SystemExit("swarm plan: give exactly one of --scenario, --input or --dht")


def run(args: argparse.Namespace) -> int:
    """A scenario's or an input file's plan (the live swarm's, `--dht`, is `swarm.daemon.live_plan`'s)."""
    check_source(args)
    if args.dht or args.dht_address_file:
        raise SystemExit("swarm plan --dht: the live swarm is read by swarm.daemon.live_plan")
    fill_model_defaults(args, TransformerShape())
    plan_input, source, activation_bytes, gradient_bytes = _read_input(args)
    if args.save_input:
        plan_input.save(args.save_input)
    cfg = SearchConfig(seed=args.seed, anneal=AnnealConfig(moves=args.moves))
    if args.cost_model == "dtfm":
        if plan_input.n_peers != args.stages * args.replicas:
            print(
                f"swarm plan: DT-FM's grid needs stages x replicas = {args.stages * args.replicas} peers, "
                f"the swarm has {plan_input.n_peers}",
                file=sys.stderr,
            )
            return 2
        workload = scenario_data()["workload"]  # DT-FM's GPT-3 XL sizes unless the input or a flag says otherwise
        activation = args.activation_gb * GB if args.activation_gb is not None else activation_bytes or 0
        activation = activation or workload["activation_gb"] * GB
        gradient = args.gradient_gb * GB if args.gradient_gb is not None else gradient_bytes or 0
        gradient = gradient or workload["gradient_gb"] * GB
        result = plan_dtfm(plan_input, activation, gradient, args.stages, args.replicas, args.layers, cfg)
    else:
        result = plan(plan_input, model_of(args), cfg)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(describe(result, plan_input, source))
    return 0


def fill_model_defaults(args, shape: TransformerShape) -> None:
    """The model flags left unset take `shape`'s values."""
    for name in ("layers", "hidden", "seq_len", "micro_batch_size", "micro_batches"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(shape, name))
    for name in ("forward_bits", "backward_bits", "gradient_bits"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(shape, name))
