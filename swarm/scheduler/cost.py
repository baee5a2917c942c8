"""Predicted step time of a plan: DT-FM's cost model, and our fuller one (compute, compressed transfers,
latency, micro-batch pacing, gradient averaging, memory limits).

Both score a `Layout`: a grid of peer indices whose row s holds the replicas of stage s (rows in pipeline
order, column r is pipeline r) and the number of layers of each stage. Both can also *complete* a plain
partition of peers into stage groups: pick the pairing of replicas across each boundary, the pipeline order
and (ours) the layer ranges; DT-FM defines the cost of a partition that way, and the search works on
partitions.

Our model, per step, with M micro-batches per pipeline (lockstep stages: a stage runs at its slowest
replica, a boundary at its slowest replica link):

    pipeline = sum_s compute_s + sum_b fill_b + (M - 1) * max(max_s compute_s, max_b pace_b, trip)
               (and at least M * max_b pace_b: the long-run rate bounds a step whatever the burst)
    trip     = max_k (sum_{s >= k} compute_s + sum_{b >= k} fill_b) / (S - k)   (1F1B only, where M > S - k:
               stage k holds S - k micro-batches, each back only after a round trip through stages k..S-1)
    step     = max(pipeline + max(max_s sync_s, tied) + step_overhead,     (overhead: everything else, measured)
                   rate bound)   (the busiest link's bytes of a whole step, both boundaries' M messages and the
                                  tied gradient, over its rate: a token bucket refills while its link idles)
    tied     = max over end-stage replicas i, j of
                 max((T - burst_ij)+ / bandwidth_ij, (T - burst_ji)+ / bandwidth_ji) + d_ij + d_ji
               (T: what member i sends, `tied_bytes` from the first stage and `tied_bytes_last` from the last;
               the bucket refilled while the pipeline drained)

    compute_s = layers_s * flops_per_layer / (slowest replica's FLOP/s)
    pace_b    = forward_bytes / bandwidth[p, q] + backward_bytes / bandwidth[q, p]   (worst pair p -> q of the boundary)
                (full-duplex links: the max of the two instead of their sum; with a `ModelSpec.link_ladder`
                (`--codec-policy per-link`) each direction of each pair at its quickest codec, its bytes over the
                link plus its encoding and decoding: the search places peers knowing each link's codec)
    fill_b    = (forward_bytes - burst[p, q])+ / bandwidth[p, q] + (backward_bytes - burst[q, p])+ / bandwidth[q, p]
                + delay[p, q] + delay[q, p]          (the first messages find idle links: a bucket's burst)
    sync_s    = max over replicas i of  latency_i + sum_{j != i} G_s / R * (1 / bandwidth_ij + 1 / bandwidth_ji)
    latency_i = max_{j != i} (d_ij + d_ji)      (parts sent concurrently, as hivemind's butterfly does)
             or sum_{j != i} (d_ij + d_ji)      (DT-FM: one partner after another)

where G_s is the stage's gradient bytes and R the replicas: each replica exchanges a 1/R shard with every
other one (reduce-scatter, then all-gather), through its own link. With no compute, one micro-batch, equal
activation sizes both ways and DT-FM's sequential latency this is exactly DT-FM's
`data-parallel cost + 2 x pipeline cost`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from swarm.scheduler.graph import bottleneck_assignment, open_path_tsp
from swarm.scheduler.plans import Breakdown, ModelSpec, PlanInput

__all__ = ["DtfmCost", "FullCost", "GroupStats", "Layout", "allocate_layers", "even_layers", "link_rungs"]

INFEASIBLE = float("inf")
# Up to this many stages, `FullCost.complete` also solves one exact order per pace threshold (a Held-Karp each).
_THRESHOLD_ORDERS_MAX_STAGES = 8


@dataclass(frozen=True, eq=False)
class Layout:
    """Who does what: grid[s, r] is the peer index of replica r of stage s, stages in pipeline order."""

    grid: np.ndarray
    layers: np.ndarray
    """Layers per stage, in pipeline order (they sum to the model's layers)."""

    def __post_init__(self) -> None:
        grid = np.asarray(self.grid, dtype=np.int64)
        layers = np.asarray(self.layers, dtype=np.int64)
        if grid.ndim != 2 or layers.shape != (grid.shape[0],):
            raise ValueError("grid must be [stages, replicas] and layers [stages]")
        if len(np.unique(grid)) != grid.size:
            raise ValueError("a peer appears twice in the layout")
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "layers", layers)

    @property
    def stages(self) -> int:
        return self.grid.shape[0]

    @property
    def replicas(self) -> int:
        return self.grid.shape[1]


