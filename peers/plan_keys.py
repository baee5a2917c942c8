"""The optional keys of a plan beside its stages, each checked whole before anyone follows the plan
(`swarm.peers.records.validate_plan` calls `validate_plan_keys`): per-link codecs, the epilogue's codecs
(selective compression), per-stage precisions (QSync), the frozen prefix (PipeTransformer) and what the plan's
relayed links add to its predicted step (`relay_extra_s`). Absent keys keep today's behaviour; a malformed one
raises ValueError naming the field."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_RELAY_EXTRA_S", "PLAN_PRECISIONS", "validate_plan_keys"]

PLAN_PRECISIONS = ("fp32", "bf16", "fp16")
"""What a plan's `precisions` may name (`swarm.runtime.precision.PRECISIONS`)."""
MAX_RELAY_EXTRA_S = 1e6
"""Largest `relay_extra_s` a plan may carry (a plan through a relay that cannot carry its links prices at it)."""


def _fail(record: str, name: str, expected: str, value: Any) -> ValueError:
    from swarm.peers.records import _fail as fail

    return fail(record, name, expected, value)


def validate_plan_keys(plan: dict, n_stages: int, n_layers: int) -> None:
    """Checks `plan`'s codecs, epilogue_codecs, precisions and frozen_layers for `n_stages` stages over `n_layers`
    layers. Raises ValueError naming the first bad field."""
    _validate_codecs(plan.get("codecs"), n_stages)
    _validate_epilogue_codecs(plan.get("epilogue_codecs"), n_stages)
    _validate_precisions(plan.get("precisions"), n_stages)
    _validate_frozen_layers(plan.get("frozen_layers"), n_layers)
    _validate_relay_extra(plan.get("relay_extra_s"))


def _validate_relay_extra(extra: Any) -> None:
    """A plan's `relay_extra_s` (optional; absent: no relayed link, `swarm.scheduler.relays.relay_extra_s`): a
    finite number of seconds in [0, MAX_RELAY_EXTRA_S]."""
    if extra is None:
        return
    ok = type(extra) in (int, float) and math.isfinite(extra) and 0 <= extra <= MAX_RELAY_EXTRA_S
    if not ok:
        raise _fail("plan", "relay_extra_s", f"a finite number of seconds in [0, {MAX_RELAY_EXTRA_S:g}]", extra)


def _validate_frozen_layers(frozen: Any, n_layers: int) -> None:
    """A plan's frozen prefix (optional, `swarm.runtime.freeze`): an int in [0, n_layers), the layers the stages
    cover (the last layer always trains)."""
    if frozen is not None and (type(frozen) is not int or not 0 <= frozen < n_layers):
        raise _fail("plan", "frozen_layers", f"an int in [0, {n_layers})", frozen)


_MAX_CODEC_LABEL = 64
MAX_CODEC_WHY = 400
"""Characters of a codec choice's `why` text (the planner cuts its texts to it)."""


def _label(r: str, key: str, label: Any):
    """`label` as the `CodecConfig` it names: a string of at most _MAX_CODEC_LABEL characters `CodecConfig.parse`
    knows."""
    from swarm.compression import CodecConfig

    if type(label) is not str or not 0 < len(label) <= _MAX_CODEC_LABEL:
        raise _fail(r, key, f"a codec label of at most {_MAX_CODEC_LABEL} characters", label)
    try:
        return CodecConfig.parse(label)
    except (ValueError, KeyError) as e:
        raise _fail(r, key, "a known codec label", label) from e


def _why(r: str, why: Any) -> None:
    if type(why) is not str or len(why) > MAX_CODEC_WHY:
        raise _fail(r, "why", f"text of at most {MAX_CODEC_WHY} characters", why)


def _validate_codecs(codecs: Any, n_stages: int) -> None:
    """A plan's per-link codecs (optional): one `{"forward": LABEL, "backward": LABEL[, "why": text]}` per
    boundary, every label one `CodecConfig.parse` knows."""
    if codecs is None:
        return
    if type(codecs) is not list or len(codecs) != n_stages - 1:
        raise _fail("plan", "codecs", f"a list of {n_stages - 1} boundaries' codecs", codecs)
    for i, link in enumerate(codecs):
        r = f"plan.codecs[{i}]"
        if not isinstance(link, dict) or not set(link) <= {"forward", "backward", "why"}:
            raise _fail("plan", f"codecs[{i}]", "a dict of forward, backward (and why)", link)
        for key in ("forward", "backward"):
            _label(r, key, link.get(key))
        _why(r, link.get("why", ""))


def _epilogue_label(r: str, key: str, label: Any) -> None:
    """A codec label the averager can sum with: known, and without sample buffers (a gradient has no samples)."""
    from swarm.compression import codec_class

    if codec_class(_label(r, key, label).name).uses_buffers:  # parsed: its name is a known codec
        raise _fail(r, key, "a codec without sample buffers", label)


def _validate_epilogue_codecs(chosen: Any, n_stages: int) -> None:
    """A plan's epilogue codecs (optional, SEL): `{"average": [LABEL | None per stage], "tied": LABEL | None[,
    "why": text]}`: each stage's replicas' sum and the tied sync (`swarm.scheduler.bits.choose_epilogue`)."""
    if chosen is None:
        return
    if not isinstance(chosen, dict) or not set(chosen) <= {"average", "tied", "why"} or "average" not in chosen:
        raise _fail("plan", "epilogue_codecs", "a dict of average, tied (and why)", chosen)
    average = chosen["average"]
    if type(average) is not list or len(average) != n_stages:
        raise _fail("plan.epilogue_codecs", "average", f"a list of {n_stages} stages' codecs", average)
    for i, label in enumerate(average):
        if label is not None:
            _epilogue_label("plan.epilogue_codecs", f"average[{i}]", label)
    tied = chosen.get("tied")
    if tied is not None:
        _epilogue_label("plan.epilogue_codecs", "tied", tied)
    _why("plan.epilogue_codecs", chosen.get("why", ""))


def _validate_precisions(precisions: Any, n_stages: int) -> None:
    """A plan's optional `precisions`: one name in PLAN_PRECISIONS per stage (absent: every stage computes in its
    peer's --precision). fp16 is all or none: its loss scale is agreed by every stage (`swarm.runtime.precision`),
    which a stage without scaling (scale 1) cannot agree to."""
    if precisions is None:
        return
    if type(precisions) is not list or len(precisions) != n_stages:
        raise _fail("plan", "precisions", f"a list of {n_stages} precisions, one per stage", precisions)
    for i, name in enumerate(precisions):
        if type(name) is not str or name not in PLAN_PRECISIONS:
            raise _fail("plan", f"precisions[{i}]", f"one of {PLAN_PRECISIONS}", name)
    if "fp16" in precisions and set(precisions) != {"fp16"}:
        raise _fail("plan", "precisions", "fp16 on every stage or on none (its loss scale is agreed)", precisions)
