"""PipeTransformer's elastic repack (AutoPipe + AutoDP) for a live plan: when the frozen prefix grows, pack the
layers onto fewer stages and give the freed peers to the remaining stages as replicas.

A frozen layer costs `frozen_cost` of an active one (forward only; nothing once its outputs are cached at the
boundary, `swarm.runtime.freeze.cached_forward`). Like AutoPipe, the stage count is halved (S, S/2, S/4, ...,
each a contiguous split minimising the costliest stage) while no stage costs more than the costliest stage of
the plan with every layer active: what a peer has shown it can carry, in compute and in memory per micro-batch
(frozen layers hold no gradients or optimizer state). The plan's peers are dealt out to the chosen stages, each
further peer to the stage with the highest cost per replica. Fewer stages: fewer boundaries, fewer bytes, a
smaller pipeline bubble, and more data parallelism.

`repack_plan` returns the next plan dict (same peers, new stages, `frozen_layers` set, per-link codecs dropped
when the boundaries change); the live planner publishes it as a new version like a repair, and every peer
follows it through the same re-planning as joins and leaves (state over GetState).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

__all__ = ["layer_costs", "split_by_cost", "repack_layout", "repack_plan"]


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


def repack_plan(plan: dict, frozen_layers: int, frozen_cost: float = 1 / 3) -> dict:
    """The next plan for a grown frozen prefix: the plan's peers (in stage order) re-dealt onto the repacked
    stages. Codecs per boundary are dropped when the stage count changes (the planner may choose them anew)."""
    stages = plan["stages"]
    n_layers = stages[-1]["layer_end"]
    peers = [pid for stage in stages for pid in stage["peer_ids"]]
    limit = max(stage["layer_end"] - stage["layer_start"] for stage in stages)  # all layers active: cost 1 each
    ranges, counts = repack_layout(n_layers, frozen_layers, len(peers), limit, len(stages), frozen_cost)
    out = copy.deepcopy(plan)
    new, at = [], 0
    for (start, end), count in zip(ranges, counts, strict=True):
        new.append({"layer_start": start, "layer_end": end, "peer_ids": peers[at : at + count]})
        at += count
    out["stages"], out["frozen_layers"] = new, frozen_layers
    if len(new) != len(stages):
        out.pop("codecs", None)
    return out
