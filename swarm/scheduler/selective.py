"""Optimus-CC's selective compression, planned: the epilogue's codecs from the measured links, and the cost term.

`epilogue_figures` reads, for a plan's stages, what `swarm.scheduler.bits.choose_epilogue` chooses from: each
replicated stage's slowest member-to-member link and gradient size, the tied group's, and the step's pipeline
time without its epilogue (the cost model's). `selective_breakdown` is the cost term: the same `FullCost`
prediction with each stage's averaging and the tied sync at the chosen codecs' bytes, so the planner's predicted
step shows the epilogue it will run. `choose_for_plan` is both, what the live planner publishes.

Sizes: a stage's elements are its layers x `ModelSpec.gradient_elements_per_layer` (a spec without it: its
gradient bytes at `TransformerShape.gradient_bits`, 8, an element); the tied weight's are its shape's
(`ModelSpec.tied_shape`, vocab x hidden; a spec without it: read back from `ModelSpec.tied_bytes` at 4 bits an
element), and a low-rank tied codec factors that matrix (`EpilogueFigures.cols`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from swarm.peers.plan_codecs import EpilogueCodecs
from swarm.scheduler.bits import BitsPolicy, CodecSpeed, EpilogueFigures, choose_epilogue, epilogue_bytes
from swarm.scheduler.cost import FullCost, Layout
from swarm.scheduler.plans import Breakdown, ModelSpec, PlanInput, TransformerShape
from swarm.scheduler.selective_stages import widen_hidden

__all__ = [
    "PlannedEpilogue",
    "choose_for_plan",
    "epilogue_figures",
    "epilogue_moved",
    "pipeline_s",
    "pipeline_step_s",
    "planned_epilogue",
    "selective_breakdown",
    "tied_elements",
]

TIED_SPEC_BITS = 4
"""Bits an element of a hand-made `ModelSpec.tied_bytes` (no `tied_shape`): the tied floor's before s50."""


def gradient_elements(spec: ModelSpec) -> float:
    """Weight-gradient elements of one layer (`ModelSpec.gradient_elements_per_layer`, else read back from its
    bytes at the cost model's default bits)."""
    return spec.gradient_elements_per_layer or spec.gradient_bytes_per_layer * 8 / TransformerShape.gradient_bits


def tied_elements(spec: ModelSpec) -> float:
    """The tied weight's elements: its shape's where the spec knows it, else read back from its bytes at the old
    4-bit floor (a spec made by hand)."""
    rows, cols = spec.tied_shape
    return float(rows * cols) if rows * cols else spec.tied_bytes * 8 / TIED_SPEC_BITS