def even_layers(layers: int, stages: int) -> np.ndarray:
    """The even split: every stage gets layers // stages, the first ones one more."""
    base, extra = divmod(layers, stages)
    return np.array([base + (1 if s < extra else 0) for s in range(stages)], dtype=np.int64)


def _off_diagonal(n: int) -> np.ndarray:
    return ~np.eye(n, dtype=bool)


class DtfmCost:
    """DT-FM's cost: data-parallel cost + 2 x pipeline cost, on a fixed grid of S stages x R replicas.

    data-parallel: the slowest stage group's all-reduce, for each member the sum over the other members of
    2 (delay + gradient_bytes / (bandwidth x R)); pipeline: the sum over consecutive stages of the worst
    link of the replicas' pairing, a link costing delay + activation_bytes / bandwidth.
    """

    name = "dtfm"

    def __init__(self, plan_input: PlanInput, activation_bytes: float, gradient_bytes: float, replicas: int):
        n = plan_input.n_peers
        delay, bandwidth = plan_input.delay_s, plan_input.bandwidth_bytes_per_s
        off = _off_diagonal(n)
        self.replicas = replicas
        self.link_s = np.where(off, delay + activation_bytes / bandwidth, 0.0)
        self.allreduce_s = np.where(off, 2 * (delay + gradient_bytes / (bandwidth * replicas)), 0.0)

    def group_cost(self, group: np.ndarray) -> float:
        """One stage group's all-reduce time: its slowest member's."""
        return float(self.allreduce_s[np.ix_(group, group)].sum(axis=1).max())

    def boundary(self, a: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray]:
        """Best pairing of two groups' replicas: (worst link, perm) with a[r] paired with b[perm[r]]."""
        return bottleneck_assignment(self.link_s[np.ix_(a, b)])

    def evaluate(self, layout: Layout) -> Breakdown:
        """The cost of a layout as it stands: its order and its pairing (DT-FM's random baseline)."""
        grid = layout.grid
        sync = max(self.group_cost(row) for row in grid)
        pipeline = sum(float(self.link_s[grid[s], grid[s + 1]].max()) for s in range(len(grid) - 1))
        return Breakdown(total_s=sync + 2 * pipeline, transfer_s=2 * pipeline, sync_s=sync)

    def complete(self, groups: list[np.ndarray]) -> tuple[Breakdown, Layout]:
        """DT-FM's cost of a partition: best pairings (bottleneck matching) and best order (open-path TSP)."""
        s = len(groups)
        weights = np.zeros((s, s))
        perms: dict[tuple[int, int], np.ndarray] = {}
        for i in range(s):
            for j in range(i + 1, s):
                value, perm = self.boundary(groups[i], groups[j])
                weights[i, j] = weights[j, i] = value
                perms[i, j] = perm
        pipeline, order = open_path_tsp(weights)
        sync = max(self.group_cost(g) for g in groups)
        return (
            Breakdown(total_s=sync + 2 * pipeline, transfer_s=2 * pipeline, sync_s=sync),
            Layout(_chain(groups, order, perms), np.ones(s, dtype=np.int64)),
        )


