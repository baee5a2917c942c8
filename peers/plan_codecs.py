"""A plan's codec choices: each boundary's forward and backward codecs (`LinkCodecs`) and the epilogue's
(`EpilogueCodecs`: the replicas' gradient sums and the tied sync), as the planner publishes them
(`swarm.scheduler.bits`) and as the `CodecConfig`s their labels parse to.

A label is checked against the codec registry where it is made or read: known, at most _MAX_CODEC_LABEL characters,
and for the epilogue without sample buffers. `swarm.peers.plan.PlanDocument` carries them, one per boundary, and
answers which of them a stage runs (`link_configs`, `epilogue_configs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from swarm.compression import CodecConfig, codec_class
from swarm.peers.fields import fail, set_field

__all__ = ["MAX_CODEC_WHY", "EpilogueCodecs", "LinkCodecs"]

MAX_CODEC_WHY = 400
"""Characters of a codec choice's `why` text (the planner cuts its texts to it)."""
_MAX_CODEC_LABEL = 64


def _codec(r: str, key: str, label: Any) -> CodecConfig:
    """`label` as the `CodecConfig` it names: a string of at most _MAX_CODEC_LABEL characters `CodecConfig.parse`
    knows."""
    if type(label) is not str or not 0 < len(label) <= _MAX_CODEC_LABEL:
        raise fail(r, key, f"a codec label of at most {_MAX_CODEC_LABEL} characters", label)
    try:
        return CodecConfig.parse(label)
    except (ValueError, KeyError) as e:
        raise fail(r, key, "a known codec label", label) from e


def _epilogue_codec(r: str, key: str, label: Any) -> CodecConfig:
    """A codec label the averager can sum with: known, and without sample buffers (a gradient has no samples)."""
    config = _codec(r, key, label)
    if codec_class(config.name).uses_buffers:
        raise fail(r, key, "a codec without sample buffers", label)
    return config


def _why(r: str, why: Any) -> str | None:
    if why is not None and (type(why) is not str or len(why) > MAX_CODEC_WHY):
        raise fail(r, "why", f"text of at most {MAX_CODEC_WHY} characters", why)
    return why


@dataclass(frozen=True)
class LinkCodecs:
    """One boundary's codecs: what the stage before it sends forward and the stage after it sends back.

    The labels are kept as published (a label says more than `CodecConfig.label` prints: `+nr`, `+gN`); the
    configs are what they parse to, with no peer's options (`PlanDocument.link_configs` adds those)."""

    forward_label: str
    backward_label: str
    why: str | None = None
    """Why the planner chose them (`swarm.scheduler.bits.choose_link`), for logs."""
    forward: CodecConfig = dataclasses.field(init=False, compare=False, repr=False)
    backward: CodecConfig = dataclasses.field(init=False, compare=False, repr=False)
    where: dataclasses.InitVar[str] = "plan.codecs[?]"
    """How errors name it: `from_wire` names its boundary (`plan.codecs[1]`), a new one's is not known yet."""

    def __post_init__(self, where: str) -> None:
        set_field(self, "forward", _codec(where, "forward", self.forward_label))
        set_field(self, "backward", _codec(where, "backward", self.backward_label))
        _why(where, self.why)

    @classmethod
    def from_wire(cls, wire: Any, boundary: int) -> LinkCodecs:
        """Boundary `boundary`'s codecs from the wire; ValueError naming the field (`plan.codecs[1].forward`)."""
        if not isinstance(wire, dict) or not set(wire) <= {"forward", "backward", "why"}:
            raise fail("plan", f"codecs[{boundary}]", "a dict of forward, backward (and why)", wire)
        return cls(wire.get("forward"), wire.get("backward"), wire.get("why"), f"plan.codecs[{boundary}]")

    def to_wire(self) -> dict[str, Any]:
        out = {"forward": self.forward_label, "backward": self.backward_label}
        return out if self.why is None else {**out, "why": self.why}


@dataclass(frozen=True)
class EpilogueCodecs:
    """The codecs of the steps' epilogue (SEL, `swarm.scheduler.bits.choose_epilogue`): each stage's replicas'
    gradient sum and the tied embedding's sync, as published and as the `CodecConfig`s they parse to."""

    average_labels: tuple[str | None, ...]
    """Per stage: its replicas' sum's codec (None: one replica, or the averager's backward codec)."""
    tied_label: str | None = None
    """The tied sync's codec (None: none chosen)."""
    why: str | None = None
    average: tuple[CodecConfig | None, ...] = dataclasses.field(init=False, compare=False, repr=False)
    tied: CodecConfig | None = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        r = "plan.epilogue_codecs"
        if type(self.average_labels) not in (list, tuple):
            raise fail(r, "average", "a list of the stages' codecs", self.average_labels)
        set_field(self, "average_labels", tuple(self.average_labels))
        configs = [
            None if label is None else _epilogue_codec(r, f"average[{i}]", label)
            for i, label in enumerate(self.average_labels)
        ]
        set_field(self, "average", tuple(configs))
        set_field(self, "tied", None if self.tied_label is None else _epilogue_codec(r, "tied", self.tied_label))
        _why(r, self.why)

    @classmethod
    def from_wire(cls, wire: Any) -> EpilogueCodecs:
        if not isinstance(wire, dict) or not set(wire) <= {"average", "tied", "why"} or "average" not in wire:
            raise fail("plan", "epilogue_codecs", "a dict of average, tied (and why)", wire)
        return cls(wire["average"], wire.get("tied"), wire.get("why"))

    def to_wire(self) -> dict[str, Any]:
        out = {"average": list(self.average_labels), "tied": self.tied_label}
        return out if self.why is None else {**out, "why": self.why}
