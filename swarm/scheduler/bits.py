"""Bits per link: each boundary's forward and backward codecs, chosen from the link's measured rate.

Rule (`choose_link`): the most precise codec pair whose transfer hides under the stages' compute, within a loss
budget. A boundary paces a step at max(compute, forward message time, backward message time) per micro-batch
(full-duplex links, `FullCost`); so on each direction take the widest codec of the ladder whose message time
stays under the slower adjacent stage's compute per micro-batch; if none does, the quickest codec the loss budget
allows (on bytes alone the floor: the default codecs, `DEFAULT_FORWARD_CODEC` and `DEFAULT_BACKWARD_CODEC`, the
settings the convergence experiment holds within budget in both of its regimes; with measured coding time, on a
fast link, a wider one). Slow links thus get fewer bits, fast links more, up to fp32. The search prices each pair
of peers the same way (`link_ladder`, `ModelSpec.link_ladder`), so placement and codecs are chosen together.

Epilogue (`choose_epilogue`, Optimus-CC's selective compression): the replicas' gradient averaging and the tied
embedding's sync run after the pipeline drains, where nothing overlaps them: their transfer time always shows in
the step. So they are compressed by a different rule: the widest codec of their ladder whose exchange takes at
most the quickest one's plus `epilogue_share` of the step's pipeline time; on bytes alone the quickest is the floor
(2 bits with error feedback, preconditioned, for the replicas' sum; 4 for the tied sync). An exchange's time is
its bytes over the group's slowest link plus, where the planner measured how fast the codecs run (`CodecSpeed`),
one encode and one decode per member of the whole gradient: on a fast link a wide codec is then the quicker.
One averaging codec per stage (each stage's replicas have their own links) and one tied codec; the plan carries
them (`swarm.peers.plan_codecs.EpilogueCodecs`) and peers set them on their averager
(`PlanDocument.epilogue_configs`). A fast link thus sums in fp32 or bf16, a middling one in 8 bits with error
feedback, a slow one in 2.

Re-choice (`rechoose`): a plan's codecs change only when some link's rate moved by more than `hysteresis`
(a factor) since the rates it was chosen from, or a stage's compute did: probes are noisy, and each switch of
an AQ-SGD codec restarts its buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
from swarm.peers.plan_codecs import MAX_CODEC_WHY, EpilogueCodecs, LinkCodecs
from swarm.runtime.average import SUM_CODEC, TIED_CODEC
from swarm.scheduler.plans import LinkLadder, LinkRung

__all__ = [
    "AVERAGE_LADDER",
    "BACKWARD_LADDER",
    "CodecSpeed",
    "EpilogueFigures",
    "TIED_LADDER",
    "choose_epilogue",
    "epilogue_bytes",
    "rechoose_epilogue",
    "FORWARD_LADDER",
    "BitsPolicy",
    "LinkFigures",
    "choose_codecs",
    "choose_link",
    "epilogue_codec_speed",
    "flags_policy",
    "ladder_rung",
    "link_ladder",
    "measured_link_ladder",
    "wire_bits_ladder",
    "rechoose",
]

FORWARD_LADDER = (
    "fp32", "acsgd8+ch+nr", "acsgd4+ch+nr", DEFAULT_FORWARD_CODEC, "acsgd2+ch+nr+fsl32+fslw4+fsle10+dsl8+s20"
)  # fmt: skip
"""Forward (activation) codecs, most precise first; the last but one is the default floor (`DEFAULT_FORWARD_CODEC`):
the AQ-SGD paper's quantizer in channel groups, round to nearest, at 8 and 4 bits (first sights at 16 bits: a fast
link's choice), then the floor, whose first sights and later visits' changes are subspace-coded (at rank 32 or a
quarter of the width, and at rank 16).
Below it, the changes at rank 8 (25.8x after epoch 1 over 8 epochs of the convergence experiment where the floor
sends 21.8x, at +0.86% held-out against -0.03%, one seed), which a policy reaches only by naming it as its
`forward_floor`. (2-bit channel deltas, the floor before s53, send more than the floor at more error: no rung;
`bilevel`'s 1-bit deltas, the rung below it then, send more than rank 8 at more error: none either.)"""
BACKWARD_LADDER = (
    "fp32",
    "gradq8+ef+rot+nr+cs+g1024",
    "gradq4+ef+rot+nr+cs+g1024",
    DEFAULT_BACKWARD_CODEC,
    "gtern+ef+rot+nr+r150+g1024",
)
"""Backward (activation-gradient) codecs, most precise first; the 2-bit rung is the default floor
(`DEFAULT_BACKWARD_CODEC`): Hadamard rotation, round to nearest, 16-bit scales, at 8, 4 and 2 bits (groups of 1024
at 8 and 4 bits, of 256 at the 2-bit floor, where groups of 1024 cost loss in a single pass); error feedback at 8
and 4 bits (a 24,576-sample pass with fp32 activations: -0.19% with it at 4 bits, +0.18% without, noise), none at
the floor, where it cost a long single pass (`DEFAULT_BACKWARD_CODEC`'s docstring). Below it,
ternary gradients at about 1 bit an element (`gtern`, issue 13's best setting), which a policy reaches only by
naming it as its `backward_floor`."""
AVERAGE_LADDER = ("fp32", "bf16", "gradq8+ef+rot+nr+cs+g1024", SUM_CODEC)
"""Codecs of the replicas' gradient sum (`GradientAverager`), most precise first; the floor is each weight matrix as
rank-16 factors in 4-bit codes in AdamW's units (`swarm.runtime.average.SUM_CODEC`, also the averager's sum over
compressed links without a plan; rank 8 in int8 from s55 to s56, rank 12 in int8 in s56, rank 12 in 4 bits as they
are in s57). The 2-bit sum in AdamW's units
(`QUANTIZED_SUM_CODEC`, the floor before s55) is off the ladder: at the default width it sent 3x the floor's bytes
and ended no closer to fp32 over five seeds (docs/reports/replicas.md); a plan may still name it. bf16 rather
than fp16: a gradient sum must not overflow, and bf16 has fp32's range."""
TIED_LADDER = (*AVERAGE_LADDER[:3], "gradq4+ef+rot+nr+cs+g256", TIED_CODEC)
"""Codecs of the tied embedding's sync, most precise first: the default backward codec at 4 bits
(`GradientAverager.tied_min_bits`: 2 bits trained +2.66% where 4 gave +0.76%), then the floor, the tied weight's
gradient as rank-16 int8 factors (`swarm.runtime.average.TIED_CODEC`, what a peer without a plan's epilogue codecs
sums the tied gradient with behind compressed links)."""


@dataclass(frozen=True)
class BitsPolicy:
    """The loss budget as a floor on each ladder, and how much a rate must move to re-choose."""

    forward_floor: str = FORWARD_LADDER[3]
    backward_floor: str = BACKWARD_LADDER[3]
    hysteresis: float = 1.5
    """Re-choose when a link's rate or a stage's compute changed by more than this factor."""
    headroom: float = 1.0
    """A message must take at most compute / headroom to count as hidden."""
    average_floor: str = AVERAGE_LADDER[-1]
    tied_floor: str = TIED_LADDER[-1]
    epilogue_share: float = 0.05
    """An epilogue transfer (averaging, tied sync) may add at most this share of the step's pipeline time to stay
    uncompressed or 16-bit: it always shows in the step, so "hidden" means "small"."""

    def __post_init__(self) -> None:
        if self.forward_floor not in FORWARD_LADDER or self.backward_floor not in BACKWARD_LADDER:
            raise ValueError("BitsPolicy: floors must be on the ladders")
        if self.average_floor not in AVERAGE_LADDER or self.tied_floor not in TIED_LADDER:
            raise ValueError("BitsPolicy: epilogue floors must be on their ladders")
        if not self.hysteresis > 1.0 or not self.headroom > 0 or not 0 < self.epilogue_share < 1:
            raise ValueError("BitsPolicy: hysteresis must be > 1, headroom > 0 and epilogue_share in (0, 1)")


@dataclass(frozen=True)
class LinkFigures:
    """What one boundary's choice depends on."""

    forward_bytes_per_s: float
    """Measured rate from the stage before the boundary to the one after it."""
    backward_bytes_per_s: float
    """Measured rate back."""
    compute_s: float
    """The slower adjacent stage's forward + backward per micro-batch."""


def _no_coding(label: str) -> float:
    return 0.0


def _pick(ladder: Sequence[str], floor: str, seconds: Callable[[str], float], budget_s: float) -> str:
    """The most precise codec down to `floor` whose message takes at most `budget_s`, else the quickest (on bytes
    alone the floor; with coding time, on a fast link, a wider one)."""
    allowed = ladder[: ladder.index(floor) + 1]
    for label in allowed:
        if seconds(label) <= budget_s:
            return label
    return min(allowed, key=seconds)  # min keeps the first, the most precise, on ties


def choose_link(
    link: LinkFigures,
    message_bytes: Callable[[str], float],
    policy: BitsPolicy = BitsPolicy(),
    exposed_s: float = math.inf,
    coding_s: Callable[[str], float] | None = None,
) -> LinkCodecs:
    """The boundary's forward and backward codecs and why (`message_bytes(label)`: bytes of
    one micro-batch's message under that codec, e.g. `sizes.message_bytes` at the run's shape). `exposed_s`:
    what one message each way may take at most, hidden or not: the pipeline's fill and drain wait for one
    message each way on every boundary, so even a message the steady state hides is on the critical path once
    a step (`choose_codecs` gives each boundary its part of `epilogue_share`). `coding_s(label)`: seconds to
    encode and decode one message (a `LinkLadder`'s measured figures), added to its link time; None: bytes alone."""
    coding = coding_s or _no_coding
    budget = min(link.compute_s / policy.headroom, exposed_s / 2)

    def forward_time(label: str) -> float:
        return message_bytes(label) / link.forward_bytes_per_s + coding(label)

    def backward_time(label: str) -> float:
        return message_bytes(label) / link.backward_bytes_per_s + coding(label)

    forward = _pick(FORWARD_LADDER, policy.forward_floor, forward_time, budget)
    backward = _pick(BACKWARD_LADDER, policy.backward_floor, backward_time, budget)
    forward_s, backward_s = forward_time(forward), backward_time(backward)
    floors = (forward, backward) == (policy.forward_floor, policy.backward_floor)
    over = "over (at the floor)" if floors else "over (the quickest)"
    hidden = "hidden under" if max(forward_s, backward_s) <= budget else over
    why = (
        f"{forward}/{backward}: {forward_s * 1e3:.1f}/{backward_s * 1e3:.1f} ms per micro-batch, "
        f"{hidden} {budget * 1e3:.1f} ms compute"
    )
    return LinkCodecs(forward, backward, why)


def choose_codecs(
    links: Sequence[LinkFigures],
    message_bytes: Callable[[str], float],
    policy: BitsPolicy = BitsPolicy(),
    step_s: float | None = None,
    coding_s: Callable[[str], float] | None = None,
) -> list[LinkCodecs]:
    """One `choose_link` per boundary, in pipeline order. With `step_s` (the step's pipeline time, as the
    epilogue's figures carry it) the boundaries' fill and drain together may add at most `epilogue_share` of
    it (Optimus-CC's epilogue: the messages no compute hides); without, only the steady-state rule applies."""
    exposed = math.inf if step_s is None or not links else policy.epilogue_share * step_s / len(links)
    return [choose_link(link, message_bytes, policy, exposed, coding_s) for link in links]


def link_ladder(figures: Callable[[str], tuple[float, float]], policy: BitsPolicy = BitsPolicy()) -> LinkLadder:
    """The rungs a boundary may take each way under `policy` (fp32 down to its floors), from `figures(label)`:
    (bytes of one micro-batch's message, seconds to encode and decode it), e.g. `sizes.measure_link_rungs`'s. Put
    in the `ModelSpec` (`link_ladder`), the search prices each pair of peers at its quickest rung."""

    def rungs(ladder: Sequence[str], floor: str) -> tuple[LinkRung, ...]:
        return tuple(LinkRung(label, *figures(label)) for label in ladder[: ladder.index(floor) + 1])

    return LinkLadder(rungs(FORWARD_LADDER, policy.forward_floor), rungs(BACKWARD_LADDER, policy.backward_floor))


def rechoose(old: Sequence[LinkFigures] | None, new: Sequence[LinkFigures], policy: BitsPolicy = BitsPolicy()) -> bool:
    """Whether the measurements moved enough since `old` (what the plan's codecs were chosen from) to choose again."""
    if old is None or len(old) != len(new):
        return True

    def moved(a: float, b: float) -> bool:
        return max(a, b) > policy.hysteresis * min(a, b)

    return any(
        moved(o.forward_bytes_per_s, n.forward_bytes_per_s)
        or moved(o.backward_bytes_per_s, n.backward_bytes_per_s)
        or moved(o.compute_s, n.compute_s)
        for o, n in zip(old, new, strict=True)
    )


@dataclass(frozen=True)
class EpilogueFigures:
    """What one epilogue exchange's choice depends on (a stage's averaging, or the tied sync)."""

    bytes_per_s: float
    """The slowest member-to-member rate of the group (every member sends its message to every other at once,
    each on its own link, so the slowest link paces the exchange)."""
    elements: float
    """Elements of the summed gradient (a stage's parameters, or the tied weight's)."""
    step_s: float
    """The step's pipeline time without the epilogue, what `epilogue_share` is a share of."""
    members: int = 2
    """Members of the group: each encodes its own gradient once and decodes every member's message."""
    speed: CodecSpeed | None = field(default=None, compare=False)
    """How fast the codecs encode and decode (`swarm.scheduler.sizes.measure_codec_speed`); None: bytes alone."""
    cols: int | None = None
    """The row length of the matrix a low-rank codec factors (the hidden size: the tied weight's, or a stage sum's
    matrices' priced as rows of it); None: as the codec shapes a flat gradient."""

    def seconds(self, label: str) -> float:
        """One exchange under codec `label`: a member's message over the slowest link, plus with a measured `speed`
        one encode and `members` decodes of the whole gradient (on a fast link those set a sum's time: on this
        2-core machine, unshaped, a 2x2 swarm's 2-bit sums took 145 ms a step against fp32's 87 ms)."""
        message = epilogue_bytes(label, self.elements, self.cols)
        return message / self.bytes_per_s + self.elements * self.coding_s(label)

    def coding_s(self, label: str) -> float:
        """Seconds of one encode and `members` decodes per element under `label` (0 without a measured speed)."""
        return 0.0 if self.speed is None else self.speed.seconds_per_element(label, self.members)


@dataclass(frozen=True)
class CodecSpeed:
    """Seconds per element to encode and to decode each epilogue codec, measured on the planner's machine (the
    members' own machines do not announce theirs: the planner's stands for every member's)."""

    per_element: tuple[tuple[str, float, float], ...]
    """(label, encode seconds, decode seconds) per element, one per codec measured."""

    def seconds_per_element(self, label: str, members: int) -> float:
        """One encode and `members` decodes of one element under `label` (0 for a codec not measured)."""
        for name, encode_s, decode_s in self.per_element:
            if name == label:
                return encode_s + members * decode_s
        return 0.0


def epilogue_bytes(label: str, elements: float, cols: int | None = None) -> float:
    """Bytes of one member's epilogue message under codec `label`: its steady wire bits an element (scales aside),
    or a low-rank codec's factors of the matrix in rows of `cols` (its payload, scales included)."""
    from swarm.compression import CodecConfig, codec_class, make_codec

    config = CodecConfig.parse(label)
    if codec_class(config.name).ranked:
        return float(make_codec(replace(config, group_size=cols)).payload_nbytes(int(elements)))
    return float(elements) * config.wire_bits / 8


def _pick_epilogue(ladder: Sequence[str], floor: str, fig: EpilogueFigures, share: float) -> tuple[str, float]:
    """The most precise codec (down to `floor`) whose exchange takes at most the quickest one's plus `share` of the
    step: precision is worth that much step time. On bytes alone the quickest is the floor; with a measured speed, on
    a fast link, a wide codec can be quicker than a quantized one (its encoding costs more than its bytes save), and
    where the two are close (within the share) the precise one wins."""
    allowed = ladder[: ladder.index(floor) + 1]
    times = [fig.seconds(c) for c in allowed]
    bound = min(times) + share * fig.step_s
    label, seconds = next((c, t) for c, t in zip(allowed, times, strict=True) if t <= bound)
    return label, seconds


def choose_epilogue(
    average: Sequence[EpilogueFigures | None], tied: EpilogueFigures | None, policy: BitsPolicy = BitsPolicy()
) -> EpilogueCodecs:
    """Each stage's averaging codec (None for a stage with one replica: nothing is summed), the tied sync's (None
    without one), and why."""
    labels, why = [], []
    for s, fig in enumerate(average):
        if fig is None:
            labels.append(None)
            continue
        label, seconds = _pick_epilogue(AVERAGE_LADDER, policy.average_floor, fig, policy.epilogue_share)
        labels.append(label)
        why.append(f"avg{s} {label} {seconds * 1e3:.1f}ms")
    tied_label = None
    if tied is not None:
        tied_label, seconds = _pick_epilogue(TIED_LADDER, policy.tied_floor, tied, policy.epilogue_share)
        why.append(f"tied {tied_label} {seconds * 1e3:.1f}ms")
    step = max([f.step_s for f in (*average, tied) if f is not None], default=0.0)
    text = f"{', '.join(why)} (share {policy.epilogue_share:g} of {step * 1e3:.1f}ms)"
    return EpilogueCodecs(tuple(labels), tied_label, text[:MAX_CODEC_WHY])


def rechoose_epilogue(
    old: tuple[Sequence[EpilogueFigures | None], EpilogueFigures | None] | None,
    new: tuple[Sequence[EpilogueFigures | None], EpilogueFigures | None],
    policy: BitsPolicy = BitsPolicy(),
) -> bool:
    """Whether the epilogue's figures moved past the hysteresis since `old` (or its shape changed)."""
    if old is None or len(old[0]) != len(new[0]):
        return True

    def moved(a: EpilogueFigures | None, b: EpilogueFigures | None) -> bool:
        if a is None or b is None:
            return a is not b
        return any(
            max(x, y) > policy.hysteresis * min(x, y)
            for x, y in ((a.bytes_per_s, b.bytes_per_s), (a.step_s, b.step_s), (a.elements, b.elements))
        )

    return any(moved(a, b) for a, b in zip((*old[0], old[1]), (*new[0], new[1]), strict=True))


def codec_sizes(model, micro_batch_size: int) -> Callable[[str], float]:
    """Bytes of one micro-batch's boundary message per codec label, measured once per label
    (`sizes.message_bytes` on a `[micro_batch_size, seq_len, hidden]` tensor of `model`)."""
    from functools import cache

    from swarm.compression import CodecConfig
    from swarm.scheduler.sizes import message_bytes

    shape = (micro_batch_size, model.seq_len_tokens, model.boundary_dim)
    return cache(lambda label: float(message_bytes(CodecConfig.parse(label), shape)))


def ladder_rung(config, ladder: Sequence[str]) -> str | None:
    """The rung of `ladder` that `config` (a `CodecConfig`) is, its local options (group size unless the label sets
    one, zstd level, seed, buffer directory) aside, as a plan's label is applied over them; None if none is."""
    from swarm.compression import CodecConfig

    options = config.local_options()
    return next((label for label in ladder if CodecConfig.parse(label, **options) == config), None)


def flags_policy(forward, backward, base: BitsPolicy = BitsPolicy()) -> BitsPolicy | None:
    """The per-link policy a peer's --fw-codec/--bw-codec (`CodecConfig`s) ask for: the most compression its links
    may get. Codecs on the ladders are its floors (the defaults: the ladders' own floors; fp32: no compression at all,
    the sums and the tied sync in fp32 too, as the fixed policy sums behind fp32 links); None when either is not on
    its ladder (the links then keep the flags' codecs: per-link cannot choose around a codec it does not know)."""
    forward_floor, backward_floor = ladder_rung(forward, FORWARD_LADDER), ladder_rung(backward, BACKWARD_LADDER)
    if forward_floor is None or backward_floor is None:
        return None
    chosen = replace(base, forward_floor=forward_floor, backward_floor=backward_floor)
    return replace(chosen, average_floor="fp32", tied_floor="fp32") if backward_floor == "fp32" else chosen


def wire_bits_ladder(elements: float, policy: BitsPolicy = BitsPolicy()) -> LinkLadder:
    """`link_ladder` priced by each codec's steady wire bits for a message of `elements` (scales and zstd aside, no
    coding time): what `swarm plan --per-link` prices a scenario's model with, where no message of its shape is
    encoded."""
    from swarm.compression import CodecConfig

    return link_ladder(lambda label: (elements * CodecConfig.parse(label).wire_bits / 8, 0.0), policy)


def measured_link_ladder(model, micro_batch_size: int, policy: BitsPolicy = BitsPolicy()) -> LinkLadder:
    """`link_ladder` from one message of `model`'s boundary shape at `micro_batch_size`, encoded and decoded on this
    machine per rung (`sizes.measure_link_rungs`: about 0.1 s for the default model on this 2-core machine)."""
    from swarm.scheduler.sizes import measure_link_rungs

    labels = (*FORWARD_LADDER[: FORWARD_LADDER.index(policy.forward_floor) + 1],
              *BACKWARD_LADDER[: BACKWARD_LADDER.index(policy.backward_floor) + 1])  # fmt: skip
    figures = measure_link_rungs(labels, (micro_batch_size, model.seq_len_tokens, model.boundary_dim))
    return link_ladder(figures.__getitem__, policy)


def epilogue_codec_speed() -> Callable[[], CodecSpeed]:
    """How fast this process runs every epilogue codec (`AVERAGE_LADDER`, `TIED_LADDER`), measured once, when first
    called (`swarm.scheduler.sizes.measure_codec_speed`: about 0.2 s on this 2-core machine)."""
    from functools import cache

    from swarm.scheduler.sizes import measure_codec_speed

    return cache(lambda: measure_codec_speed((*AVERAGE_LADDER, *TIED_LADDER)))
