"""Field checks shared by every DHT record and the plan document: each raises ValueError naming the field.

Nothing read from the DHT is trusted, so a record's `from_wire` (and its constructor) checks the type, range and
length of every field with these. `bool` is never a number here: it is an int subclass in Python, but on the
wire it is a different type and never a valid count or figure.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = [
    "MAX_LAYERS",
    "MAX_PLAN_VERSION",
    "PEER_ID_RE",
    "fail",
    "float_field",
    "int_field",
    "peer_id_field",
    "set_field",
    "str_field",
]

MAX_LAYERS = 1 << 20
"""Most layers a record may name."""
MAX_PLAN_VERSION = 1 << 53
"""Highest plan version: far below msgpack's int64, so `version + 1` always fits (and survives a float)."""
PEER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A peer (or trainer) id: 1-64 characters of [A-Za-z0-9._-], not starting with a dot, dash or underscore."""


def fail(record: str, name: str, expected: str, value: Any) -> ValueError:
    """The error for field `record.name`: what was expected and (cut to 80 characters) what came."""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ValueError(f"{record}.{name}: expected {expected}, got {shown}")


def int_field(record: str, name: str, value: Any, lo: int, hi: int) -> int:
    """`value` when it is an int (not a bool) in [lo, hi]."""
    if type(value) is not int or not lo <= value <= hi:
        raise fail(record, name, f"an int in [{lo}, {hi}]", value)
    return value


def float_field(record: str, name: str, value: Any, lo: float, hi: float) -> float:
    """`value` as a float when it is a finite int or float (not a bool) in [lo, hi]."""
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise fail(record, name, f"a finite number in [{lo:g}, {hi:g}]", value)
    return float(value)


def str_field(record: str, name: str, value: Any, pattern: re.Pattern[str], what: str) -> str:
    """`value` when it is a str that `pattern` matches whole."""
    if type(value) is not str or pattern.fullmatch(value) is None:
        raise fail(record, name, what, value)
    return value


def peer_id_field(record: str, name: str, value: Any) -> str:
    """`value` when it is a peer id (`PEER_ID_RE`)."""
    return str_field(record, name, value, PEER_ID_RE, "a peer id of 1-64 characters [A-Za-z0-9._-]")


def set_field(obj: object, name: str, value: Any) -> None:
    """Sets a field of a frozen dataclass in its `__post_init__` (a normalized value)."""
    object.__setattr__(obj, name, value)
