"""Stage assignment without a planner (`swarm-peer --assign even`): which stage and layers a peer serves.

`EvenSplit` is the placeholder policy: peers ordered by when they joined (then by id) take stages in turn,
each stage an even slice of the layers. Every peer computes the same answer from the same announcements,
so nobody has to coordinate.
"""

from __future__ import annotations

from typing import Protocol

from swarm.model.gpt import split_layers
from swarm.peers.records import PeerAnnouncement
from swarm.runtime.host import StageRole


class Assigner(Protocol):
    def assign(self, peers: list[PeerAnnouncement], me: str) -> StageRole | None:
        """This peer's role given the peers currently announced, or None while it cannot tell yet."""
        ...


class EvenSplit:
    """The first `n_stages` peers by join order serve stages 0..n-1 with even layer ranges."""

    def __init__(self, n_stages: int, n_layers: int, fixed_stage: int | None = None):
        if not 1 <= n_stages <= n_layers:
            raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
        if fixed_stage is not None and not 0 <= fixed_stage < n_stages:
            raise ValueError(f"--stage {fixed_stage} is outside 0..{n_stages - 1}")
        self.n_stages, self.n_layers, self.fixed_stage = n_stages, n_layers, fixed_stage
        self.ranges = split_layers(n_layers, n_stages)

    def role(self, stage: int) -> StageRole:
        start, end = self.ranges[stage]
        return StageRole(stage, self.n_stages, start, end)

    def assign(self, peers: list[PeerAnnouncement], me: str) -> StageRole | None:
        if self.fixed_stage is not None:
            return self.role(self.fixed_stage)
        order = sorted(peers, key=lambda p: (p.started_at, p.peer_id))
        ids = [p.peer_id for p in order]
        if me not in ids or len(ids) < self.n_stages:
            return None
        index = ids.index(me)
        return self.role(index) if index < self.n_stages else None