def _layout(stages: list[dict], plan_input: PlanInput) -> Layout:
    index = {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    width = max(len(st["peer_ids"]) for st in stages)
    if any(len(st["peer_ids"]) != width for st in stages):
        raise ValueError("selective: uneven replica counts are not modelled")
    grid = np.array([[index[pid] for pid in st["peer_ids"]] for st in stages])
    return Layout(grid, np.array([st["layer_end"] - st["layer_start"] for st in stages]))


def pipeline_s(b: Breakdown) -> float:
    """The step without its epilogue (averaging, tied sync): compute, fill, steady state and overhead."""
    return b.compute_s + b.transfer_s + b.latency_s + b.steady_s + b.overhead_s


def pipeline_step_s(stages: list[dict], plan_input: PlanInput, spec: ModelSpec) -> float | None:
    """`pipeline_s` of `stages` as the cost model predicts it; None for a layout it does not score."""
    try:
        return pipeline_s(FullCost(plan_input, spec).evaluate(_layout(stages, plan_input)))
    except ValueError:
        return None


def _slowest(plan_input: PlanInput, members: np.ndarray) -> float:
    bandwidth = plan_input.bandwidth_bytes_per_s[np.ix_(members, members)]
    return float(bandwidth[~np.eye(len(members), dtype=bool)].min())


def epilogue_figures(
    stages: list[dict], plan_input: PlanInput, spec: ModelSpec, speed: CodecSpeed | None = None
) -> tuple[list[EpilogueFigures | None], EpilogueFigures | None]:
    """Each stage's averaging figures (None for one replica) and the tied sync's (None without one); `speed`: how
    fast the codecs run (None: the exchanges are their bytes alone)."""
    layout = _layout(stages, plan_input)
    step = pipeline_s(FullCost(plan_input, spec).evaluate(layout))
    per_element = gradient_elements(spec)
    hidden = spec.tied_shape[1] or None  # a factored sum's rows (`epilogue_bytes`): the hidden size where known
    average = [
        None
        if len(row) < 2
        else EpilogueFigures(_slowest(plan_input, row), n * per_element, step, len(row), speed, hidden)
        for row, n in zip(layout.grid, layout.layers, strict=True)
    ]
    tied = None
    if spec.tied_bytes > 0 and len(stages) > 1:
        members = np.concatenate([layout.grid[0], layout.grid[-1]])
        tied = EpilogueFigures(
            _slowest(plan_input, members), tied_elements(spec), step, len(members), speed, spec.tied_shape[1] or None
        )
    return average, tied


class _EpilogueCost(FullCost):
    """`FullCost` with one stage group's gradient bytes per layer of its own (its averaging codec's)."""

    def __init__(self, plan_input: PlanInput, model: ModelSpec, per_group: dict[tuple[int, ...], float]):
        super().__init__(plan_input, model)
        own = {key: FullCost(plan_input, replace(model, gradient_bytes_per_layer=b)) for key, b in per_group.items()}
        object.__setattr__(self, "_own", own)

    def group_stats(self, group: np.ndarray, stages: int):
        own = self._own.get(tuple(int(i) for i in group))
        return own.group_stats(group, stages) if own is not None else super().group_stats(group, stages)


def _codec_bytes(label: str, elements: float, fig: EpilogueFigures | None) -> float:
    """`epilogue_bytes` plus the codec's encode and decode time as bytes of the group's slowest link (what the
    cost model divides by a rate): the cost model then predicts the exchange's time `fig.seconds` gives."""
    coding = 0.0 if fig is None else fig.coding_s(label) * elements * fig.bytes_per_s
    return epilogue_bytes(label, elements, None if fig is None else fig.cols) + coding


def selective_breakdown(
    stages: list[dict], plan_input: PlanInput, spec: ModelSpec, chosen: EpilogueCodecs, figures: tuple | None = None
) -> Breakdown:
    """The predicted step of `stages` with the epilogue at `chosen`'s codecs (`choose_epilogue`'s): each
    stage's averaging at its codec's bits per element, the tied sync at its codec's bytes; with `figures`
    (`epilogue_figures`, measured codec speeds) each exchange's encoding and decoding too."""
    layout = _layout(stages, plan_input)
    average, tied_fig = figures if figures is not None else ([None] * len(stages), None)
    tied = chosen.tied_label
    model = replace(spec, tied_bytes=_codec_bytes(tied, tied_elements(spec), tied_fig)) if tied else spec
    per_element = gradient_elements(spec)
    per_group = {
        tuple(int(i) for i in row): _codec_bytes(label, per_element, fig)
        for row, label, fig in zip(layout.grid, chosen.average_labels, average, strict=True)
        if label is not None
    }
    return _EpilogueCost(plan_input, model, per_group).evaluate(layout)


def choose_for_plan(
    stages: list[dict],
    plan_input: PlanInput,
    spec: ModelSpec,
    policy: BitsPolicy | None = None,
    speed: CodecSpeed | None = None,
) -> tuple[EpilogueCodecs, tuple, Breakdown]:
    """(The epilogue's codecs, the figures they were chosen from, the predicted breakdown with them); `speed`: the
    codecs' measured encode and decode times (None: bytes alone)."""
    figures = epilogue_figures(stages, plan_input, spec, speed)
    # selective stage compression: only the exchanges that set the epilogue's length stay compressed
    chosen = widen_hidden(choose_epilogue(*figures, policy or BitsPolicy()), *figures)
    return chosen, figures, selective_breakdown(stages, plan_input, spec, chosen, figures)


@dataclass(frozen=True)
class PlannedEpilogue:
    """What the live planner adds to a plan for its epilogue (`PlanDocument.with_epilogue`, `with_prediction`)."""

    codecs: EpilogueCodecs
    breakdown: Breakdown
    """The predicted step with these codecs: the plan's `step_time_s` is its `total_s`."""
    figures: tuple
    """What the codecs were chosen from (`epilogue_figures`), for `epilogue_moved`."""


def planned_epilogue(
    stages: list[dict],
    plan_input: PlanInput,
    spec: ModelSpec,
    policy: BitsPolicy | None = None,
    speed: CodecSpeed | None = None,
) -> PlannedEpilogue | None:
    """The epilogue's codecs for a plan's stages and the step predicted with them; None where nothing is summed
    or the layout is not one the cost model scores (uneven replica counts)."""
    try:
        chosen, figures, breakdown = choose_for_plan(stages, plan_input, spec, policy, speed)
    except ValueError:
        return None
    if all(f is None for f in figures[0]) and figures[1] is None:
        return None
    return PlannedEpilogue(chosen, breakdown, figures)


def epilogue_moved(old, stages: list[dict], plan_input: PlanInput, spec: ModelSpec, policy: BitsPolicy) -> bool:
    """Whether the epilogue's figures moved past the hysteresis since `old` (False where there is no epilogue)."""
    from swarm.scheduler.bits import rechoose_epilogue

    try:
        new = epilogue_figures(stages, plan_input, spec)
    except ValueError:
        return False
    if old is None and all(f is None for f in new[0]) and new[1] is None:
        return False
    return rechoose_epilogue(old, new, policy)
