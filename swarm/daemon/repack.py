"""PipeTransformer's elastic repack (AutoPipe + AutoDP) for a live plan: when the frozen prefix grows, pack the
layers onto fewer stages and give the freed peers to the remaining stages as replicas where they bring compute
of their own (else they stand by).

A frozen layer costs `frozen_cost` of an active one (forward only; nothing once its outputs are cached at the
boundary, `swarm.runtime.freeze.cached_forward`). Like AutoPipe, the stage count is halved (S, S/2, S/4, ...,
each a contiguous split minimising the costliest stage) while no stage costs more than the costliest stage of
the plan with every layer active: what a peer has shown it can carry, in compute and in memory per micro-batch
(frozen layers hold no gradients or optimizer state). The plan's peers are dealt out to the chosen stages, each
further peer to the stage with the highest cost per replica. Fewer stages: fewer boundaries, fewer bytes, a
smaller pipeline bubble, and more data parallelism.

`repack_plan` returns the next plan (same peers, new stages, `frozen_layers` set, per-link codecs dropped
when the boundaries change; while the prefix allows no fewer stages, the same stages with the prefix set); the
live planner publishes it as a new version like a repair, and every peer follows it through the same
re-planning as joins and leaves (state over GetState). A prefix that moves no layer is not published on its
own: each such version cost the trainer a re-plan (0.25-1.2 s in `swarm experiment freezing`, three of them
before the repack) for stages that had already applied it. The watch holds it instead (`RepackWatch.frozen`),
and the planner reads its current plan through `RepackWatch.carried`, so the next plan it publishes for any
reason (the repack, a repair, a re-search, a recalibration) carries it, and hosts built for that plan start
frozen. A planner elected afresh holds nothing until its own first reading of the stages.

When: `RepackWatch` (the elected planner's, `Planner.round`) reads every plan peer's `Status`, where each stage
reports the prefix it applied (`swarm_frozen_layers`, set by `swarm.runtime.freeze.apply_frozen` after the
trainer's Step). Only when every peer of every stage answers as that stage of that very plan version, with the
same whole number F in [0, n_layers) above the plan's `frozen_layers`, does it publish `repack_plan(plan, F)`: a
stranger's figure is never read (only the plan's peers, at their announced addresses), a lagging or malformed
one holds the repack back, and one answer cannot move it. Peers built for the new plan start frozen
(`swarm.daemon.peer`: `apply_frozen` on every new host), so no frozen layer trains for even one step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from swarm.peers.plan import PlanDocument, PlanStage

__all__ = [
    "RepackWatch", "frozen_figure", "layer_costs", "split_by_cost", "repack_layout", "repack_plan", "with_frozen"
]  # fmt: skip

log = logging.getLogger("swarm.daemon.repack")

FROZEN_METRIC = "swarm_frozen_layers"


def layer_costs(n_layers: int, frozen_layers: int, frozen_cost: float = 1 / 3) -> list[float]:
    """Relative cost per layer: `frozen_cost` for the frozen prefix, 1 for the active layers."""
    if not 0 <= frozen_layers < n_layers:
        raise ValueError(f"frozen_layers {frozen_layers} is outside [0, {n_layers})")
    return [frozen_cost if i < frozen_layers else 1.0 for i in range(n_layers)]


def split_by_cost(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage (each at least one layer), minimising the costliest stage (DP)."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least bottleneck of layers [0, i) on k stages; cut[k][i]: where the k-th stage starts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges, i = [], n
    for k in range(n_stages, 0, -1):
        ranges.append((cut[k][i], i))
        i = cut[k][i]
    return ranges[::-1]


def _deal(stage_costs: Sequence[float], n_peers: int) -> list[int]:
    """Replicas per stage: one each, then each further peer to the stage with the highest cost per replica."""
    counts = [1] * len(stage_costs)
    for _ in range(n_peers - len(stage_costs)):
        s = max(range(len(counts)), key=lambda k: (stage_costs[k] / counts[k], -k))
        counts[s] += 1
    return counts


def repack_layout(
    n_layers: int,
    frozen_layers: int,
    n_peers: int,
    stage_limit: float,
    max_stages: int,
    frozen_cost: float = 1 / 3,
) -> tuple[list[tuple[int, int]], list[int]]:
    """(layer ranges, replicas per stage): the fewest stages among max_stages, /2, /4, ... whose costliest stage
    costs at most `stage_limit` (what one peer carried before: its compute and memory per micro-batch), the
    `n_peers` peers dealt out as replicas by cost."""
    if not 1 <= max_stages <= n_peers:
        raise ValueError(f"need 1 <= max_stages ({max_stages}) <= n_peers ({n_peers})")
    costs = layer_costs(n_layers, frozen_layers, frozen_cost)
    s, chosen = min(max_stages, n_layers), None
    while s >= 1:
        ranges = split_by_cost(costs, s)
        stage_costs = [sum(costs[a:b]) for a, b in ranges]
        if chosen is None or max(stage_costs) <= stage_limit + 1e-9:
            chosen = ranges, _deal(stage_costs, n_peers)
        else:
            break
        s //= 2
    return chosen


def repack_plan(
    plan: PlanDocument,
    frozen_layers: int,
    frozen_cost: float = 1 / 3,
    compute_keys: Mapping[str, str] | None = None,
) -> PlanDocument:
    """The next plan for a grown frozen prefix: the plan's peers (in stage order) re-dealt onto the repacked
    stages. Codecs per boundary and what else was made for the old stages are dropped when the stage count
    changes (`PlanDocument.with_stages`; the planner may choose them anew).

    A freed peer becomes a replica only if it brings compute of its own: one whose announced `compute_key`
    (`swarm.runtime.device.compute_key`) a peer kept in the plan already has (CPU peers of one machine and CPU
    set) would split that hardware's time with it and add only the replicas' sum, so it stands by instead
    (`unused_peer_ids`, there for repairs). `compute_keys`: peer id -> key; a peer without one ("" or absent)
    counts as its own hardware.

    While the prefix does not yet allow fewer stages, the plan keeps its own stages and only carries the
    prefix: a rebalance alone would move layers between peers (state transfers, AQ-SGD buffers and the
    activation cache started over) for a bottleneck no lower than the all-active plan's, which bounds it."""
    peers = [pid for stage in plan.stages for pid in stage.peer_ids]
    limit = max(len(stage.layers) for stage in plan.stages)  # all layers active: cost 1 each
    ranges, counts = repack_layout(plan.n_layers, frozen_layers, len(peers), limit, plan.n_stages, frozen_cost)
    if len(ranges) == plan.n_stages:
        return plan.replace(frozen_layers=frozen_layers)
    dealt, at = [], 0
    for count in counts:
        dealt.append(peers[at : at + count])
        at += count
    keys = compute_keys or {}
    used = {keys.get(group[0], "") for group in dealt} - {""}  # every stage keeps its first peer
    new, standby = [], []
    for (start, end), (first, *further) in zip(ranges, dealt, strict=True):
        replicas = [first]
        for pid in further:
            key = keys.get(pid, "")
            if key in used:
                standby.append(pid)
            else:
                replicas.append(pid)
                used |= {key} - {""}
        new.append(PlanStage(start, end, tuple(replicas)))
    if standby:
        log.info("repack: %s stand by (their hardware already computes for the plan)", ", ".join(standby))
    return plan.with_stages(new).replace(frozen_layers=frozen_layers, unused_peer_ids=(*plan.unused_peer_ids, *standby))


