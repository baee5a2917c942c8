"""Routes through stages with uneven replica counts: which replica of every stage a micro-batch travels.

Stage s of a plan has R_s replicas (column r of `peer_ids`). With equal counts R, route c is column c of every
stage. With uneven counts (a joiner became one more replica of the busiest stage) there are
C = lcm(R_0, ..., R_{K-1}) routes, and route c runs on replica `c % R_s` of stage s. Every replica of stage s
then carries exactly C / R_s routes, so equally weighted routes load the replicas of each stage evenly, and
c -> (c % R_s)_s is one-to-one on [0, C), so no two routes are the same peers.

A replica shared by several routes runs the micro-batches of all of them in one step. Its schedule gate,
worker and labels number those micro-batches 0..n-1 in (route, position in the route) order: `stage_numbering`
computes that index and count for every stage, and the driver sends them in `CallInfo.stage_micro` and
`stage_micro_count`. Each replica's order is the same global (route, position) order restricted to its own
micro-batches, so the replicas' schedules agree with each other. With equal counts the fields stay empty and
`micro_batch` / `num_micro_batches` hold at every stage, as before.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_ROUTES",
    "PlanRoutes",
    "Route",
    "fits",
    "local_micro",
    "n_routes",
    "route_replicas",
    "stage_numbering",
    "uneven",
]

MAX_ROUTES = 12
"""Most routes a plan may have (lcm of its replica counts): a planner adds no replica that would need more."""


@dataclass(frozen=True)
class Route:
    """Route `index` of a plan: one replica of every stage (`route_replicas`), in stage order, the path a trainer's
    micro-batches take through the replicas (with equal replica counts R, route r is column r of every stage)."""

    index: int
    """the route's number c in [0, lcm(R_s)) (the wire's `CallInfo.chain`)"""
    addresses: tuple[str, ...]
    """address of each stage's replica, in pipeline order"""
    peers: tuple[str, ...]
    """peer id of each stage's replica, same order"""

    @property
    def key(self) -> bytes:
        """Names the route by its peers, not its number: a re-plan that keeps the same peers on a route keeps its
        samples (and AQ-SGD buffers) on it."""
        return hashlib.sha256("\0".join(self.peers).encode()).digest()


@dataclass(frozen=True)
class PlanRoutes:
    """Every route a trainer drives under a plan: every replica of every stage at its announced address, all
    following the same plan, with the plan's figures the trainer reports.

    Stages may have different replica counts (a joiner became one more replica of the busiest stage): the
    trainer then drives the lcm of them (route c runs on replica c % R_s of stage s, `route_replicas`).
    `swarm.peers.plan.PlanDocument.route_of` makes one from a plan and the announcements.
    """

    addresses: list[str]
    """gRPC address of each stage's replica 0, in pipeline order (route 0: what callers of one route use)."""
    peer_ids: list[str]
    plan_version: int = 0
    """The plan they follow (0: an even split by join order, no plan)."""
    replica_addresses: tuple[tuple[str, ...], ...] = ()
    """`[stage][replica]`, rows of different lengths when the counts are uneven (empty: one replica per stage,
    `addresses`)."""
    replica_peer_ids: tuple[tuple[str, ...], ...] = ()
    predicted_step_s: float | None = None
    """The plan's predicted step time (`PlanDocument.predicted_step_s`); None for an even split by join order."""
    frozen_layers: int = 0  # the plan's frozen prefix: its stages start with it (swarm.daemon.repack)
    relay_extra_s: float | None = None  # the plan's: what its relayed links add to predicted_step_s (None: none)

    @property
    def replica_counts(self) -> tuple[int, ...]:
        """Replicas of every stage, in stage order."""
        if self.replica_peer_ids:
            return tuple(len(row) for row in self.replica_peer_ids)
        return (1,) * len(self.peer_ids)

    @property
    def n_replicas(self) -> int:
        """The most replicas any stage has: 1 exactly when the plan has one route."""
        return max(self.replica_counts, default=1)

    def nested(self) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]]:
        """(addresses, peer ids) as `[stage][replica]`, for `PipelineDriver`'s nested form."""
        if self.replica_addresses:
            return self.replica_addresses, self.replica_peer_ids
        return tuple((a,) for a in self.addresses), tuple((p,) for p in self.peer_ids)

    def describe(self) -> str:
        """Every stage's replicas by address, e.g. '2 stages over 3 peers: stage 0 at A, C; stage 1 at B'."""
        addresses, _ = self.nested()
        stages = "; ".join(f"stage {s} at {', '.join(row)}" for s, row in enumerate(addresses))
        return f"{len(addresses)} stages over {sum(len(row) for row in addresses)} peers: {stages}"

    def routes(self) -> tuple[Route, ...]:
        """Each `Route` (one replica of every stage) in route order."""
        addresses, peers = self.nested()
        counts = self.replica_counts
        return tuple(
            Route(c, tuple(addresses[s][r] for s, r in enumerate(at)), tuple(peers[s][r] for s, r in enumerate(at)))
            for c, at in ((c, route_replicas(c, counts)) for c in range(n_routes(counts)))
        )

    def driver_args(self) -> tuple:
        """What `PipelineDriver(route, peers, ...)` takes: flat with one replica per stage (every driver takes
        that), nested `[stage][replica]` otherwise (rows of different lengths when uneven)."""
        if self.n_replicas == 1:
            return list(self.addresses), list(self.peer_ids)
        return tuple(map(list, self.replica_addresses)), tuple(map(list, self.replica_peer_ids))


