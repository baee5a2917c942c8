"""`swarm plan`: the scheduler's command (`swarm.scheduler.cli`: a scenario or an input file) and, with `--dht`,
the live swarm's published plan beside the plan the live planner would make from it now."""

from __future__ import annotations

import argparse
import json
import sys

from swarm.compression import DEFAULT_BW_CODEC, DEFAULT_FW_CODEC, CodecConfig
from swarm.daemon.bootstrap import read_address_file
from swarm.daemon.planning import live_search, swarm_plan_input
from swarm.model.gpt import ModelConfig
from swarm.peers.dht import DHTConfig, SwarmDHT
from swarm.scheduler import Plan, TransformerShape, plan
from swarm.scheduler.cli import add_arguments, check_source, describe, fill_model_defaults, model_of
from swarm.scheduler.cli import run as run_offline
from swarm.scheduler.sizes import REFERENCE_MICRO_BATCH, REFERENCE_MICRO_BATCHES, wire_bits

__all__ = ["add_arguments", "run", "run_live"]


def run(args: argparse.Namespace) -> int:
    check_source(args)
    return run_live(args) if args.dht or args.dht_address_file else run_offline(args)


def run_live(args: argparse.Namespace) -> int:
    """The live swarm: its published plan, and the plan the live planner would make from it now."""
    model = ModelConfig()
    fill_model_defaults(
        args,
        TransformerShape(
            layers=model.n_layers,
            hidden=model.hidden_dim,
            seq_len=model.seq_len_tokens,
            micro_batch_size=REFERENCE_MICRO_BATCH,
            micro_batches=REFERENCE_MICRO_BATCHES,
            forward_bits=wire_bits(CodecConfig.parse(DEFAULT_FW_CODEC)),
            backward_bits=wire_bits(CodecConfig.parse(DEFAULT_BW_CODEC)),
        ),
    )
    initial = list(args.dht or []) + (read_address_file(args.dht_address_file) if args.dht_address_file else [])
    config = DHTConfig(initial_peers=tuple(initial), client_mode=True, run_name=args.run_name)
    with SwarmDHT(config) as dht:
        peers, links, published = dht.peers(), dht.links(), dht.get_plan(check_trainers=False)
    if not peers:
        print(f"swarm plan: no peers announced in run {args.run_name!r}", file=sys.stderr)
        return 2
    swarm = swarm_plan_input(peers, links, model_of(args))
    stages = published.document.n_stages if published is not None else None
    fresh = plan(swarm.plan_input, model_of(args), live_search(stages, args.seed))
    if args.json:
        out = {
            "published": None if published is None else {**published.document.to_wire(), "version": published.version},
            "now": fresh.to_dict(),
            "peers": len(peers),
            "measured_links": swarm.measured_links,
            "assumed_links": swarm.filled_links,
        }
        print(json.dumps(out, indent=1))
        return 0
    source = f"live swarm {args.run_name!r}: {len(peers)} peers, {swarm.measured_links} links measured"
    if swarm.filled_links:
        source += f", {swarm.filled_links} assumed (not probed yet)"
    if published is not None:
        print(f"published plan (version {published.version}):")
        print(describe(Plan.from_document(published.document), swarm.plan_input, source))
        print()
    print("the plan the planner would make now:" if published is not None else "no plan published yet; now:")
    print(describe(fresh, swarm.plan_input, source))
    return 0
