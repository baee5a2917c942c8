"""Per-stage precision planned with placement: QSync's allocator over a pipeline's stages.

Inputs, per stage: its predicted compute time in each precision its peers run (from the peers' announced
speeds: `PeerAnnouncement.compute_layers_per_s` for fp32, `speeds` for the others) and its sensitivity in each
low precision (`swarm.runtime.sensitivity`: the relative gradient error it adds). Output: one precision per
stage (the plan's `precisions`) under a loss budget (the sum of the chosen stages' sensitivities <= budget) that
minimises the predicted step time, lowering precision only where it moves the bottleneck:

1. Start from fp32 everywhere (QSync's "quantization-minimized": the reference precision).
2. While the budget allows: take the bottleneck stage (the slowest; a pipeline's step is paced by it) and lower
   it to the candidate precision that gives the shortest predicted step, the least sensitive on ties. Stop when
   the bottleneck has no faster candidate within the budget: no other stage's precision can shorten the step.
3. Recovery (QSync's allocator recovers "redundant" low-precision operators): every lowered stage goes back up
   to the most precise choice that does not lengthen the predicted step, the most sensitive first.
4. If the result is not faster than fp32 everywhere, fp32 everywhere: no sensitivity is spent for nothing.

fp16 is never mixed with other precisions (its loss scale is agreed by every stage, `swarm.runtime.precision`;
`swarm.peers.plan.PlanDocument` refuses such a plan), so the candidates are bf16 by default.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CLAMP_FACTOR",
    "DEFAULT_BUDGET",
    "PrecisionChoice",
    "announced_sensitivities",
    "choose_precisions",
    "peer_speed",
    "plan_precisions",
    "precision_planner",
    "precision_speeds",
    "scaled_speeds",
    "stage_times",
]

log = logging.getLogger("swarm.scheduler.precision_choice")

DEFAULT_BUDGET = 1.0e-3
"""Default loss budget (sum of relative squared gradient errors): bf16 on one of our stages measures ~1e-4."""

_EPS = 1e-9


@dataclass(frozen=True)
class PrecisionChoice:
    """The allocator's answer: one precision per stage, the predicted step time with it and with fp32 only."""

    precisions: tuple[str, ...]
    step_s: float
    fp32_step_s: float
    spent: float
    """the chosen stages' summed sensitivity (<= the budget)"""
    why: str


def _bottleneck(times: Sequence[float]) -> float:
    return max(times)


def choose_precisions(
    times: Sequence[Mapping[str, float]],
    sensitivity: Sequence[Mapping[str, float]],
    budget: float = DEFAULT_BUDGET,
    candidates: Sequence[str] = ("bf16",),
    step_time: Callable[[Sequence[float]], float] = _bottleneck,
) -> PrecisionChoice:
    """Chooses a precision per stage (see the module docstring).

    Args:
        times: per stage, predicted compute seconds per step in each precision it can run; "fp32" required.
        sensitivity: per stage, the sensitivity of each low precision; a precision without one is not chosen.
        budget: the most summed sensitivity the plan may spend (>= 0).
        candidates: the low precisions to consider, in no particular order.
        step_time: the predicted step time from the stages' times (default: the slowest stage's).
    """
    n = len(times)
    if n == 0 or len(sensitivity) != n:
        raise ValueError(f"need times and sensitivities for the same stages, got {n} and {len(sensitivity)}")
    if not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"budget must be a finite number >= 0, got {budget}")
    for s, t in enumerate(times):
        if not all(math.isfinite(v) and v > 0 for v in t.values()) or "fp32" not in t:
            raise ValueError(f"stage {s}: times need a positive finite fp32 figure, got {dict(t)}")
    options = [
        ["fp32"] + [p for p in candidates if p in times[s] and p in sensitivity[s] and p != "fp32"] for s in range(n)
    ]

    def sens(s: int, p: str) -> float:
        return 0.0 if p == "fp32" else float(sensitivity[s][p])

    def predict(choice: Sequence[str]) -> float:
        return step_time([times[s][p] for s, p in enumerate(choice)])

    base = ["fp32"] * n
    fp32_step = predict(base)
    choice, spent = list(base), 0.0
    while True:
        stage_t = [times[s][p] for s, p in enumerate(choice)]
        b = max(range(n), key=lambda s: stage_t[s])
        best = None
        for p in options[b]:
            extra = spent - sens(b, choice[b]) + sens(b, p)
            if times[b][p] >= stage_t[b] - _EPS or extra > budget + _EPS:
                continue
            trial = choice[:b] + [p] + choice[b + 1 :]
            key = (predict(trial), sens(b, p))
            if best is None or key < best[0]:
                best = (key, p, extra)
        if best is None:
            break
        choice[b], spent = best[1], best[2]
    target = predict(choice)
    for s in sorted(range(n), key=lambda s: -sens(s, choice[s])):  # recovery, the most sensitive first
        for p in sorted(options[s], key=lambda p: sens(s, p)):
            if sens(s, p) >= sens(s, choice[s]):
                break
            trial = choice[:s] + [p] + choice[s + 1 :]
            if predict(trial) <= target + _EPS:
                spent += sens(s, p) - sens(s, choice[s])
                choice[s] = p
                break
    step = predict(choice)
    if step >= fp32_step - _EPS:
        why = "fp32 everywhere: no lower precision within the budget shortens the step"
        return PrecisionChoice(tuple(base), fp32_step, fp32_step, 0.0, why)
    lowered = [f"stage {s} {p}" for s, p in enumerate(choice) if p != "fp32"]
    why = f"{', '.join(lowered)}: predicted step {step:.4g} s (fp32 {fp32_step:.4g} s), sensitivity {spent:.3g}"
    return PrecisionChoice(tuple(choice), step, fp32_step, max(spent, 0.0), why)


