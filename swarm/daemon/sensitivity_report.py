"""What a peer announces of its stage's measured sensitivity (`PeerAnnouncement.sensitivity`), and when.

The stage's `SensitivityProbe` (`swarm.runtime.sensitivity_probe`) rates it from real gradients now and then; the
peer's plan loop asks `SensitivityReport.entries` each tick and re-announces only when there is something new to
say: a first figure, a figure for other layers (a new role), or a figure moved by more than `rel_change` since the
last announcement, at most every `min_interval_s` (announcements travel through the DHT; a re-plan they cause
switches the stages' precision, which should not flap).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["SensitivityReport"]


class SensitivityReport:
    """Decides when the served stage's probe figures are announced (see the module docstring)."""

    def __init__(
        self, min_interval_s: float = 5.0, rel_change: float = 0.25, clock: Callable[[], float] = time.monotonic
    ):
        self.min_interval_s, self.rel_change, self.clock = min_interval_s, rel_change, clock
        self.announced: tuple[tuple[int, int, str, float], ...] = ()
        self._at = -math.inf

    def entries(self, host) -> tuple[tuple[int, int, str, float], ...] | None:
        """The announcement's new `sensitivity` for `host` (a `StageHost`, or None between roles), or None when
        what was announced still holds."""
        probe = getattr(getattr(host, "worker", None), "probe", None)
        figures = probe.figures() if probe is not None else {}
        if not figures:
            return None
        layers = (host.role.layer_start, host.role.layer_end)
        entries = tuple((*layers, p, float(f)) for p, f in sorted(figures.items()))
        if entries == self.announced:
            return None
        before = {(a, b, p): f for a, b, p, f in self.announced}
        moved = any(
            (a, b, p) not in before or abs(f - before[(a, b, p)]) > self.rel_change * max(before[(a, b, p)], 1e-30)
            for a, b, p, f in entries
        )
        new_layers = any(key not in before for key in ((a, b, p) for a, b, p, _ in entries))
        if not moved or (not new_layers and self.clock() - self._at < self.min_interval_s):
            return None
        self.announced, self._at = entries, self.clock()
        return entries