def _chain(groups: list[np.ndarray], order: list[int], perms: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """Lays out groups in `order`, permuting each row so that column r follows the chosen pairings."""
    rows = [np.asarray(groups[order[0]])]
    for prev, cur in zip(order[:-1], order[1:], strict=True):
        if (prev, cur) in perms:
            perm = perms[prev, cur]  # groups[prev][r] -> groups[cur][perm[r]]
            matched = np.asarray(groups[cur])[perm]
        else:
            perm = perms[cur, prev]  # groups[cur][r] -> groups[prev][perm[r]]
            inverse = np.empty_like(perm)
            inverse[perm] = np.arange(len(perm))
            matched = np.asarray(groups[cur])[inverse]
        # rows[-1] is groups[prev] permuted; follow the same permutation on the new row.
        position = {int(p): k for k, p in enumerate(groups[prev])}
        rows.append(np.array([matched[position[int(p)]] for p in rows[-1]]))
    return np.stack(rows)


@dataclass(frozen=True, eq=False)
class GroupStats:
    """What a stage group contributes regardless of its position: pace, memory and all-reduce terms."""

    speed_flops_per_s: float
    """Its slowest replica's speed (the group runs in lockstep)."""
    max_layers: int
    """How many layers fit in its smallest replica's memory."""
    sync_table_s: np.ndarray
    """sync_table_s[n]: all-reduce time of the group when it holds n layers."""


# allocate_layers tries every (pace, sync) bound pair while pace bounds x sync bounds x stages stays under
# this; beyond it, the few smallest feasible pace bounds with every sync bound.
_MAX_BOUND_CELLS = 20_000
_FEW_PACE_BOUNDS = 3


def allocate_layers(
    stats: list[GroupStats], layers: int, flops_per_layer: float, steady: int, link_pace_s: float
) -> np.ndarray | None:
    """Layer counts per stage group minimising compute fill + steady pacing + the slowest all-reduce.

    Why uneven: a group twice as fast should take twice the layers, or it waits for the slow ones every
    micro-batch; memory caps bound each group. For a bound P on a stage's compute per micro-batch and a
    bound Y on its all-reduce, the least total compute is a greedy fill (cheapest layers first, within the
    bounds). Every (P, Y) pair is tried at once in numpy (on big instances only the three smallest feasible
    paces), so on small instances the result is exact. Returns None when the layers cannot fit.
    """
    s = len(stats)
    caps = np.array([st.max_layers for st in stats], dtype=np.int64)
    if s > layers or (caps < 1).any() or caps.sum() < layers:
        return None
    speeds = np.array([st.speed_flops_per_s for st in stats])
    sync = np.stack([st.sync_table_s[: layers + 1] for st in stats])  # [S, layers + 1], nondecreasing rows
    unit = flops_per_layer / speeds  # seconds per layer per micro-batch
    if flops_per_layer > 0:
        paces = np.unique((np.arange(1, layers + 1)[None, :] * unit[:, None]).ravel())
        # Paces up to the links' pace cost nothing extra: start from the loosest of those.
        below_link = int(np.searchsorted(paces, link_pace_s, side="right")) - 1
        paces = paces[max(0, below_link) :]
        by_pace = np.minimum(caps[None, :], np.floor(paces[:, None] / unit[None, :] + 1e-9).astype(np.int64))
    else:
        by_pace = caps[None, :]
    feasible = (by_pace >= 1).all(axis=1) & (by_pace.sum(axis=1) >= layers)
    bounds = np.unique(sync[:, 1:])
    by_pace = by_pace[feasible][: max(_FEW_PACE_BOUNDS, _MAX_BOUND_CELLS // (s * len(bounds)))]
    if len(by_pace) == 0:
        return None
    by_sync = (sync[None, :, :] <= bounds[:, None, None] + 1e-12).sum(axis=2) - 1  # [Y, S]
    limit = np.minimum(by_pace[:, None, :], by_sync[None, :, :]).reshape(-1, s)  # [P * Y, S]
    limit = limit[(limit >= 1).all(axis=1) & (limit.sum(axis=1) >= layers)]
    # Greedy fill of every candidate at once: one layer each, the rest to the cheapest stages first.
    order = np.argsort(unit, kind="stable")
    room = (limit - 1)[:, order]
    before = np.cumsum(room, axis=1) - room
    counts = np.ones_like(limit)
    counts[:, order] += np.clip(layers - s - before, 0, room)
    compute = counts * unit[None, :]
    cost = (
        compute.sum(axis=1)
        + steady * np.maximum(compute.max(axis=1), link_pace_s)
        + sync[np.arange(s)[None, :], counts].max(axis=1)
    )
    return counts[int(cost.argmin())]


def link_rungs(model: ModelSpec, direction: str, inverse_bandwidth: np.ndarray):
    """Per directed pair, what one message of `direction` ("forward" or "backward") costs: its bytes, its coding
    seconds and the index of its rung on `model.link_ladder` (-1: the configured codec). Without a ladder every
    pair sends the configured codec's bytes at no coding cost (what the step's calibrated overhead holds); with
    one, each pair takes its quickest rung (`LinkRung.seconds`: bytes over the link plus encoding and decoding),
    the most precise on ties: codecs chosen with the placement, not after it. `inverse_bandwidth`: [n, n],
    entry [p, q] the inverse rate of the link that direction's message of pair p -> q travels."""
    ladder = model.link_ladder
    if ladder is None:
        fixed = model.forward_bytes if direction == "forward" else model.backward_bytes
        shape = inverse_bandwidth.shape
        return np.full(shape, float(fixed)), np.zeros(shape), np.full(shape, -1, dtype=np.int64)
    rungs = ladder.forward if direction == "forward" else ladder.backward
    times = np.stack([r.seconds(inverse_bandwidth) for r in rungs])
    chosen = times.argmin(axis=0)  # argmin takes the first, the most precise, on ties
    sizes = np.array([r.message_bytes for r in rungs])[chosen]
    coding = np.array([r.coding_s for r in rungs])[chosen]
    return sizes, coding, chosen


class FullCost:
    """Our cost model (see the module docstring), for one swarm and one model."""

    name = "full"

    def __init__(self, plan_input: PlanInput, model: ModelSpec):
        n = plan_input.n_peers
        off = _off_diagonal(n)
        delay = np.where(off, plan_input.delay_s, 0.0)
        inverse_bandwidth = np.where(off, 1.0 / plan_input.bandwidth_bytes_per_s, 0.0)
        self.model = model
        self.speeds = plan_input.speeds_flops_per_s
        self.memories = plan_input.memories_bytes
        # pair p -> q of a boundary: forward p -> q, backward q -> p, each at the link's codec (`link_rungs`)
        forward, forward_coding, self.forward_rung = link_rungs(model, "forward", inverse_bandwidth)
        backward, backward_coding, self.backward_rung = link_rungs(model, "backward", inverse_bandwidth.T)
        self.forward_bytes, self.backward_bytes = forward, backward
        """[p, q]: bytes of one micro-batch's message p -> q (forward) and q -> p (backward) if p -> q were a
        boundary pair: the configured codecs', or with a `ModelSpec.link_ladder` its quickest rung's on that link"""
        forward_s = forward * inverse_bandwidth + forward_coding
        backward_s = backward * inverse_bandwidth.T + backward_coding
        # full duplex: the two directions overlap in the steady state; the fill still waits for one of each
        self.pace_s = np.maximum(forward_s, backward_s) if model.full_duplex else forward_s + backward_s
        # the fill's messages find their links idle: a token bucket passes its burst at once
        burst = self.burst = plan_input.burst_bytes
        first_forward = np.maximum(forward - burst, 0.0) * inverse_bandwidth + forward_coding
        first_backward = np.maximum(backward - burst.T, 0.0) * inverse_bandwidth.T + backward_coding
        self.fill_s = first_forward + first_backward + delay + delay.T
        self.round_trip_s = delay + delay.T
        self.inverse_bandwidth = inverse_bandwidth
        self.boundary_inverse_bandwidth = inverse_bandwidth
        """the pipeline boundaries' links (`rate_bound_s`): the same links here; `relays.TunnelCost` prices a
        reachable neighbour's link into a NAT'd peer as direct there, and the other pairs as their relayed paths"""
        self.inverse_bandwidth_sum = inverse_bandwidth + inverse_bandwidth.T

    # -- groups --------------------------------------------------------------------------------------

    def group_stats(self, group: np.ndarray, stages: int) -> GroupStats:
        m = self.model
        replicas = len(group)
        fixed = m.stage_memory_bytes(0, stages, replicas)
        memory = float(self.memories[group].min())
        if m.memory_bytes_per_layer > 0:
            max_layers = int(np.floor((memory - fixed) / m.memory_bytes_per_layer + 1e-9))
        else:
            max_layers = m.layers if memory >= fixed else 0
        sub = np.ix_(group, group)
        round_trips = self.round_trip_s[sub]
        latency = round_trips.max(axis=1) if m.overlapped_sync_latency else round_trips.sum(axis=1)  # per member
        per_layer = (m.gradient_bytes_per_layer / replicas) * self.inverse_bandwidth_sum[sub].sum(axis=1)
        n = np.arange(m.layers + 1)
        if replicas > 1:
            table = (latency[None, :] + n[:, None] * per_layer[None, :]).max(axis=1)
        else:
            table = np.zeros(m.layers + 1)
        return GroupStats(float(self.speeds[group].min()), max(0, min(max_layers, m.layers)), table)

    def steady_factor(self, replicas: int) -> int:
        return self.model.micro_batches_per_pipeline(replicas) - 1

    def pair_weights(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Cost of pairing a[i] -> b[j] if that pair set the boundary's fill and pace."""
        steady = self.steady_factor(len(a))
        sub = np.ix_(a, b)
        return self.fill_s[sub] + steady * self.pace_s[sub]

    def boundary(self, a: np.ndarray, b: np.ndarray) -> tuple[float, float, float, np.ndarray]:
        """Pairing of a's replicas with b's by bottleneck on fill + steady x pace.

        Returns (weight, fill_s, pace_s, perm): a[r] sends to b[perm[r]].
        """
        weight, perm = bottleneck_assignment(self.pair_weights(a, b))
        cols = np.asarray(b)[perm]
        return (
            weight,
            float(self.fill_s[np.asarray(a), cols].max()),
            float(self.pace_s[np.asarray(a), cols].max()),
            perm,
        )

    # -- whole layouts -------------------------------------------------------------------------------

    def evaluate(self, layout: Layout) -> Breakdown:
        """Predicted step time of a layout exactly as given (its order, pairing and layers)."""
        m = self.model
        grid, layers = layout.grid, layout.layers
        stages, replicas = grid.shape
        if layers.sum() != m.layers or (layers < 1).any():
            return Breakdown(total_s=INFEASIBLE)
        stats = [self.group_stats(row, stages) for row in grid]
        if any(n > st.max_layers for n, st in zip(layers, stats, strict=True)):
            return Breakdown(total_s=INFEASIBLE)
        compute = np.array([n * m.flops_per_layer / st.speed_flops_per_s for n, st in zip(layers, stats, strict=True)])
        fills, paces, latencies = [], [], []
        for s in range(stages - 1):
            a, b = grid[s], grid[s + 1]
            fill = self.fill_s[a, b]
            worst = int(fill.argmax())
            fills.append(float(fill[worst]))
            latencies.append(float(self.round_trip_s[a[worst], b[worst]]))
            paces.append(float(self.pace_s[a, b].max()))
        rate = self.rate_bound_s(grid)
        return self._breakdown(compute, fills, latencies, paces, stats, layers, replicas, self.tied_s(grid), rate)

    def rate_bound_s(self, grid: np.ndarray) -> float:
        """The long-run rate of the busiest link over a whole step: M micro-batches' messages each way on every
        boundary pair, plus the tied gradient between the end stages. A token bucket refills while its link idles
        (the optimizer step, the Grads/Step round trips, the trainer's own work), so a link-bound step takes its
        bytes over the rate however the phases fall, not the pipeline's link time plus those phases."""
        m = self.model
        load = np.zeros_like(self.inverse_bandwidth)
        micro = self.steady_factor(grid.shape[1]) + 1
        for s in range(len(grid) - 1):
            for a, b in zip(grid[s], grid[s + 1], strict=True):
                load[a, b] += micro * self.forward_bytes[a, b] * self.boundary_inverse_bandwidth[a, b]
                load[b, a] += micro * self.backward_bytes[a, b] * self.boundary_inverse_bandwidth[b, a]
        if m.tied and len(grid) > 1:
            members = np.concatenate([grid[0], grid[-1]])
            sub = np.ix_(members, members)
            # each sender's own bytes on its own direction (the two ends' tied gradients can differ in size)
            load[sub] += m.tied_sent(grid.shape[1])[:, None] * self.inverse_bandwidth[sub]
        if not m.full_duplex:
            load = load + load.T
        return float(load.max())

    def tied_s(self, grid: np.ndarray) -> float:
        """The tied group's exchange: every end-stage replica sends its tied gradient to every other member at
        once (each through its own link), so a member waits for its slowest partner, both ways, and a round
        trip. 0 with one stage or an untied model."""
        if not self.model.tied or len(grid) < 2:
            return 0.0
        members = np.concatenate([grid[0], grid[-1]])
        sub = np.ix_(members, members)
        sent = self.model.tied_sent(grid.shape[1])[:, None]  # row i: what member i sends
        per_pair = np.maximum(sent - self.burst[sub], 0.0) * self.inverse_bandwidth[sub]
        both = np.maximum(per_pair, per_pair.T) + self.round_trip_s[sub]
        return float(both.max())

    def _breakdown(self, compute, fills, latencies, paces, stats, layers, replicas, tied=0.0, rate=0.0) -> Breakdown:
        steady = self.steady_factor(replicas)
        pace = max(float(np.max(compute)), max(paces, default=0.0), self.round_trip_pace(compute, fills, steady))
        sync = max(float(st.sync_table_s[n]) for st, n in zip(stats, layers, strict=True))
        compute_s, fill_s, latency_s = float(np.sum(compute)), float(sum(fills)), float(sum(latencies))
        # the replicas' averaging and the end stages' tied exchange run at once (both in `Reduce`); a link cannot
        # carry a step's bytes faster than its rate, whatever its burst (the refill is the rate): `rate_bound_s`
        phases = compute_s + fill_s + steady * pace + max(sync, tied) + self.model.step_overhead_s
        link_bound = max(rate, (steady + 1) * max(paces, default=0.0))
        total = max(phases, link_bound)
        return Breakdown(
            total_s=total,
            compute_s=compute_s,
            transfer_s=fill_s - latency_s,
            latency_s=latency_s,
            steady_s=steady * pace,
            sync_s=sync,
            pace_s=pace,
            overhead_s=self.model.step_overhead_s,
            tied_s=tied,
        )

    def round_trip_pace(self, compute, fills, steady: int) -> float:
        """1F1B's in-flight bound: stage k holds at most S - k micro-batches, and a micro-batch leaves it only
        once its backward came back through stages k..S-1 (their compute and the boundaries' transfers and
        delays both ways, `fill`). So in the steady state stage k starts one micro-batch per
        round_trip_k / (S - k) at best; 0 for GPipe (every micro-batch in flight) or when a stage's bound
        never binds (no more micro-batches than it may hold)."""
        if self.model.schedule != "1f1b":
            return 0.0
        n = len(compute)
        trips = [(float(np.sum(compute[k:])) + float(sum(fills[k:]))) / (n - k) for k in range(n) if steady + 1 > n - k]
        return max(trips, default=0.0)

    def complete(
        self, groups: list[np.ndarray], stats: list[GroupStats] | None = None, exact_order: bool = True
    ) -> tuple[Breakdown, Layout | None]:
        """Best pairing, order and layer ranges for a partition into stage groups (all of equal size).

        Order: an open-path TSP over boundary weights (fill + steady x pace of the best pairing); with
        `exact_order`, also the TSP over fills alone restricted to boundaries whose pace stays under each
        threshold in turn, which is exact for the max-pace term when there are few stages.
        """
        s = len(groups)
        stats = stats or [self.group_stats(g, s) for g in groups]
        weight = np.zeros((s, s))
        fill = np.zeros((s, s))
        pace = np.zeros((s, s))
        perms: dict[tuple[int, int], np.ndarray] = {}
        for i in range(s):
            for j in range(s):
                if i != j:
                    weight[i, j], fill[i, j], pace[i, j], perms[i, j] = self.boundary(groups[i], groups[j])
        orders = [open_path_tsp(weight)[1]]
        if exact_order and 2 < s <= _THRESHOLD_ORDERS_MAX_STAGES:
            for threshold in np.unique(pace[~np.eye(s, dtype=bool)]):
                masked = np.where(pace <= threshold, fill, 1e9)
                length, order = open_path_tsp(masked)
                if length < 1e9:
                    orders.append(order)
        best: tuple[Breakdown, Layout | None] = (Breakdown(total_s=INFEASIBLE), None)
        for order in orders:
            result = self._complete_order(groups, stats, order, fill, pace, perms)
            if result[0].total_s < best[0].total_s:
                best = result
        return best

    def _complete_order(self, groups, stats, order, fill, pace, perms) -> tuple[Breakdown, Layout | None]:
        m = self.model
        replicas = len(groups[0])
        link_pace = max((pace[a, b] for a, b in zip(order[:-1], order[1:], strict=True)), default=0.0)
        ordered = [stats[k] for k in order]
        layers = allocate_layers(ordered, m.layers, m.flops_per_layer, self.steady_factor(replicas), link_pace)
        if layers is None:
            return Breakdown(total_s=INFEASIBLE), None
        directed = {(a, b): perms[a, b] for a, b in zip(order[:-1], order[1:], strict=True)}
        layout = Layout(_chain(groups, order, directed), layers)
        return self.evaluate(layout), layout
