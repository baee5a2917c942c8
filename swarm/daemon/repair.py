"""Plan repair: after a loss, the dead (or leaving) peer's place goes to a standby and nobody else moves.

A full re-search after every loss would reshuffle layers across the swarm, and every moved peer pulls its new
layers' state over slow links. A repair keeps every surviving peer where it was (same stage, same column, so
same chain) and hands each lost place to a standby, which then pulls that stage's state from a surviving
replica or a held checkpoint copy. Only when there are fewer standbys than lost places does the planner search
again (fewer replicas or stages). Joins never move anyone either: a joiner waits on standby until a repair, a
re-plan or a new column uses it (`grow_plan`: once there are as many standbys as stages, they form one more
chain, up to the run's --replicas).

Pure functions of the plan dict (the `PlanRecord.plan` JSON form), so every case is unit-tested without a swarm.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["grow_plan", "plan_columns", "repair_plan", "standby_pool"]


def plan_columns(plan: dict) -> list[list[str]]:
    """The plan's chains: column r is `peer_ids[r]` of every stage, in stage order."""
    stages = plan.get("stages", [])
    if not stages:
        return []
    replicas = min(len(s.get("peer_ids", [])) for s in stages)
    return [[str(s["peer_ids"][r]) for s in stages] for r in range(replicas)]


def standby_pool(plan: dict, alive: Collection[str], gone: Collection[str]) -> list[str]:
    """Live peers the plan does not use: its own standbys first (in the plan's order, they were there first),
    then joiners in id order (deterministic, so any planner computes the same repair)."""
    used = {str(p) for s in plan.get("stages", []) for p in s.get("peer_ids", [])}
    listed = [str(p) for p in plan.get("unused_peer_ids", [])]
    pool = [p for p in listed if p in alive and p not in gone and p not in used]
    joiners = sorted(p for p in alive if p not in gone and p not in used and p not in set(listed))
    return pool + joiners


def repair_plan(
    plan: dict, alive: Collection[str], gone: Collection[str] = (), order: Sequence[str] = ()
) -> dict | None:
    """The plan with every place of a gone peer given to a standby, everything else unchanged.

    Args:
        plan: the current plan (`PlanRecord.plan`).
        alive: peers announced now.
        gone: peers treated as gone even though announced (missed heartbeats, leaving).
        order: preferred standbys first (e.g. fastest first); others follow `standby_pool`'s order.

    Returns:
        The repaired plan (stages and `unused_peer_ids` updated, every other key kept; standbys that left are
        dropped and joiners listed as standbys), or None when a lost place has no standby to take it: the
        caller searches a new plan then.
    """
    gone = {str(p) for p in gone} | ({str(p) for s in plan.get("stages", []) for p in s["peer_ids"]} - set(alive))
    pool = standby_pool(plan, alive, gone)
    preferred = [p for p in order if p in pool]
    pool = preferred + [p for p in pool if p not in preferred]
    stages = []
    for stage in plan.get("stages", []):
        ids = []
        for pid in map(str, stage["peer_ids"]):
            if pid in gone:
                if not pool:
                    return None
                pid = pool.pop(0)
            ids.append(pid)
        stages.append({**stage, "peer_ids": ids})
    return {**plan, "stages": stages, "unused_peer_ids": pool}


def grow_plan(plan: dict, replicas: int) -> dict:
    """The plan with new columns (chains) of standbys, one standby per stage each, while there are enough
    standbys and fewer than `replicas` columns; nobody already serving moves."""
    stages = [dict(s, peer_ids=list(s["peer_ids"])) for s in plan.get("stages", [])]
    pool = [str(p) for p in plan.get("unused_peer_ids", [])]
    while stages and len(stages[0]["peer_ids"]) < replicas and len(pool) >= len(stages):
        for stage in stages:
            stage["peer_ids"].append(pool.pop(0))
    return {**plan, "stages": stages, "unused_peer_ids": pool}