def with_frozen(
    plan: PlanDocument, previous: PlanDocument | None, compute_keys: Mapping[str, str] | None = None
) -> PlanDocument:
    """A freshly searched `plan` (the planner's full re-search after joins, leaves or a failed repair) made to
    keep `previous`'s frozen prefix: `frozen_layers` carried over and the layers repacked for it
    (`repack_plan`, which drops the searched layout's per-stage parts when the stage count changes), so hosts
    built from it start frozen and the repacked layout survives. Frozen layers never thaw: a re-search that
    forgot the prefix would train them again for at least one step, and every stage refuses the trainer's
    Step with fewer. Unchanged without a frozen prefix (or when the prefix reaches past the new plan).
    `compute_keys`: as `repack_plan`'s."""
    frozen = previous.frozen if previous is not None else 0
    if frozen <= 0 or frozen >= plan.n_layers:
        return plan
    return repack_plan(plan, frozen, compute_keys=compute_keys)


def frozen_figure(metrics: Mapping[str, float], n_layers: int) -> int | None:
    """The frozen prefix a stage reports in its `StatusReply.metrics`; None when absent or malformed (not a
    whole number in [0, n_layers))."""
    value = metrics.get(FROZEN_METRIC)
    if type(value) is not float or not math.isfinite(value) or value != int(value) or not 0 <= value < n_layers:
        return None
    return int(value)


