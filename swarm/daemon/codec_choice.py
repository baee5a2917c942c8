"""A plan's codecs as the live planner chooses them: each boundary's (the per-link policy) and the epilogue's (the
replicas' sums and the tied sync; per-link and selective), from the measured links and the stages' compute at the
precisions the plan gives them, and when a new measurement has moved far enough to choose again
(`swarm.scheduler.bits`). `Planner` owns one and publishes what it chooses."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from swarm.peers.plan import PlanDocument, PlanStage
from swarm.peers.records import PeerAnnouncement
from swarm.scheduler import ModelSpec, PlanInput
from swarm.scheduler.bits import BitsPolicy, CodecSpeed, LinkFigures, choose_codecs, rechoose
from swarm.scheduler.precision_choice import scaled_speeds
from swarm.scheduler.relays import with_speeds
from swarm.scheduler.selective import epilogue_moved, pipeline_step_s, planned_epilogue

__all__ = ["CodecChoice", "at_precisions", "link_figures"]

log = logging.getLogger("swarm.daemon.planning")


def link_figures(stages: Sequence[PlanStage], plan_input: PlanInput, spec: ModelSpec) -> list[LinkFigures]:
    """Each boundary's measured rates (its slowest replica pair each way) and its slower stage's compute per
    micro-batch: what `swarm.scheduler.bits` chooses codecs from. `stages`: a plan's (or the scheduler's
    `StagePlan`s: layers and peer ids)."""
    index = {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    bandwidth, speeds = plan_input.bandwidth_bytes_per_s, plan_input.speeds_flops_per_s
    rows = [[index[pid] for pid in st.peer_ids] for st in stages]
    compute = [
        (st.layer_end - st.layer_start) * spec.flops_per_layer / speeds[row].min()
        for st, row in zip(stages, rows, strict=True)
    ]
    return [
        LinkFigures(
            float(bandwidth[np.ix_(a, b)].min()), float(bandwidth[np.ix_(b, a)].min()), max(compute[s], compute[s + 1])
        )
        for s, (a, b) in enumerate(zip(rows, rows[1:], strict=False))
    ]


def at_precisions(plan_input: PlanInput, plan: PlanDocument, peers: list[PeerAnnouncement]) -> PlanInput:
    """`plan_input` with each stage's peers at their announced speed in the plan's precision for it (QSync's choice):
    what the links' and the epilogue's codecs and the prediction are chosen at; `plan_input` itself without
    precisions."""
    stage_peers = [stage.peer_ids for stage in plan.stages]
    speeds = scaled_speeds(plan_input, stage_peers, plan.precisions, peers)
    return plan_input if speeds is None else with_speeds(plan_input, speeds)


def _rung_figure(ladder, name: str) -> Callable[[str], float]:
    """`name` of a codec's rung on `ladder` (a `LinkLadder`), by label."""
    return lambda label: float(getattr(ladder.rung(label), name))


class CodecChoice:
    """What a plan's codecs are chosen from and were last chosen from (the figures `moved` compares against).

    Args:
        spec: the planner's model; its `link_ladder` (per-link) gives each codec's bytes and coding time.
        codec_bytes: bytes of one micro-batch's message per codec label (per-link codecs when given; default: the
            spec's ladder's); None without a ladder: the links keep the flags' codecs.
        epilogue: whether plans carry the epilogue's codecs (selective; per-link implies it).
        codec_speed: how fast this machine runs the epilogue's codecs (`sizes.measure_codec_speed`, measured once,
            when first asked); None: an exchange's time is its bytes alone.
        bits: the policy (floors, hysteresis, the epilogue's share).
    """

    def __init__(
        self,
        spec: ModelSpec,
        codec_bytes: Callable[[str], float] | None = None,
        epilogue: bool = False,
        codec_speed: Callable[[], CodecSpeed] | None = None,
        bits: BitsPolicy | None = None,
    ):
        ladder = spec.link_ladder
        if codec_bytes is None and ladder is not None:  # per-link with the search pricing each link's codec
            codec_bytes = _rung_figure(ladder, "message_bytes")
        self.spec, self.codec_bytes, self.bits, self.codec_speed = spec, codec_bytes, bits or BitsPolicy(), codec_speed
        self.coding_s = None if ladder is None else _rung_figure(ladder, "coding_s")
        """Seconds to encode and decode one message per codec (the spec's measured ladder); None: bytes alone."""
        self.enabled = epilogue or codec_bytes is not None
        """Whether plans carry chosen codecs at all (False: the fixed policy, every link at the flags' codecs)."""
        self._chosen_from: list[LinkFigures] | None = None
        self._epilogue_from = None  # the epilogue figures the plan's epilogue codecs were chosen from

    def apply(self, plan: PlanDocument, plan_input: PlanInput) -> PlanDocument:
        """`plan` with the codecs chosen per boundary from the measured links (per-link), and the epilogue's with
        the step predicted for them (per-link and selective; unchanged with fixed codecs)."""
        if not self.enabled:
            return plan
        stages = plan.stage_dicts()
        speed = self.codec_speed() if self.codec_speed is not None else None
        epilogue = planned_epilogue(stages, plan_input, self.spec, self.bits, speed)
        self._epilogue_from = None if epilogue is None else epilogue.figures
        if self.codec_bytes is not None and len(stages) >= 2:
            self._chosen_from = link_figures(plan.stages, plan_input, self.spec)
            step_s = pipeline_step_s(stages, plan_input, self.spec)  # the fill/drain's share of it (bits.py)
            codecs = choose_codecs(self._chosen_from, self.codec_bytes, self.bits, step_s, self.coding_s)
            for b, c in enumerate(codecs):
                log.info("boundary %d codecs %s", b, c.why)
            plan = plan.with_link_codecs(codecs)
        if epilogue is None:
            return plan
        breakdown = dataclasses.asdict(epilogue.breakdown)
        return plan.with_epilogue(epilogue.codecs).with_prediction(epilogue.breakdown.total_s, breakdown)

    def moved(self, plan: PlanDocument, plan_input: PlanInput) -> bool:
        """Whether the links' or the epilogue's figures moved past the hysteresis since `plan`'s codecs were chosen."""
        bounds = (
            self.codec_bytes is not None
            and plan.n_stages >= 2
            and rechoose(self._chosen_from, link_figures(plan.stages, plan_input, self.spec), self.bits)
        )
        return bounds or epilogue_moved(self._epilogue_from, plan.stage_dicts(), plan_input, self.spec, self.bits)
