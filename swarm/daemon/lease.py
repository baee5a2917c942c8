"""How long the elected planner's lease runs: its configured length, stretched while its own renewals come late.

The planner renews its lease (`planner_until` in its announcement) every third of it. On a loaded machine the
renewal thread or its DHT store stalls for seconds; with a fixed 3 s lease the lease lapsed, the other delegated
planner took over, and the two flapped ("ignoring plan N: not the plan authority", issue 27's fifth pass). So the
lease follows the renewals' own pace, as a retransmission timer follows round trips: each renewal's gap since the
previous one (and the time its store took) is a sample, and the next lease is at least three times the largest
recent sample, within [the configured lease, `ceiling_s`]. It shrinks back by `decay` a renewal once they are
prompt again. The cost: a planner that dies while its lease is stretched is replaced within that longer lease
(at most `ceiling_s`), which is when a loaded swarm could not have told its death from a stall anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AdaptiveLease", "LEASE_CEILING_S"]

LEASE_CEILING_S = 30.0
"""The longest a stretched lease runs (readers accept up to `swarm.peers.records.MAX_PLANNER_LEASE_S`, 60 s)."""


@dataclass
class AdaptiveLease:
    """The next lease's length from the renewals so far (times in seconds, any one clock)."""

    floor_s: float
    """the configured lease (`--planner-lease-s`): never shorter"""
    ceiling_s: float = LEASE_CEILING_S
    decay: float = 0.9
    """factor a prompt renewal shrinks a stretched lease by"""
    length_s: float = field(init=False)
    _last: float | None = field(default=None, init=False)
    _store_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.ceiling_s = max(self.ceiling_s, self.floor_s)
        self.length_s = self.floor_s

    def claim(self, now: float) -> float:
        """A renewal at `now`: the length of the lease it claims (covering this renewal's lateness already)."""
        gap = 0.0 if self._last is None else now - self._last
        self._last = now
        need = 3.0 * max(gap, self._store_s, 0.0)
        self.length_s = min(self.ceiling_s, max(self.floor_s, need, self.length_s * self.decay))
        return self.length_s

    def stored(self, seconds: float) -> None:
        """The renewal's store took `seconds`: the next lease covers as long a store."""
        self._store_s = max(0.0, seconds)

    def forget(self) -> None:
        """No longer leading: the next term starts afresh (a gap across terms is no renewal's lateness)."""
        self._last, self._store_s, self.length_s = None, 0.0, self.floor_s