class RepackWatch:
    """The planner's trigger for an elastic repack (module doc).

    Args:
        read: peer id -> its `StatusReply` over the stage service (None when it does not answer).
        every_s: least time between two readings of the plan's peers.
    """

    def __init__(
        self, read: Callable[[str], object | None], every_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ):
        self.read, self.every_s, self.clock = read, every_s, clock
        self._next = 0.0
        self.frozen = 0
        """the largest prefix the stages of a plan agreed on that moved no layer: held, not published alone"""

    def carried(self, record):
        """`record` with the held prefix (`frozen`) where its plan carries less: what the planner derives its
        next plan from, so the prefix goes out with it."""
        if record is None or self.frozen <= record.document.frozen or self.frozen >= record.document.n_layers:
            return record
        return dataclasses.replace(record, document=record.document.replace(frozen_layers=self.frozen))

    def agreed(self, record) -> int | None:
        """The frozen prefix every peer of every stage of `record` reports applying under `record.version`,
        when it is above the plan's own; None otherwise (or too soon after the last reading)."""
        if self.clock() < self._next:
            return None
        self._next = self.clock() + self.every_s
        n_layers, base = record.document.n_layers, record.document.frozen
        figures = set()
        for index, stage in enumerate(record.document.stages):
            for pid in stage.peer_ids:
                reply = self.read(pid)
                if reply is None or getattr(reply, "peer_id", None) != pid or getattr(reply, "stage", None) != index:
                    return None
                if getattr(reply, "plan_version", None) != record.version:
                    return None  # lagging (or ahead): its figure is not this plan's
                figure = frozen_figure(dict(reply.metrics), n_layers)
                if figure is None or figure <= base or (figures and figure not in figures):
                    return None  # this round cannot agree on more: read no further peers
                figures.add(figure)
        return figures.pop() if figures else None

    def round(self, planner, current, peers) -> object | None:
        """Publishes `repack_plan(current.document, F)` as the next version once the stages agree on F (`agreed`)
        and it moves layers (else holds F: `frozen`); returns the published record, or None when nothing is
        published. `current`: the plan as the planner reads it, through `carried`."""
        frozen = self.agreed(current)
        if frozen is None:
            return None
        try:
            plan = repack_plan(current.document, frozen, compute_keys={p.peer_id: p.compute_key for p in peers})
        except ValueError as e:
            log.warning("repack for %d frozen layers: %s", frozen, e)
            return None
        if plan.stages == current.document.stages:  # no fewer stages yet: nothing moves, nothing to follow
            self.frozen = frozen
            log.info("plan %d's stages froze %d layers: held for the next plan (no fewer stages yet)",
                     current.version, frozen)  # fmt: skip
            return None
        version = planner.next_version(peers)
        if version is None:
            return None
        try:
            planner.dht.publish_plan(version, plan)
        except ValueError as e:  # the repacked plan does not validate: keep the current one
            log.warning("repacked plan not published: %s", e)
            return None
        self.frozen = max(self.frozen, frozen)
        layout = [(s.layer_start, s.layer_end, len(s.peer_ids)) for s in plan.stages]
        log.info(
            "published plan %d: plan %d repacked for %d frozen layers: %d stages -> %d (layers, replicas) %s",
            version, current.version, frozen, current.document.n_stages, plan.n_stages, layout,
        )  # fmt: skip
        return planner.dht.get_plan(planner.spec.layers, peers=peers, check_trainers=False)
