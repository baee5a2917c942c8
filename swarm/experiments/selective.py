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
import math

import numpy as np

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.peers.plan import PlanDocument, PlanStage

__all__ = [
    "EPILOGUE_SUFFIX",
    "SEL_LAYERS_PER_S",
    "apply_epilogue_only",
    "apply_selective",
    "epilogue_tail_only",
    "measure_stage_times",
    "plan_epilogue_only",
    "selective_plan",
    "setting_codecs",
    "split_epilogue",
    "split_epilogue_tail",
    "split_selective",
    "SELECTIVE_SUFFIX",
]

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


def selective_plan(
    text: str,
    model,
    n_stages: int,
    micro_batch_size: int,
    micro_batches: int,
    replicas: int = 1,
    links: bool = True,
    codec_speed=None,
) -> PlanDocument:
    """The plan (stages, link codecs, epilogue codecs) chosen for the `sel:` setting `text`, with `replicas` peers
    per stage (the convergence experiment's `--replicas`): each stage's replicas sum over links at the slowest
    rate, so selective stage compression widens the sums the epilogue hides and keeps the others compressed.
    `links` False: the epilogue's codecs only, as `--codec-policy selective` plans (the `FW/BW@selRATE` settings);
    `codec_speed`: the codecs' measured speed the epilogue is chosen with (`swarm.scheduler.bits.CodecSpeed`)."""
    from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
    from swarm.daemon.codec_choice import link_figures
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
    if replicas < 1:
        raise ValueError(f"setting {text!r}: replicas must be >= 1, got {replicas}")
    ids = [[f"s{s}" if replicas == 1 else f"s{s}r{r}" for r in range(replicas)] for s in range(n_stages)]
    stage_of = np.repeat(np.arange(n_stages), replicas)
    n = len(stage_of)
    # a boundary's replica pairs run at that boundary's rate; any other pair (replicas of one stage too) the slowest
    boundary = np.minimum.outer(stage_of, stage_of)
    adjacent = np.abs(np.subtract.outer(stage_of, stage_of)) == 1
    rate = np.asarray([*rates, min(rates)])[np.where(adjacent, boundary, n_stages - 1)]
    bandwidth = rate * 1e6 / 8
    peers = tuple(Peer(pid, speed * spec.flops_per_layer, 1e12) for group in ids for pid in group)
    plan_input = PlanInput(peers, np.zeros((n, n)), bandwidth)
    bounds = np.linspace(0, model.n_layers, n_stages + 1).round().astype(int)
    plan = PlanDocument(tuple(PlanStage(int(bounds[s]), int(bounds[s + 1]), tuple(ids[s])) for s in range(n_stages)))
    stages, policy = plan.stage_dicts(), BitsPolicy()
    step_s = pipeline_step_s(stages, plan_input, spec)
    sizes = codec_sizes(model, micro_batch_size)
    epilogue, _, breakdown = choose_for_plan(stages, plan_input, spec, policy, codec_speed)
    plan = plan.with_epilogue(epilogue)
    if links:
        plan = plan.with_link_codecs(choose_codecs(link_figures(plan.stages, plan_input, spec), sizes, policy, step_s))
    for b, c in enumerate(plan.codecs or ()):
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
            if not plan.codecs:  # an epilogue-only choice (`FW/BW@selRATE`): the setting's own links stay
                host.apply(replace(host.assignment, epilogue=plan.epilogue_configs(stage)))
                continue
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


EPILOGUE_SUFFIX = "@epi"
"""A `FW/BW@epi` setting: epilogue-only compression, the exposed backward messages chosen by the planner."""
UNSHAPED_PLAN_MBIT = 1000.0
"""The rate an unshaped (loopback) link is planned at."""


SELECTIVE_SUFFIX = "@sel"
"""`FW/BW@sel`: Optimus-CC's selective stage compression alone, the links at FW/BW and the replicas' sums' and tied
sync's codecs chosen by the planner (`--codec-policy selective`); the convergence experiment's form names the rate
its sums are planned at, `FW/BW@selRATE` (Mbit/s), the throttled experiment's none (its links are measured)."""


def split_selective(setting: str) -> tuple[str, float | None]:
    """`FW/BW@selRATE` -> (`FW/BW`, RATE in Mbit/s); (setting, None) without the suffix."""
    head, sep, tail = setting.rpartition(SELECTIVE_SUFFIX)
    if not sep or "@" in tail or "/" in tail:
        return setting, None
    try:
        rate = float(tail)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"setting {setting!r}: @selRATE takes the sums' link rate in Mbit/s > 0 (e.g. @sel1000), last")
    return head, rate


