"""Who the planner lets into a plan: a joiner is planned once it proved it can be reached, and a planned peer
that never follows its plan is planned without and held back.

An announcement is a claim anyone can store. In issue 27's relay-slot-fill run 56 strangers announced themselves
behind relays that did not hold them; the planner grew each batch into the plan as extra replicas the moment it
saw them, found them silent 3-5 s later, repaired, and grew the next batch (plans 2 to 23). The trainer runs a
plan once every peer it names follows it (`PlanDocument.route_of`), and every plan named a stranger, so no
pipeline was whole for three minutes: the run stopped at step 9. So:

- `unproven`: a peer the current plan does not name yet counts as live only once the planner's heartbeats reached
  it (`Liveness.answered`). Until then it neither grows the plan nor makes the planner re-plan.
- `JoinWatch`: a peer a published plan names in a stage for the first time (a grown replica, a standby taking a
  lost place, every peer of a first plan) must announce that it follows that plan, or a later one, within
  `JoinConfig.deadline_s` (60 s of the planner's own schedule). One that does not (it answers pings but never
  fetches its state or switches) is planned without (gone: the plan is repaired) and held back from plans for
  `hold_s`, doubled at every further miss. What is left (`docs/SECURITY.md`): while a planned joiner has not
  followed, the trainer waits for the plan (up to the deadline), so fresh keys that answer pings but never switch
  can each cost one deadline.

Pure bookkeeping over announcements and plans, with an injected clock: unit-tested without processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from swarm.peers.records import PeerAnnouncement, PlanRecord

__all__ = ["JoinConfig", "JoinWatch", "unproven"]

log = logging.getLogger("swarm.daemon.joiners")


def unproven(alive: Collection[str], named: Collection[str], answered: Callable[[str], bool], me: str) -> set[str]:
    """The live peers the plan does not name (`named`: its stages and standbys) that have not answered the
    planner's heartbeats yet (`answered`, e.g. `Liveness.answered`); the planner itself (`me`) needs no proof."""
    return {p for p in alive if p not in named and p != me and not answered(p)}


@dataclass(frozen=True)
class JoinConfig:
    deadline_s: float = 60.0
    """How long a peer newly named in a plan's stages may take to announce that it follows that plan (its state
    pulled, its stage loaded), seconds of the planner's own schedule (`Liveness.schedule_s`: its stalls on a
    loaded machine do not count); the trainer waits for the plan meanwhile."""
    hold_s: float = 120.0
    """How long a peer that missed its deadline is left out of plans, seconds; doubled at each further miss."""
    max_hold_s: float = 3600.0
    """The longest hold, seconds."""

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.hold_s <= 0 or self.max_hold_s < self.hold_s:
            raise ValueError("JoinConfig: need deadline_s > 0, hold_s > 0 and max_hold_s >= hold_s")


class JoinWatch:
    """The planner's watch over peers newly named in its plans: `update` returns the peers to plan without."""

    def __init__(self, cfg: JoinConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg or JoinConfig(), clock
        self._pending: dict[str, tuple[int, float]] = {}
        """peer -> (the plan version that first named it in a stage, when the watch first saw that)"""
        self._joined: set[str] = set()
        """peers of the plan that followed it (or a later one) since they were named: no longer watched"""
        self._held: dict[str, float] = {}
        """peer -> until when (the watch's clock) it is left out of plans"""
        self._misses: dict[str, int] = {}
        """peer -> deadlines it missed in this run (each doubles its next hold)"""

    def update(self, current: PlanRecord | None, peers: Iterable[PeerAnnouncement]) -> frozenset[str]:
        """Looks at the plan the planner holds (`current`) and the announcements (`peers`); returns the peers held
        back now: those that missed their deadline, for their hold."""
        now = self.clock()
        if current is not None:
            following = {p.peer_id: p.plan_version for p in peers}
            used = current.document.used_peers()
            self._joined &= used
            self._pending = {p: v for p, v in self._pending.items() if p in used}  # dropped by a repair: forgotten
            for pid in sorted(used - self._joined - set(self._held)):
                version, since = self._pending.setdefault(pid, (current.version, now))
                if following.get(pid, 0) >= version:
                    self._joined.add(pid)
                    del self._pending[pid]
                elif now - since > self.cfg.deadline_s:
                    self._miss(pid, version, now - since, now)
        self._held = {p: until for p, until in self._held.items() if until > now}
        return frozenset(self._held)

    def _miss(self, pid: str, version: int, waited_s: float, now: float) -> None:
        misses = self._misses.get(pid, 0)
        hold_s = min(self.cfg.hold_s * 2**misses, self.cfg.max_hold_s)
        self._misses[pid] = misses + 1
        self._held[pid] = now + hold_s
        del self._pending[pid]
        log.warning(
            "peer %s was named by plan %d and does not follow it after %.0f s: planned without, held back %.0f s",
            pid,
            version,
            waited_s,
            hold_s,
        )
