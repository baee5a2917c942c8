"""The convergence experiment's selective-compression setting, `sel:RATES[:LAYERS_PER_S]`.

`sel:10` trains with the codecs the live planner would choose (`swarm.scheduler.bits` through
`swarm.scheduler.selective`, the same functions) for a swarm of one peer per stage whose links all run at 10 Mbit/s;
`sel:1000+10` gives boundary 0 1000 Mbit/s and boundary 1 10 (one rate per boundary; the tied sync's link between
the end stages, and any other pair, runs at the slowest). Every peer computes LAYERS_PER_S layers a second of one
micro-batch (default `SEL_LAYERS_PER_S`, declared rather than measured, so the choice is the same on every
machine). The boundaries get `choose_codecs` (hidden under compute and within their fill share), the tied sync
`choose_epilogue`; the setting's row then compares with fp32 and the all-compressed setting on the same seed.
"""

from __future__ import annotations

import logging

import numpy as np

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.peers.plan import PlanDocument, PlanStage

__all__ = ["SEL_LAYERS_PER_S", "apply_selective", "selective_plan", "setting_codecs"]

log = logging.getLogger(__name__)

SEL_LAYERS_PER_S = 40.0
"""Layers a second (forward + backward of one micro-batch) each peer of a `sel:` setting is planned at."""


def _parse(text: str, n_stages: int) -> tuple[list[float], float]:
    body = text.removeprefix("sel:")
    rates_text, _, speed_text = body.partition(":")
    rates = [float(r) for r in rates_text.split("+") if r.strip()]
    speed = float(speed_text) if speed_text else SEL_LAYERS_PER_S
    if not rates or len(rates) not in (1, n_stages - 1) or not all(np.isfinite(rates)) or min(rates) <= 0:
        raise ValueError(f"setting {text!r}: sel:RATE[+RATE per boundary][:LAYERS_PER_S], rates in Mbit/s > 0")
    if not np.isfinite(speed) or speed <= 0:
        raise ValueError(f"setting {text!r}: layers/s must be > 0")
    return (rates * (n_stages - 1) if len(rates) == 1 else rates), speed


def selective_plan(text: str, model, n_stages: int, micro_batch_size: int, micro_batches: int) -> PlanDocument:
    """The plan (stages, link codecs, epilogue codecs) chosen for the `sel:` setting `text`."""
    from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
    from swarm.daemon.planning import link_figures
    from swarm.scheduler.bits import BitsPolicy, choose_codecs, codec_sizes
    from swarm.scheduler.plans import Peer, PlanInput
    from swarm.scheduler.selective import choose_for_plan, pipeline_step_s
    from swarm.scheduler.sizes import model_spec

    if n_stages < 2:
        raise ValueError(f"setting {text!r}: selective compression needs 2+ stages")
    rates, speed = _parse(text, n_stages)
    spec = model_spec(
        model,
        CodecConfig.parse(DEFAULT_FORWARD_CODEC),
        CodecConfig.parse(DEFAULT_BACKWARD_CODEC),
        micro_batch_size,
        micro_batches,
    )
    bandwidth = np.full((n_stages, n_stages), min(rates) * 1e6 / 8)
    for b, rate in enumerate(rates):
        bandwidth[b, b + 1] = bandwidth[b + 1, b] = rate * 1e6 / 8
    peers = tuple(Peer(f"s{s}", speed * spec.flops_per_layer, 1e12) for s in range(n_stages))
    plan_input = PlanInput(peers, np.zeros((n_stages, n_stages)), bandwidth)
    bounds = np.linspace(0, model.n_layers, n_stages + 1).round().astype(int)
    plan = PlanDocument(tuple(PlanStage(int(bounds[s]), int(bounds[s + 1]), (f"s{s}",)) for s in range(n_stages)))
    stages, policy = plan.stage_dicts(), BitsPolicy()
    step_s = pipeline_step_s(stages, plan_input, spec)
    sizes = codec_sizes(model, micro_batch_size)
    codecs = choose_codecs(link_figures(plan.stages, plan_input, spec), sizes, policy, step_s)
    epilogue, _, breakdown = choose_for_plan(stages, plan_input, spec, policy)
    plan = plan.with_link_codecs(codecs).with_epilogue(epilogue)
    for b, c in enumerate(plan.codecs):
        log.info("%s boundary %d: %s", text, b, c.why)
    log.info("%s epilogue: %s; predicted step %.3f s", text, plan.epilogue.why, breakdown.total_s)
    return plan


def apply_selective(pipe, plan: PlanDocument, forward_defaults: dict, backward_defaults: dict) -> None:
    """Every host of `pipe` (a `LocalPipeline`) takes its boundary ends and epilogue codecs from `plan`, as a peer
    does (`PlanDocument.link_labels`, `epilogue_configs`); each label parsed with the experiment's codec defaults
    (group sizes, rounding, zstd level) unless it says otherwise, as the fixed settings' codecs are."""
    from dataclasses import replace

    from swarm.runtime.boundary import LinkEnds

    for row in pipe.replica_hosts:
        for host in row:
            stage = host.role.stage
            labels = plan.link_labels(stage, (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC))
            forward_send, backward_send, forward_recv, backward_recv = (
                CodecConfig.parse(label, **(forward_defaults if i % 2 == 0 else backward_defaults))
                for i, label in enumerate(labels)
            )
            links = LinkEnds(
                forward_send,
                backward_send,
                pipe.shaping,
                adaptive_zstd=pipe.adaptive_zstd,
                recv=(forward_recv, backward_recv),
            )
            host.apply(replace(host.assignment, links=links, epilogue=plan.epilogue_configs(stage)))


def setting_codecs(
    plan: PlanDocument, forward_defaults: dict, backward_defaults: dict
) -> tuple[CodecConfig, CodecConfig]:
    """Boundary 0's (forward, backward) configs: what a `sel:` setting's row names."""
    first = plan.codecs[0]
    forward = CodecConfig.parse(first.forward_label, **forward_defaults)
    return forward, CodecConfig.parse(first.backward_label, **backward_defaults)


def apply_epilogue_only(pipe, epilogue) -> None:
    """Every host of `pipe` (a `LocalPipeline`, between steps) sends its backward messages with epilogue-only
    compression (`swarm.runtime.boundary.EpilogueOnly`; None: every message at the backward codec), on fresh ends
    of the codecs it has."""
    from dataclasses import replace

    for row in pipe.replica_hosts:
        for host in row:
            host.apply(replace(host.assignment, links=host.links.with_epilogue(epilogue)))