def split_epilogue_tail(setting: str) -> tuple[str, int | None]:
    """`FW/BW@epiK` -> (`FW/BW`, K): the convergence experiment's epilogue-only setting, the last K backward
    messages of every boundary compressed and the others in fp32 (K = 1: the drain, what the planner leaves
    compressed where the last stage is the slowest); (setting, None) without the suffix."""
    head, sep, tail = setting.rpartition(EPILOGUE_SUFFIX)
    if not sep or "@" in tail or "/" in tail:
        return setting, None
    if not tail.isdigit():
        raise ValueError(f"setting {setting!r}: @epiK takes K, the compressed messages per boundary (e.g. @epi1), last")
    return head, int(tail)


def epilogue_tail_only(n_stages: int, tail: int, precise: CodecConfig):
    """`EpilogueOnly` at `precise` with the last `tail` backward messages of every boundary compressed."""
    from swarm.runtime.boundary import EpilogueOnly
    from swarm.runtime.epilogue import EpiloguePlan

    return EpilogueOnly(precise, EpiloguePlan((tail,) * (n_stages - 1)))


def split_epilogue(setting: str) -> tuple[str, bool]:
    """(`FW/BW`, whether the setting asks for epilogue-only compression)."""
    if setting.endswith(EPILOGUE_SUFFIX):
        return setting.removesuffix(EPILOGUE_SUFFIX), True
    return setting, False


def measure_stage_times(model, n_stages: int, micro_batch_size: int, iters: int = 5) -> list[tuple[float, float]]:
    """Each stage's (forward, backward) seconds of one micro-batch on this machine, for an even layer split
    (`swarm.scheduler.cost.even_layers`, the planner's `--plan-even-layers`): the fastest of `iters` passes, as a
    peer measures its speed (`swarm.daemon.capacity.measure_compute`). The first stage runs the embedding, the last
    the head and the loss."""
    import torch

    from swarm.scheduler.cost import even_layers

    sizes = even_layers(model.n_layers, n_stages)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    shape = (micro_batch_size, model.seq_len_tokens)
    targets = torch.randint(0, model.vocab_size, shape)
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # as a peer computes (`PeerConfig.threads`)
    try:
        for s in range(n_stages):
            out.append(_stage_pass_s(model, bounds, s, n_stages, shape, targets, iters))
    finally:
        torch.set_num_threads(threads)
    return out


def _stage_pass_s(model, bounds, s: int, n_stages: int, shape, targets, iters: int) -> tuple[float, float]:
    """Stage `s`'s (forward, backward) seconds of one micro-batch: the fastest forward, and the fastest forward and
    backward together less it."""
    import torch

    from swarm.model.spec import build_stage
    from swarm.runtime.device import fastest_seconds

    first, last = s == 0, s == n_stages - 1
    stage = build_stage(model, int(bounds[s]), int(bounds[s + 1]), first, last)
    x = torch.randint(0, model.vocab_size, shape) if first else torch.randn(*shape, model.boundary_dim)
    if not first:
        x.requires_grad_(True)

    def run():
        return stage(x, targets) if last else stage(x)

    def forward():
        with torch.no_grad():
            return run()

    def both():
        run().float().sum().backward()

    forward_s = fastest_seconds(forward, "cpu", iters)
    return forward_s, max(fastest_seconds(both, "cpu", iters) - forward_s, 0.0)


def plan_epilogue_only(
    model,
    setting: str,
    n_stages: int,
    micro_batch_size: int,
    n_micro: int,
    rate_mbit: float | None,
    delay_ms: float = 0.0,
    schedule: str = "1f1b",
    precise: str = "fp32",
    stage_times: list[tuple[float, float]] | None = None,
):
    """The planner's epilogue-only choice for `setting` (`FW/BW`, its backward codec the compressed one) on links at
    `rate_mbit` (None: unshaped, planned at `UNSHAPED_PLAN_MBIT`): (`EpilogueOnly`, `EpilogueOnlyChoice`), from
    `stage_times` (default: measured now, `measure_stage_times`) and the codecs' message bytes."""
    from swarm.runtime.boundary import EpilogueOnly
    from swarm.scheduler.bits import codec_sizes
    from swarm.scheduler.epilogue_only import choose_epilogue_only, link_times

    forward, backward = split_epilogue(setting)[0].split("/")
    times = stage_times or measure_stage_times(model, n_stages, micro_batch_size)
    sizes = codec_sizes(model, micro_batch_size)
    rate = (rate_mbit or UNSHAPED_PLAN_MBIT) * 1e6 / 8
    links = link_times(
        times, [rate] * (n_stages - 1), [delay_ms / 1e3] * (n_stages - 1), sizes(forward), sizes(precise),
        sizes(backward),
    )  # fmt: skip
    choice = choose_epilogue_only(schedule, n_micro, links)
    log.info("%s at %s Mbit/s: %s", setting, rate_mbit or "unshaped", choice.why)
    return EpilogueOnly(CodecConfig.parse(precise), choice.plan), choice