def peer_speed(announcement, precision: str) -> float | None:
    """A peer's announced layers/s in `precision` (None: it announced none)."""
    if precision == "fp32":
        return announcement.compute_layers_per_s or None
    return dict(announcement.speeds).get(precision)


def stage_times(stages: Sequence[Mapping], peers: Mapping[str, object], precisions: Sequence[str]) -> list[dict]:
    """Per stage of a plan dict's `stages`, its compute seconds per layer-pass in each precision every one of its
    peers announced a speed for: its layers over its slowest replica's speed (a replica paces its route)."""
    out = []
    for stage in stages:
        layers = int(stage["layer_end"]) - int(stage["layer_start"])
        figures = {}
        for p in ("fp32", *precisions):
            speeds = [peer_speed(peers[pid], p) for pid in stage["peer_ids"] if pid in peers]
            if speeds and all(speeds):
                figures[p] = layers / min(speeds)
        out.append(figures)
    return out


def plan_precisions(
    stages: Sequence[Mapping],
    peers: Mapping[str, object],
    sensitivity: Sequence[Mapping[str, float]] | None,
    budget: float = DEFAULT_BUDGET,
) -> tuple[str, ...] | None:
    """The live planner's hook: one precision per stage of a plan (`PlanDocument.with_precisions`) from the peers'
    announced speeds and the stages' sensitivities, or None (today's behaviour: each peer's --precision) when a
    stage lacks an fp32 speed, no sensitivity is known, or fp32 everywhere is as fast."""
    if sensitivity is None or len(sensitivity) != len(stages):
        return None
    times = stage_times(stages, peers, ("bf16",))
    if any("fp32" not in t for t in times):
        return None
    choice = choose_precisions(times, sensitivity, budget)
    return choice.precisions if "bf16" in choice.precisions else None


CLAMP_FACTOR = 100.0
"""How far an announced sensitivity may lie from the planner's own measurement of the same layers (either way)
before it is clamped: real gradients and synthetic ones rate a stage within a few times of each other, a peer
announcing 0 (to get a low precision it should not) or the maximum is not believed past this."""


