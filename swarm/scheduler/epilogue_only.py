"""Epilogue-only compression, planned: which backward messages to compress, from measured stage and link timings.

The inputs are what a planner measures: each stage's forward and backward compute of one micro-batch (seconds),
each boundary's rate and one-way latency, and the bytes of one micro-batch's forward message and of its backward
message at the precise and at the compressed codec (`sizes.message_bytes`). `choose_epilogue_only` plays the
schedule on `swarm.runtime.epilogue`'s clock and keeps compressed only the messages whose transfer would lengthen
the step by more than `tolerance` (a share of it) against compressing every one; it reports the three predicted
steps (all compressed, the chosen set, all precise) and the step's split (compute, exposed transfer), which the
experiments print beside what they measure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from swarm.runtime.epilogue import EpiloguePlan, StageTimes, derive_tails, exposed_messages, step_time_s

if TYPE_CHECKING:
    from swarm.scheduler.plans import ModelSpec, PlanInput

__all__ = ["EpilogueOnlyChoice", "choose_epilogue_only", "epilogue_only_planner", "link_times", "plan_epilogue_only"]

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 0.01
"""The chosen set may make the predicted step at most 1% longer than compressing every backward message."""


def link_times(
    compute_s: Sequence[tuple[float, float]],
    bytes_per_s: Sequence[float],
    latency_s: Sequence[float],
    forward_bytes: float | Sequence[float],
    precise_bytes: float,
    compressed_bytes: float | Sequence[float],
) -> StageTimes:
    """`StageTimes` from measured figures: `compute_s[s]` = (forward, backward) of stage s; per boundary its rate
    (bytes/s, both ways) and one-way latency; one micro-batch's message bytes (the forward's and the compressed
    backward's one for every boundary, or one per boundary where the plan chose each link's codecs)."""
    n = len(compute_s)
    if len(bytes_per_s) != n - 1 or len(latency_s) != n - 1:
        raise ValueError(f"{n} stages need {n - 1} link rates and latencies")
    if any(not r > 0 for r in bytes_per_s):
        raise ValueError(f"link rates must be > 0 bytes/s, got {list(bytes_per_s)}")

    def send(nbytes: float | Sequence[float]) -> tuple[float, ...]:
        sizes = [float(nbytes)] * (n - 1) if isinstance(nbytes, (int, float)) else [float(b) for b in nbytes]
        if len(sizes) != n - 1:
            raise ValueError(f"{n} stages need {n - 1} message sizes, got {len(sizes)}")
        return tuple(lat + b / r for b, r, lat in zip(sizes, bytes_per_s, latency_s, strict=True))

    return StageTimes(
        tuple(f for f, _ in compute_s),
        tuple(b for _, b in compute_s),
        send(forward_bytes),
        send(precise_bytes),
        send(compressed_bytes),
    )


@dataclass(frozen=True)
class EpilogueOnlyChoice:
    """What the planner chose and what it predicts."""

    plan: EpiloguePlan
    """The compressed tails, for the schedule and micro-batch count chosen for."""
    compressed_s: float
    """The predicted step (pipeline only) with every backward message compressed."""
    chosen_s: float
    """... with only `plan`'s messages compressed."""
    precise_s: float
    """... with none compressed."""
    compute_s: float
    """The busiest stage's compute over the step (the step's floor)."""
    exposed: int
    """Backward messages compressed, of `total`."""
    total: int

    @property
    def why(self) -> str:
        return (
            f"compress {self.exposed}/{self.total} backward messages ({self.plan.describe()}): predicted "
            f"{self.chosen_s:.3f}s vs {self.compressed_s:.3f}s all compressed, {self.precise_s:.3f}s none; "
            f"compute {self.compute_s:.3f}s"
        )

    def row(self) -> dict:
        """The figures as a report's columns (the step's split: compute, and what the transfers add)."""
        return {
            "tails": ",".join(map(str, self.plan.tails or ())),
            "compressed_messages": self.exposed,
            "backward_messages": self.total,
            "predicted_all_s": round(self.compressed_s, 4),
            "predicted_epilogue_s": round(self.chosen_s, 4),
            "predicted_none_s": round(self.precise_s, 4),
            "predicted_compute_s": round(self.compute_s, 4),
            "predicted_transfer_s": round(self.chosen_s - self.compute_s, 4),
        }


