"""The run's banned peers, as the planner learns them from the run's trainers: never planned again in this run.

A trainer evicts a peer whose replies keep failing or skipping steps (`swarm.runtime.suspects`) and announces it
in its `TrainerAnnouncement.banned`. The planner believes only trainers its current plan names (`trainer_ids`: in
an open run those come from the run's delegation, never from whoever announced), and remembers every ban for
as long as it plans, even after the trainer that announced it is gone: the planner treats a banned peer as
gone (`RunBans.update` in `Planner.round`), so the plan is repaired without it and it is never planned again.
A planner that takes over learns the bans again from the trainers' announcements.

A peer taking a stage over never copies its state from a banned peer (`trusted_sources`): the evicted liar is
still announced, still holds the stage it lied about (stale by the step its eviction re-ran, or poisoned), and
the replica the new plan keeps at that stage is the one to copy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Sequence

from swarm.peers.records import PlanRecord, TrainerAnnouncement

__all__ = ["RunBans", "announced_bans", "trusted_sources"]

log = logging.getLogger(__name__)


class RunBans:
    """Peers the run's trainers banned, remembered for the run (peer id -> the trainer that banned it)."""

    def __init__(self) -> None:
        self._banned: dict[str, str] = {}
        self._lock = threading.Lock()

    def update(self, trainers: Iterable[TrainerAnnouncement], plan: PlanRecord | None) -> frozenset[str]:
        """Learns the bans of `trainers` that `plan` names (none without a plan: no trainer is vouched for yet);
        returns every peer banned so far."""
        trusted = set(plan.document.trainer_ids or ()) if plan is not None else set()
        with self._lock:
            for trainer in trainers:
                if trainer.peer_id not in trusted:
                    continue
                for peer in trainer.banned:
                    if peer not in self._banned and peer != trainer.peer_id:
                        self._banned[peer] = trainer.peer_id
                        log.warning("peer %s banned for the run by trainer %s: planned no more", peer, trainer.peer_id)
            return frozenset(self._banned)

    @property
    def banned(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._banned)


def announced_bans(trainers: Iterable[TrainerAnnouncement], plan: PlanRecord | None) -> frozenset[str]:
    """The peers banned by the trainers `plan` names (as `RunBans.update` believes them, without memory)."""
    return RunBans().update(trainers, plan)


def trusted_sources(
    replicas: Sequence[str],
    held: Sequence[tuple[str, int]],
    new: PlanRecord | None,
    layers: tuple[int, int],
    banned: Collection[str],
) -> tuple[list[str], list[tuple[str, int]]]:
    """Where a peer taking over `layers` under plan `new` may copy their state from (`takeover_sources`' replicas
    and held copies, in its order): never a banned peer; first the replicas `new` still serves those layers with
    (an evicted liar's sibling holds the step that ran again without the liar), then the others (a peer leaving
    the plan hands its own stage over)."""
    serving = set()
    if new is not None:
        serving = {p for s in new.document.stages if (s.layer_start, s.layer_end) == tuple(layers) for p in s.peer_ids}
    kept = [h for h in replicas if h not in banned]
    kept.sort(key=lambda h: h not in serving)  # stable: the given order within each group
    return kept, [(h, n) for h, n in held if h not in banned]
