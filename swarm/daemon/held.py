"""Checkpoint copies a peer holds for another stage, so a stage's state survives the loss of its only host.

Every `--replicate-every` steps each peer pulls (GetState) the state of its "buddy" stage (`buddy_of`: the next
peer in plan order that serves a different stage) and keeps it under `--checkpoint-dir/held/`, named by layer
range like any stage checkpoint (written atomically by `swarm.runtime.checkpoint`). It announces what it holds
(`PeerAnnouncement.held`: layer range and steps done), and GetState serves a held copy to a plan peer that asks
for that layer range (gRPC metadata `swarm-held-layers: START-END`). A peer taking over a stage whose replicas
are all gone picks the freshest copy (`freshest`: a surviving replica first, else the held copy with the most
steps done).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.peers.plan import PlanDocument
from swarm.runtime.checkpoint import FORMAT, checkpoint_handover, checkpoint_path, save_stage

__all__ = [
    "HELD_METADATA_KEY",
    "Copy",
    "HeldStore",
    "buddy_of",
    "fetch_held",
    "freshest",
    "parse_held_layers",
]

log = logging.getLogger("swarm.daemon.held")

HELD_METADATA_KEY = "swarm-held-layers"
"""GetState request metadata asking for a held copy by layer range, 'START-END'."""
_HELD_RE = re.compile(r"^(\d{1,5})-(\d{1,5})$")
MAX_HELD = 8
"""Held copies a peer keeps (and announces) at most; the oldest range is dropped past it."""


def parse_held_layers(metadata: Iterable[tuple[str, str | bytes]], n_layers: int) -> tuple[int, int] | None:
    """The layer range a GetState call asks a held copy of, or None if it asks for the served stage.

    Raises ValueError for a malformed or out-of-range value (the caller refuses the call with it)."""
    for key, value in metadata:
        if key != HELD_METADATA_KEY:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
        m = _HELD_RE.match(text[:16])
        if m is None or len(text) > 16:
            raise ValueError(f"{HELD_METADATA_KEY}: expected 'START-END', got {text[:16]!r}")
        start, end = int(m[1]), int(m[2])
        if not 0 <= start < end <= n_layers:
            raise ValueError(f"{HELD_METADATA_KEY}: [{start}, {end}) is not a layer range of {n_layers} layers")
        return start, end
    return None


class HeldStore:
    """The held copies under `directory` (`--checkpoint-dir/held`), named by layer range."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._steps: dict[tuple[int, int], int] = {}
        for path in sorted(self.directory.glob("layers-*-*.safetensors")):
            m = re.match(r"^layers-(\d{4})-(\d{4})\.safetensors$", path.name)
            if m:
                try:
                    tensors = checkpoint_handover(self.directory, int(m[1]), int(m[2]))
                    self._steps[(int(m[1]), int(m[2]))] = int(tensors["meta.steps_done"].max())
                except Exception as e:  # a foreign or torn file is skipped, never fatal
                    log.warning("held copy %s skipped: %s", path, e)

    def save(self, start: int, end: int, tensors: dict[str, torch.Tensor], plan_version: int = 0) -> bool:
        """Keeps `tensors` (a stage's GetState handover: `model.*`, `optim.*`, `meta.*`) as the copy of
        [start, end). A copy older than the one held is not written (False)."""
        steps = int(tensors["meta.steps_done"].max()) if "meta.steps_done" in tensors else 0
        if self._steps.get((start, end), -1) > steps:
            return False
        lr_step = int(tensors["meta.lr_step"].max()) if "meta.lr_step" in tensors else 0
        state = {k: v for k, v in tensors.items() if k.startswith(("model.", "optim.", "amp."))}
        metadata = {
            "format": FORMAT,
            "layer_start": str(start),
            "layer_end": str(end),
            "steps_done": str(steps),
            "lr_step": str(lr_step),
            "plan_version": str(plan_version),
            "saved_at": f"{time.time():.3f}",
        }
        if not save_stage(checkpoint_path(self.directory, start, end), state, metadata):
            return False
        self._steps[(start, end)] = steps
        while len(self._steps) > MAX_HELD:
            oldest = min(self._steps, key=lambda r: self._steps[r])
            checkpoint_path(self.directory, *oldest).unlink(missing_ok=True)
            del self._steps[oldest]
        return True

    def load(self, start: int, end: int) -> dict[str, torch.Tensor] | None:
        """The handover tensors of the held copy of [start, end), or None without one."""
        if (start, end) not in self._steps:
            return None
        return checkpoint_handover(self.directory, start, end)

    def held(self) -> tuple[tuple[int, int, int], ...]:
        """(layer_start, layer_end, steps_done) of every copy, for the announcement."""
        return tuple(sorted((s, e, n) for (s, e), n in self._steps.items()))


def buddy_of(plan: PlanDocument, peer_id: str) -> tuple[int, str] | None:
    """(stage index, holder id) whose state `peer_id` keeps a copy of: the next peer after it in plan order
    (stages in order, replicas in column order, then the standbys; wrapping) that serves a different stage."""
    order = [(i, p) for i, s in enumerate(plan.stages) for p in s.peer_ids]
    order += [(-1, p) for p in plan.unused_peer_ids]
    mine = [k for k, (_, p) in enumerate(order) if p == peer_id]
    if not mine:
        return None
    k = mine[0]
    for step in range(1, len(order)):
        stage, pid = order[(k + step) % len(order)]
        if stage >= 0 and stage != order[k][0]:
            return stage, pid
    return None


@dataclass(frozen=True)
class Copy:
    """One place a stage's state can be taken from."""

    peer_id: str
    steps_done: int
    replica: bool
    """A live replica serving the stage (True) or a held checkpoint copy (False)."""


def freshest(copies: Iterable[Copy]) -> Copy | None:
    """A surviving replica first (replicas are in step with each other), else the held copy with the most
    steps done (ties: lowest peer id, so every taker computes the same)."""
    copies = list(copies)
    replicas = [c for c in copies if c.replica]
    pool = replicas or copies
    if not pool:
        return None
    return min(pool, key=lambda c: (-c.steps_done, c.peer_id))


def fetch_held(channels, address: str, start: int, end: int, timeout_s: float = 120.0) -> dict[str, torch.Tensor]:
    """The held copy of layers [start, end) that the peer at `address` keeps (GetState with the held-range
    metadata); raises grpc.RpcError (NOT_FOUND when it holds none)."""
    from swarm.daemon.state_fetch import fetch_state

    return fetch_state(channels, address, 0, 0, timeout_s, metadata=((HELD_METADATA_KEY, f"{start}-{end}"),))
