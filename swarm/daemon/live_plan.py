"""`swarm plan`: the scheduler's command (`swarm.scheduler.plan_cli`: a scenario or an input file) and, with `--dht`,
the live swarm's published plan beside the plan the live planner would make from it now."""

from __future__ import annotations

import argparse
import json
import sys

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.daemon.bootstrap import read_address_file
from swarm.daemon.planning import live_search, swarm_plan_input
from swarm.model.gpt import ModelConfig
from swarm.peers.dht import SwarmDHT
from swarm.peers.dht_config import DHTConfig
from swarm.scheduler import ModelSpec, Plan, TransformerShape, plan
from swarm.scheduler.plan_cli import PLAN_FLAGS, PlanCommand, add_arguments, describe
from swarm.scheduler.plan_cli import run as run_offline
from swarm.scheduler.sizes import REFERENCE_MICRO_BATCH, REFERENCE_MICRO_BATCHES, wire_bits

__all__ = ["add_arguments", "run", "run_live"]


def run(args: argparse.Namespace) -> int:
    cfg = PLAN_FLAGS.from_args(args)
    cfg.source.check()
    return run_live(cfg) if cfg.source.live else run_offline(args)


def run_live(cfg: PlanCommand) -> int:
    """The live swarm: its published plan, and the plan the live planner would make from it now."""
    model = ModelConfig()
    shape = cfg.model.shape(
        TransformerShape(
            layers=model.n_layers,
            hidden=model.hidden_dim,
            seq_len=model.seq_len_tokens,
            micro_batch_size=REFERENCE_MICRO_BATCH,
            micro_batches=REFERENCE_MICRO_BATCHES,
            forward_bits=wire_bits(CodecConfig.parse(DEFAULT_FORWARD_CODEC)),
            backward_bits=wire_bits(CodecConfig.parse(DEFAULT_BACKWARD_CODEC)),
        )
    )
    source = cfg.source
    initial = list(source.dht) + (read_address_file(source.dht_address_file) if source.dht_address_file else [])
    config = DHTConfig(initial_peers=tuple(initial), client_mode=True, run_name=source.run_name)
    with SwarmDHT(config) as dht:
        peers, links, published = dht.peers(), dht.links(), dht.get_plan(check_trainers=False)
    if not peers:
        print(f"swarm plan: no peers announced in run {source.run_name!r}", file=sys.stderr)
        return 2
    spec = ModelSpec.transformer(shape)
    swarm = swarm_plan_input(peers, links, spec)
    stages = published.document.n_stages if published is not None else None
    fresh = plan(swarm.plan_input, spec, live_search(stages, cfg.seed))
    if cfg.json:
        out = {
            "published": None if published is None else {**published.document.to_wire(), "version": published.version},
            "now": fresh.to_dict(),
            "peers": len(peers),
            "measured_links": swarm.measured_links,
            "assumed_links": swarm.filled_links,
        }
        print(json.dumps(out, indent=1))
        return 0
    where = f"live swarm {source.run_name!r}: {len(peers)} peers, {swarm.measured_links} links measured"
    if swarm.filled_links:
        where += f", {swarm.filled_links} assumed (not probed yet)"
    if published is not None:
        print(f"published plan (version {published.version}):")
        print(describe(Plan.from_document(published.document), swarm.plan_input, where))
        print()
    print("the plan the planner would make now:" if published is not None else "no plan published yet; now:")
    print(describe(fresh, swarm.plan_input, where))
    return 0