def announced_sensitivities(
    stages: Sequence[Mapping], peers: Mapping[str, object], own: Sequence[Mapping[str, float]]
) -> tuple[list[dict[str, float]], list[str]]:
    """Each stage's sensitivity as its peers measured it from their real gradients (`PeerAnnouncement.sensitivity`
    for exactly the stage's layers, the median over its replicas), held within CLAMP_FACTOR of the planner's own
    figure `own` (per stage; also the fallback where none of its peers announced one yet).

    Returns the figures per stage and one line per stage saying where its figure came from, naming every peer
    whose figure was clamped."""
    out, notes = [], []
    for s, stage in enumerate(stages):
        layers = (int(stage["layer_start"]), int(stage["layer_end"]))
        figures, why = dict(own[s]), []
        for precision, mine in own[s].items():
            heard = []
            for pid in stage["peer_ids"]:
                announced = getattr(peers.get(pid), "sensitivity", ())
                got = [f for a, b, p, f in announced if (a, b) == layers and p == precision]
                if not got:
                    continue
                lo, hi = mine / CLAMP_FACTOR, max(mine * CLAMP_FACTOR, 1e-12)
                if not lo <= got[0] <= hi:
                    why.append(f"{pid}'s {precision} {got[0]:.3g} clamped to [{lo:.3g}, {hi:.3g}]")
                heard.append(min(max(got[0], lo), hi))
            if heard:
                heard.sort()
                mid = len(heard) // 2
                figures[precision] = heard[mid] if len(heard) % 2 else (heard[mid - 1] + heard[mid]) / 2
                why.insert(0, f"{precision} {figures[precision]:.3g} announced by {len(heard)} peer(s)")
            else:
                why.insert(0, f"{precision} {mine:.3g} the planner's own (initial weights, synthetic inputs)")
        out.append(figures)
        notes.append(f"stage {s} layers [{layers[0]}, {layers[1]}): " + "; ".join(why))
    return out, notes


def precision_planner(
    model, budget: float, micro_batch_size: int = 2
) -> Callable[[list, list], tuple[str, ...] | None] | None:
    """What the live planner calls on a plan's stages and the announced peers when --precision-budget is set (None:
    off): `plan_precisions` with each stage's sensitivity as its peers announced it (`announced_sensitivities`),
    the planner's own `stage_sensitivity` (the model's init, synthetic inputs) where none did yet."""
    if not budget:
        return None
    from swarm.runtime.sensitivity import stage_sensitivity

    told: list[str] = []

    def choose(stages: list, peers: list, quiet: bool = False) -> tuple[str, ...] | None:
        own = [stage_sensitivity(model, s["layer_start"], s["layer_end"], micro_batch_size) for s in stages]
        sens, notes = announced_sensitivities(stages, {p.peer_id: p for p in peers}, own)
        if notes != told and not quiet:  # said once per change, not every planning round (nor per search candidate)
            told[:] = notes
            for note in notes:
                log.info("sensitivity: %s", note)
        return plan_precisions(stages, {p.peer_id: p for p in peers}, sens, budget)

    return choose


def precision_speeds(choose: Callable[..., tuple[str, ...] | None], plan_input, peers: Sequence) -> Callable:
    """The search's `PeerSpeeds` for a planner that chooses precisions (`precision_planner`'s `choose`): for a
    finished layout over `plan_input`'s peers, the stages' precisions as `choose` picks them for its layer ranges,
    and each peer's FLOP/s scaled by its announced speed in its stage's precision over its fp32 one (None when
    every stage stays fp32). So the precision under the loss budget is chosen inside the search, for each shape's
    best layout, rather than once for the layout fp32 speeds placed."""
    import numpy as np

    ids = [p.peer_id for p in plan_input.peers]

    def speeds_for(layout) -> np.ndarray | None:
        bounds = np.concatenate([[0], np.cumsum(layout.layers)])
        stages = [
            {"layer_start": int(bounds[s]), "layer_end": int(bounds[s + 1]), "peer_ids": [ids[int(i)] for i in row]}
            for s, row in enumerate(layout.grid)
        ]
        chosen = choose(stages, list(peers), quiet=True)
        return scaled_speeds(plan_input, [st["peer_ids"] for st in stages], chosen, peers)

    return speeds_for


def scaled_speeds(plan_input, stage_peers: Sequence[Sequence[str]], precisions, peers: Sequence):
    """`plan_input`'s FLOP/s per peer with the peers of stage s (`stage_peers[s]`, ids) at their announced speed in
    `precisions[s]` over their fp32 one (a peer without both figures keeps its own); None when `precisions` is None or
    every stage's is fp32 (nothing changes)."""
    import numpy as np

    if precisions is None or all(p == "fp32" for p in precisions):
        return None
    by_id, index = {p.peer_id: p for p in peers}, {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    speeds = np.array(plan_input.speeds_flops_per_s, dtype=float)
    for precision, ids in zip(precisions, stage_peers, strict=True):
        for pid in ids:
            announced = by_id.get(pid)
            fp32 = peer_speed(announced, "fp32") if announced is not None else None
            low = peer_speed(announced, precision) if announced is not None else None
            if fp32 and low and pid in index:
                speeds[index[pid]] *= low / fp32
    return speeds