def choose_epilogue_only(
    schedule: str, n_micro: int, times: StageTimes, tolerance: float = DEFAULT_TOLERANCE
) -> EpilogueOnlyChoice:
    """The fewest backward messages to compress (a tail per boundary, `derive_tails`) for a step at most
    `tolerance` longer than with all of them compressed, and the predicted steps."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    n = times.n_stages
    tails = derive_tails(schedule, n_micro, times, tolerance)
    chosen = set(exposed_messages(schedule, n, n_micro, tails))
    every = {(b, m) for b in range(n - 1) for m in range(n_micro)}
    compute = max(n_micro * (f + b) for f, b in zip(times.forward_s, times.backward_s, strict=True))
    return EpilogueOnlyChoice(
        EpiloguePlan(tails, schedule, n_micro),
        step_time_s(schedule, n_micro, times, every),
        step_time_s(schedule, n_micro, times, chosen),
        step_time_s(schedule, n_micro, times, set()),
        compute,
        len(chosen),
        len(every),
    )


FORWARD_SHARE = 1 / 3
"""A stage's forward pass as a share of its forward + backward (the backward takes about twice the forward): the
peers announce one speed for both (`PeerAnnouncement.compute_layers_per_s`)."""


def plan_epilogue_only(
    stages: list[dict],
    plan_input: PlanInput,
    spec: ModelSpec,
    message_bytes: Callable[[str], float],
    codecs: tuple[str, str] | Sequence[tuple[str, str]],
    precise: str = "fp32",
    schedule: str = "1f1b",
    measured_s: Sequence[float] | None = None,
) -> EpilogueOnlyChoice | None:
    """The live planner's epilogue-only choice for a plan's `stages` (the scheduler's layout dicts): each stage's
    forward and backward of one micro-batch from its slowest replica's announced speed (`FORWARD_SHARE` of it
    forward), each boundary's slowest replica link and its longest delay as the probes measured them, the messages'
    bytes (`message_bytes(label)`, one micro-batch's message) at the links' (forward, backward) `codecs` (one pair
    for every link, or one per boundary: the plan's per-link codecs) and at `precise`; a route's micro-batches as
    the plan's replicas share the step's. `measured_s`: each stage's forward + backward of one micro-batch as its
    peers' clocks measured it (the calibration's, head and loss included, which an announced block speed leaves out)
    instead of the announced speeds. None for a single stage."""
    if len(stages) < 2:
        return None
    index = {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    groups = [np.array([index[pid] for pid in st["peer_ids"]]) for st in stages]
    compute = []
    for s, (st, group) in enumerate(zip(stages, groups, strict=True)):
        speed = min(plan_input.peers[i].compute_flops_per_s for i in group)
        seconds = (st["layer_end"] - st["layer_start"]) * spec.flops_per_layer / speed if speed > 0 else 0.0
        seconds = measured_s[s] if measured_s is not None else seconds
        compute.append((FORWARD_SHARE * seconds, (1 - FORWARD_SHARE) * seconds))
    rates, delays = [], []
    for a, b in zip(groups, groups[1:], strict=False):
        rates.append(float(min(plan_input.bandwidth_bytes_per_s[np.ix_(a, b)].min(),
                               plan_input.bandwidth_bytes_per_s[np.ix_(b, a)].min())))  # fmt: skip
        delays.append(float(max(plan_input.delay_s[np.ix_(a, b)].max(), plan_input.delay_s[np.ix_(b, a)].max())))
    pairs = [tuple(codecs)] * (len(stages) - 1) if isinstance(codecs[0], str) else [tuple(c) for c in codecs]
    forward = [message_bytes(f) for f, _ in pairs]
    backward = [message_bytes(b) for _, b in pairs]
    times = link_times(compute, rates, delays, forward, message_bytes(precise), backward)
    n_micro = spec.micro_batches_per_pipeline(max(len(g) for g in groups))
    return choose_epilogue_only(schedule, n_micro, times)


def epilogue_only_planner(model, codecs, plans) -> Callable[[list[dict], PlanInput, ModelSpec], str | None]:
    """The live planner's `--plan-epilogue-only` choice for a peer's `model`, its (forward, backward) `CodecConfig`s
    and its `PlanningConfig` (the plan's micro-batch size): (stages, plan input, spec) -> the plan's `bw_epilogue`
    (`EpilogueOnly.parse`'s form; None for one stage), logged with why."""
    from swarm.compression import CodecConfig
    from swarm.runtime.boundary import EpilogueOnly
    from swarm.scheduler.bits import codec_sizes

    sizes, precise = codec_sizes(model, plans.micro_batch_size), CodecConfig.parse("fp32")
    labels = (codecs[0].label, codecs[1].label)

    def choose(stages: list[dict], plan_input: PlanInput, spec: ModelSpec, measured_s=None, links=None) -> str | None:
        """`links`: the plan's per-boundary `LinkCodecs` (per-link codecs), else every link at the flags' codecs."""
        pairs = labels if not links else [(c.forward_label, c.backward_label) for c in links]
        choice = plan_epilogue_only(stages, plan_input, spec, sizes, pairs, precise.label, measured_s=measured_s)
        if choice is None:
            return None
        log.info("epilogue-only: %s", choice.why)
        return EpilogueOnly(precise, choice.plan).label()

    return choose
