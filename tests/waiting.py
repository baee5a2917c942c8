"""Waiting on a condition in a test: polled until it holds or a deadline passes (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable

WAIT_S = 30.0
"""How long a test waits for a condition by default: far past any loaded machine's delay, short of a hang."""


def until(condition: Callable[[], object], what: str, timeout_s: float = WAIT_S) -> None:
    """Returns once `condition()` is true; fails naming `what` if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
