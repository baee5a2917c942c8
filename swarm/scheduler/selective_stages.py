"""Optimus-CC's selective stage compression on this runtime: compress a replicas' sum only where it sets the epilogue.

`bits.choose_epilogue` gives each exchange (a stage's replicas' sum, the tied sync) the widest codec whose
transfer fits in `epilogue_share` of the step, independently. But the exchanges overlap: every stage's replicas
sum at once when the trainer's `Reduce` comes, each group on its own links, and the end stages then run the tied
sync (`GradientAverager.reduce`: the stage's sum, then the tied one). So the epilogue lasts

    max(max over stages of avg_s, max(avg_first, avg_last) + tied)

and an exchange that finishes before the slowest one is hidden behind it: compressing it saves nothing and only
adds error. `widen_hidden` starts from `choose_epilogue`'s codecs and widens every exchange (up its ladder, towards
fp32) as long as the epilogue stays no longer than it was, so the step is predicted no slower and only the stages
on the epilogue's critical path stay compressed. (The paper's version lets a stage start its sum as soon as its
own last backward ends, so later stages hide theirs under the drain; here the trainer's `Reduce` starts every sum
at once after the drain, so what hides a sum is the slowest other sum.)
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm.peers.plan_codecs import MAX_CODEC_WHY, EpilogueCodecs
from swarm.scheduler.bits import AVERAGE_LADDER, TIED_LADDER, EpilogueFigures

__all__ = ["epilogue_length_s", "widen_hidden"]


def _seconds(label: str | None, fig: EpilogueFigures | None) -> float:
    return 0.0 if label is None or fig is None else fig.seconds(label)


def epilogue_length_s(
    average_labels: Sequence[str | None],
    tied_label: str | None,
    average: Sequence[EpilogueFigures | None],
    tied: EpilogueFigures | None,
) -> float:
    """How long the epilogue takes with these codecs: every stage's sum at once, then the end stages' tied sync."""
    sums = [_seconds(label, fig) for label, fig in zip(average_labels, average, strict=True)]
    ends = max(sums[0], sums[-1]) if sums else 0.0
    return max([*sums, ends + _seconds(tied_label, tied)], default=0.0)


def widen_hidden(
    chosen: EpilogueCodecs, average: Sequence[EpilogueFigures | None], tied: EpilogueFigures | None
) -> EpilogueCodecs:
    """`chosen` with every exchange hidden behind the epilogue's slowest one widened as far as it stays hidden (the
    epilogue no longer than with `chosen`); the others as chosen. Middle stages first, then the end stages' sums,
    then the tied sync."""
    labels, tied_label = list(chosen.average_labels), chosen.tied_label
    bound = epilogue_length_s(labels, tied_label, average, tied) * (1 + 1e-9)
    n = len(labels)
    order = [s for s in range(n) if s not in (0, n - 1)] + sorted({0, n - 1} & set(range(n)))
    widened = []
    for s in order:
        if labels[s] is None or average[s] is None:
            continue
        for label in AVERAGE_LADDER[: AVERAGE_LADDER.index(labels[s])]:
            trial = [*labels[:s], label, *labels[s + 1 :]]
            if epilogue_length_s(trial, tied_label, average, tied) <= bound:
                labels = trial
                widened.append(f"avg{s} {label}")
                break
    if tied_label is not None and tied is not None:
        for label in TIED_LADDER[: TIED_LADDER.index(tied_label)]:
            if epilogue_length_s(labels, label, average, tied) <= bound:
                tied_label = label
                widened.append(f"tied {label}")
                break
    if not widened:
        return chosen
    why = f"{chosen.why or ''}; hidden behind the slowest exchange, widened: {', '.join(widened)}"
    return EpilogueCodecs(tuple(labels), tied_label, why[:MAX_CODEC_WHY])
