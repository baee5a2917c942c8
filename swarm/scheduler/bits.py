"""Bits per link: each boundary's forward and backward codecs, chosen from the link's measured rate.

Rule (`choose_link`): the most precise codec pair whose transfer hides under the stages' compute, within a loss
budget. A boundary paces a step at max(compute, forward message time, backward message time) per micro-batch
(full-duplex links, `FullCost`); so on each direction take the widest codec of the ladder whose message time
stays under the slower adjacent stage's compute per micro-batch; if none does, the narrowest codec the loss
budget allows (the floor: the default codecs, acsgd2+ch+nr forward and gradq2+ef+rot+nr+cs+g1024 backward,
the settings the convergence experiment holds within budget). Slow links thus get fewer bits, fast links
more, up to fp32.

Re-choice (`rechoose`): a plan's codecs change only when some link's rate moved by more than `hysteresis`
(a factor) since the rates it was chosen from, or a stage's compute did: probes are noisy, and each switch of
an AQ-SGD codec restarts its buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "BACKWARD_LADDER",
    "FORWARD_LADDER",
    "BitsPolicy",
    "LinkFigures",
    "choose_codecs",
    "choose_link",
    "rechoose",
    "stage_link_codecs",
]

FORWARD_LADDER = ("fp32", "acsgd8+ch+nr", "acsgd4+ch+nr", "acsgd2+ch+nr")
"""Forward (activation) codecs, most precise first; the last is the default floor (`DEFAULT_FW_CODEC`): the
current family (the AQ-SGD paper's quantizer, channel groups, round to nearest) at 8, 4 and 2 bits."""
BACKWARD_LADDER = ("fp32", "gradq8+ef+rot+nr+cs+g1024", "gradq4+ef+rot+nr+cs+g1024", "gradq2+ef+rot+nr+cs+g1024")
"""Backward (activation-gradient) codecs, most precise first; the last is the default floor (`DEFAULT_BW_CODEC`):
error feedback, Hadamard rotation, round to nearest, 16-bit scales, groups of 1024, at 8, 4 and 2 bits."""


@dataclass(frozen=True)
class BitsPolicy:
    """The loss budget as a floor on each ladder, and how much a rate must move to re-choose."""

    forward_floor: str = FORWARD_LADDER[-1]
    backward_floor: str = BACKWARD_LADDER[-1]
    hysteresis: float = 1.5
    """Re-choose when a link's rate or a stage's compute changed by more than this factor."""
    headroom: float = 1.0
    """A message must take at most compute / headroom to count as hidden."""

    def __post_init__(self) -> None:
        if self.forward_floor not in FORWARD_LADDER or self.backward_floor not in BACKWARD_LADDER:
            raise ValueError("BitsPolicy: floors must be on the ladders")
        if not self.hysteresis > 1.0 or not self.headroom > 0:
            raise ValueError("BitsPolicy: hysteresis must be > 1 and headroom > 0")


@dataclass(frozen=True)
class LinkFigures:
    """What one boundary's choice depends on."""

    forward_bytes_per_s: float
    """Measured rate from the stage before the boundary to the one after it."""
    backward_bytes_per_s: float
    """Measured rate back."""
    compute_s: float
    """The slower adjacent stage's forward + backward per micro-batch."""


def _pick(ladder: Sequence[str], floor: str, rate: float, budget_s: float, size: Callable[[str], float]) -> str:
    allowed = ladder[: ladder.index(floor) + 1]
    for label in allowed:
        if size(label) / rate <= budget_s:
            return label
    return allowed[-1]


def choose_link(link: LinkFigures, message_bytes: Callable[[str], float], policy: BitsPolicy = BitsPolicy()) -> dict:
    """`{"forward": label, "backward": label, "why": text}` for one boundary (`message_bytes(label)`: bytes of
    one micro-batch's message under that codec, e.g. `planning.message_bytes` at the run's shape)."""
    budget = link.compute_s / policy.headroom
    fw = _pick(FORWARD_LADDER, policy.forward_floor, link.forward_bytes_per_s, budget, message_bytes)
    bw = _pick(BACKWARD_LADDER, policy.backward_floor, link.backward_bytes_per_s, budget, message_bytes)
    fw_s, bw_s = message_bytes(fw) / link.forward_bytes_per_s, message_bytes(bw) / link.backward_bytes_per_s
    hidden = "hidden under" if max(fw_s, bw_s) <= budget else "over (at the floor)"
    why = f"{fw}/{bw}: {fw_s * 1e3:.1f}/{bw_s * 1e3:.1f} ms per micro-batch, {hidden} {budget * 1e3:.1f} ms compute"
    return {"forward": fw, "backward": bw, "why": why}


def choose_codecs(
    links: Sequence[LinkFigures], message_bytes: Callable[[str], float], policy: BitsPolicy = BitsPolicy()
) -> list[dict]:
    """One `choose_link` per boundary, in pipeline order."""
    return [choose_link(link, message_bytes, policy) for link in links]


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


def stage_link_codecs(plan: dict, stage: int, default: tuple[str, str]) -> tuple[str, str, str, str]:
    """What stage `stage` of a (validated) plan puts on its boundary ends: (forward send, backward send, forward
    receive, backward receive) labels. It sends forward on boundary `stage` and receives backward there; it
    receives forward and sends backward on boundary `stage - 1`. Without "codecs", `default` (fw, bw) everywhere."""
    codecs = plan.get("codecs")
    if not codecs:
        fw, bw = default
        return fw, bw, fw, bw
    after = codecs[stage] if stage < len(codecs) else None
    before = codecs[stage - 1] if stage > 0 else None
    fw_send = after["forward"] if after else (before["forward"] if before else default[0])
    bw_recv = after["backward"] if after else (before["backward"] if before else default[1])
    fw_recv = before["forward"] if before else fw_send
    bw_send = before["backward"] if before else bw_recv
    return fw_send, bw_send, fw_recv, bw_recv


def stage_link_configs(plan: dict, stage: int, default: tuple) -> tuple:
    """`stage_link_codecs` as `CodecConfig`s; `default`: the peer's own (forward, backward) configs, kept as
    they are (their zstd level and other flags) wherever the plan names the same label."""
    from swarm.compression import CodecConfig

    labels = stage_link_codecs(plan, stage, (default[0].label, default[1].label))
    return tuple(
        c if label == c.label else CodecConfig.parse(label) for c, label in zip(default * 2, labels, strict=True)
    )


def codec_sizes(model, micro_batch_size: int) -> Callable[[str], float]:
    """Bytes of one micro-batch's boundary message per codec label, measured once per label
    (`planning.message_bytes` on a `[micro_batch_size, seq_len, hidden]` tensor of `model`)."""
    from functools import cache

    from swarm.compression import CodecConfig
    from swarm.daemon.planning import message_bytes

    shape = (micro_batch_size, model.seq_len_tokens, model.hidden_dim)
    return cache(lambda label: float(message_bytes(CodecConfig.parse(label), shape)))
