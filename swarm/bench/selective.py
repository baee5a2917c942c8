"""`swarm bench selective`: which links Optimus-CC's selective compression compresses, and the predicted step.

One synthetic swarm (a GPT of 8 layers, hidden 1024, 256 tokens, micro-batches of 4, 8 a step, a tied 32000-word
embedding; 4 stages x 2 replicas of peers at 2 TFLOP/s; 10 ms one way) with every link at one rate per row, or
with `--replica-rate` the replicas' links at that rate (a stage's replicas in one building) and the boundaries
at the row's. For each row the per-link choice (`swarm.scheduler.bits`: boundaries by the hidden-under-compute
rule, the epilogue by the `epilogue_share` rule) and the cost model's predicted step (`FullCost`, with the
epilogue at its codecs' bytes: `swarm.scheduler.selective.selective_breakdown`) for three settings: everything
fp32, everything at the floors (the default codecs, 8-bit averaging, 4-bit tied sync), and selective.
Boundary message bytes are measured (`sizes.message_bytes` on the model's activation shape); epilogue bytes
are elements x the codec's wire bits.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from swarm.flags import Flags
from swarm.report import emit
from swarm.scheduler.bits import (
    BACKWARD_LADDER,
    FORWARD_LADDER,
    BitsPolicy,
    choose_codecs,
    choose_epilogue,
)
from swarm.scheduler.plans import ModelSpec, Peer, PlanInput, TransformerShape
from swarm.scheduler.selective import epilogue_figures, pipeline_step_s, selective_breakdown
from swarm.scheduler.selective_stages import widen_hidden

RATES_MBIT = (1.0, 10.0, 100.0, 1000.0, 10000.0)
SHAPE = TransformerShape(layers=8, hidden=1024, seq_len=256, micro_batch_size=4, micro_batches=8)
QUICK_SHAPE = TransformerShape(layers=4, hidden=256, seq_len=64, micro_batch_size=4, micro_batches=4)
VOCAB = 32000
COLUMNS = ["rate_mbit", "boundary", "average", "tied", "fp32_s", "compressed_s", "selective_s", "vs_fp32", "vs_comp"]


def _short(label: str | None) -> str:
    from swarm.compression import CodecConfig

    return "-" if label is None else CodecConfig.parse(label).label


def swarm_at(rate_mbit: float, replica_mbit: float | None, stages: int, replicas: int, flops: float) -> PlanInput:
    n = stages * replicas
    bandwidth = np.full((n, n), rate_mbit * 1e6 / 8)
    if replica_mbit is not None:
        for s in range(stages):
            row = np.arange(s * replicas, (s + 1) * replicas)
            bandwidth[np.ix_(row, row)] = replica_mbit * 1e6 / 8
    peers = tuple(Peer(f"p{i}", flops, 80e9) for i in range(n))
    return PlanInput(peers, np.full((n, n), 0.01), bandwidth)


def rows(
    rates_mbit=RATES_MBIT,
    replica_mbit: float | None = None,
    shape: TransformerShape = SHAPE,
    stages: int = 4,
    replicas: int = 2,
    flops: float = 2e12,
    policy: BitsPolicy | None = None,
) -> list[dict]:
    """One row per rate: the selective choice and the predicted step of fp32 / all-compressed / selective."""
    policy = policy or BitsPolicy()
    from swarm.compression import CodecConfig
    from swarm.daemon.codec_choice import link_figures
    from swarm.peers.plan import PlanStage
    from swarm.peers.plan_codecs import EpilogueCodecs
    from swarm.scheduler.sizes import message_bytes

    activation = (shape.micro_batch_size, shape.seq_len, shape.hidden)
    sizes = cache(lambda label: float(message_bytes(CodecConfig.parse(label), activation)))
    base = replace(ModelSpec.transformer(shape), full_duplex=True, tied_bytes=VOCAB * shape.hidden * 4 / 8)
    per = shape.layers // stages
    layout = [
        PlanStage(s * per, (s + 1) * per, tuple(f"p{s * replicas + r}" for r in range(replicas))) for s in range(stages)
    ]
    plan_stages = [stage.to_wire() for stage in layout]
    out = []
    for rate in rates_mbit:
        plan_input = swarm_at(rate, replica_mbit, stages, replicas, flops)

        def step(forward: str, backward: str, average: str, tied: str, plan_input: PlanInput = plan_input) -> float:
            spec = replace(base, forward_bytes=sizes(forward), backward_bytes=sizes(backward))
            chosen = EpilogueCodecs((average,) * stages, tied)
            return selective_breakdown(plan_stages, plan_input, spec, chosen).total_s

        step_s = pipeline_step_s(plan_stages, plan_input, base)
        bounds = choose_codecs(link_figures(layout, plan_input, base), sizes, policy, step_s)
        forward = max((b.forward_label for b in bounds), key=FORWARD_LADDER.index)  # uniform rates: one choice; else
        backward = max((b.backward_label for b in bounds), key=BACKWARD_LADDER.index)  # the narrowest, for one spec
        spec = replace(base, forward_bytes=sizes(forward), backward_bytes=sizes(backward))
        figures = epilogue_figures(plan_stages, plan_input, spec)
        chosen = widen_hidden(choose_epilogue(*figures, policy), *figures)  # as the planner: `choose_for_plan`
        fp32 = step("fp32", "fp32", "fp32", "fp32")
        compressed = step(policy.forward_floor, policy.backward_floor, policy.average_floor, policy.tied_floor)
        selective = selective_breakdown(plan_stages, plan_input, spec, chosen).total_s
        out.append(
            {
                "rate_mbit": rate,
                "replica_rate_mbit": replica_mbit if replica_mbit is not None else rate,
                "boundary": f"{_short(forward)}/{_short(backward)}",
                "average": ",".join(_short(a) for a in chosen.average_labels),
                "tied": _short(chosen.tied_label),
                "fp32_s": round(fp32, 4),
                "compressed_s": round(compressed, 4),
                "selective_s": round(selective, 4),
                "vs_fp32": round(fp32 / selective, 3),
                "vs_comp": round(compressed / selective, 3),
            }
        )
    return out


@dataclass(frozen=True)
class SelectiveBench:
    """`swarm bench selective`: which links selective compression compresses, per link rate."""

    rates: str = ",".join(f"{r:g}" for r in RATES_MBIT)
    """link rates, Mbit/s"""
    replica_rate: float | None = None
    """the replicas' links at this rate, Mbit/s"""
    quick: bool = False
    """a small model (figures in well under a second)"""
    json: bool = False
    """print the rows as JSON"""


_FLAGS = Flags(SelectiveBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    rates = tuple(float(r) for r in bench.rates.split(",") if r.strip())
    table = rows(rates, bench.replica_rate, QUICK_SHAPE if bench.quick else SHAPE)
    emit(table, COLUMNS, bench.json, "selective compression: predicted step (s) per link rate")
    return 0