def _counts(counts: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(c) for c in counts)
    if not out or any(c < 1 for c in out):
        raise ValueError(f"replica counts: every stage needs at least one replica, got {list(out)}")
    return out


def n_routes(counts: Sequence[int]) -> int:
    """The number of routes of a plan with `counts[s]` replicas of stage s: their least common multiple.

    Raises:
        ValueError: a stage without replicas, or more than MAX_ROUTES routes.
    """
    c = math.lcm(*_counts(counts))
    if c > MAX_ROUTES:
        raise ValueError(f"replica counts {list(counts)} need {c} routes, more than {MAX_ROUTES}")
    return c


def fits(counts: Sequence[int], max_routes: int = MAX_ROUTES) -> bool:
    """Whether a plan with `counts[s]` replicas of stage s is servable: every stage has a replica and the
    routes (their lcm) are at most `max_routes` (the check `n_routes` raises on, as a yes or no)."""
    counts = tuple(int(c) for c in counts)
    return bool(counts) and min(counts) >= 1 and math.lcm(*counts) <= max_routes


def uneven(counts: Sequence[int]) -> bool:
    """Whether the stages have different replica counts (then calls carry per-stage micro-batch numbers)."""
    return len(set(_counts(counts))) > 1


def route_replicas(route: int, counts: Sequence[int]) -> tuple[int, ...]:
    """The replica of every stage that route `route` runs on: `route % counts[s]`."""
    counts = _counts(counts)
    if not 0 <= route < n_routes(counts):
        raise IndexError(f"route {route}: a plan with replica counts {list(counts)} has {n_routes(counts)} routes")
    return tuple(route % r for r in counts)


def stage_numbering(
    micro_per_route: dict[int, int], counts: Sequence[int]
) -> dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each micro-batch's index at, and the micro-batch count of, its route's replica of every stage.

    Args:
        micro_per_route: route -> how many micro-batches it runs this step (routes left out run none).
        counts: replicas of each stage.

    Returns:
        (route, k) -> (stage_micro, stage_micro_count): for micro-batch k of `route`, per stage s its index
        among the micro-batches of replica `route % counts[s]` (ordered by route, then k) and their number.
    """
    counts = _counts(counts)
    for route in micro_per_route:
        route_replicas(route, counts)  # raises for a route the plan does not have
    out: dict[tuple[int, int], tuple[list[int], list[int]]] = {
        (c, k): ([], []) for c in sorted(micro_per_route) for k in range(micro_per_route[c])
    }
    for r_s in counts:
        seen: dict[int, int] = {}  # replica -> micro-batches numbered so far
        for c, k in out:  # (route, k) order
            replica = c % r_s
            out[(c, k)][0].append(seen.get(replica, 0))
            seen[replica] = seen.get(replica, 0) + 1
        for c, k in out:
            out[(c, k)][1].append(seen[c % r_s])
    return {key: (tuple(a), tuple(b)) for key, (a, b) in out.items()}


def local_micro(info, stage: int) -> tuple[int, int]:
    """(index, count) of a call's micro-batch at `stage`'s replica: from `stage_micro` / `stage_micro_count`
    when the call carries them, else `micro_batch` / `num_micro_batches` (equal replica counts)."""
    if len(info.stage_micro):
        return int(info.stage_micro[stage]), int(info.stage_micro_count[stage])
    return int(info.micro_batch), int(info.num_micro_batches or 1)
