"""Plan repair and growth: after a loss nobody but the replacement moves; a joiner becomes one more replica of
the busiest stage.

A full re-search after every loss or join would reshuffle layers across the swarm, and every moved peer pulls its
new layers' state over slow links. So:

- `repair_plan` keeps every surviving peer where it was (same stage, same replica index) and hands each lost
  place to a standby, which then pulls that stage's state from a surviving replica or a held checkpoint copy.
  Without a standby, a lost replica of a stage that keeps another one is simply dropped (the stage serves with
  fewer replicas), and a stage that lost all of them takes the last replica of the stage with the most (at
  least two). Only when that too is impossible does the planner search again.
- `grow_plan` makes each joiner (a live peer the plan does not name) one more replica of the busiest stage, the
  one with the most time per sample (its layers / the sum of its replicas' compute speeds), as long as the
  plan's routes (`swarm.peers.routes.n_routes`: the lcm of the replica counts) stay within `max_routes`. The
  joiner pulls that stage's state from a live replica and serves from the next step. The plan's own standbys
  (`unused_peer_ids`) stay standbys: they are the takeover reserve.

Pure functions of the plan (`swarm.peers.plan.PlanDocument`), deterministic (any planner computes the same
plan from the same announcements), so every case is unit-tested without a swarm.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Collection, Mapping, Sequence

from swarm.peers.plan import PlanDocument
from swarm.peers.routes import MAX_ROUTES, fits

__all__ = ["busiest_stage", "grow_plan", "repair_plan", "standby_pool"]


def standby_pool(plan: PlanDocument, alive: Collection[str], gone: Collection[str]) -> list[str]:
    """Live peers the plan does not use: its own standbys first (in the plan's order, they were there first),
    then joiners in id order (deterministic, so any planner computes the same repair)."""
    used, listed = plan.used_peers(), list(plan.unused_peer_ids)
    pool = [p for p in listed if p in alive and p not in gone and p not in used]
    joiners = sorted(p for p in alive if p not in gone and p not in used and p not in set(listed))
    return pool + joiners


def repair_plan(
    plan: PlanDocument, alive: Collection[str], gone: Collection[str] = (), order: Sequence[str] = ()
) -> PlanDocument | None:
    """The plan with every place of a gone peer given to a standby (or dropped, or re-assigned), everything
    else unchanged.

    Args:
        plan: the current plan.
        alive: peers announced now.
        gone: peers treated as gone even though announced (missed heartbeats, leaving).
        order: preferred standbys first (e.g. fastest first); others follow `standby_pool`'s order.

    Returns:
        The repaired plan (stages and standbys updated, everything else kept), or None when a stage
        lost every replica and neither a standby nor a stage with two or more replicas is left to fill it, or
        the result would need more than MAX_ROUTES routes: the caller searches a new plan then. A lost place
        takes the first standby (the plan's, then joiners); without one, a lost replica of a stage that keeps
        another is dropped, and a stage left empty takes the last replica of the stage with the most replicas
        (lowest stage on ties). The plan's standbys that are left stay listed (those that left are dropped);
        joiners not used are left out, for `grow_plan` to place.
    """
    gone = {str(p) for p in gone} | (plan.used_peers() - set(alive))
    pool = standby_pool(plan, alive, gone)
    preferred = [p for p in order if p in pool]
    pool = preferred + [p for p in pool if p not in preferred]
    listed = set(plan.unused_peer_ids)
    slots = [[None if p in gone else p for p in stage.peer_ids] for stage in plan.stages]
    # a stage that lost every replica takes a standby first (one each), then the other lost places in order
    for row in [r for r in slots if r and not any(r)]:
        if pool:
            row[0] = pool.pop(0)
    for row in slots:
        for k, pid in enumerate(row):
            if pid is None and pool:
                row[k] = pool.pop(0)
    rows = [[p for p in row if p is not None] for row in slots]  # unfilled places are dropped
    for row in rows:
        if row:
            continue
        donor = max(range(len(rows)), key=lambda d: (len(rows[d]), -d))
        if len(rows[donor]) < 2:
            return None
        row.append(rows[donor].pop())  # its last replica: the others keep their replica index
    if not fits([len(r) for r in rows]):
        return None
    stages = tuple(dataclasses.replace(s, peer_ids=tuple(row)) for s, row in zip(plan.stages, rows, strict=True))
    return plan.replace(stages=stages, unused_peer_ids=tuple(p for p in pool if p in listed))


def busiest_stage(plan: PlanDocument, speeds: Mapping[str, float], max_routes: int = MAX_ROUTES) -> int | None:
    """The stage one more replica helps most: the highest time per sample (layers / the sum of its replicas'
    layers/s; a peer without a known speed counts at the median), ties to the lowest stage, among the stages
    where one more replica keeps the plan within `max_routes` routes; None when there is no such stage."""
    known = [float(v) for v in speeds.values() if v and v > 0]
    typical = statistics.median(known) if known else 1.0
    counts = list(plan.replica_counts)
    best, best_time = None, -1.0
    for s, stage in enumerate(plan.stages):
        grown = counts[:s] + [counts[s] + 1] + counts[s + 1 :]
        if not fits(grown, max_routes):
            continue
        rate = sum(float(speeds.get(p) or typical) for p in stage.peer_ids)
        per_sample = (stage.layer_end - stage.layer_start) / max(rate, 1e-12)
        if per_sample > best_time:
            best, best_time = s, per_sample
    return best


def grow_plan(plan: PlanDocument, speeds: Mapping[str, float], max_routes: int = MAX_ROUTES) -> PlanDocument:
    """The plan with every joiner made one more replica of the busiest stage (`busiest_stage`), one at a time
    in id order, so each sees the stages the previous ones grew; nobody already serving moves.

    Args:
        plan: the (repaired) plan.
        speeds: peer id -> compute layers/s, from the announcements of the live peers: its keys that the plan
            neither uses nor lists as standbys are the joiners.
        max_routes: most routes the grown plan may need.

    Returns:
        The plan with the joiners appended to their stages' peers; a joiner no stage can take (every
        stage would need too many routes) is listed as a standby. The plan's standbys stay standbys.
    """
    named = plan.named_peers()
    for joiner in sorted(str(p) for p in speeds if str(p) not in named):
        s = busiest_stage(plan, speeds, max_routes)
        if s is None:
            plan = plan.replace(unused_peer_ids=(*plan.unused_peer_ids, joiner))
        else:
            grown = dataclasses.replace(plan.stages[s], peer_ids=(*plan.stages[s].peer_ids, joiner))
            plan = plan.replace(stages=(*plan.stages[:s], grown, *plan.stages[s + 1 :]))
    return plan
