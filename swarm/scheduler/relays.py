"""Peers behind NAT as the scheduler sees them: a link that needs a relay is the path through it.

A peer announces `reach == "relay"` when others cannot dial it, with the reachable peer it keeps a
connection to (`relay`), as the relay transport builds it (swarm/net/relay.py): a caller reaches an
unreachable peer j through j's relay r, which forwards over the connection j keeps to it; only r itself
reaches j without an extra hop (the reverse connection). So a directed link i -> j is

- direct when j is reachable (i dials it, whatever i's own reach);
- direct when j is unreachable and i is j's relay;
- otherwise the path i -> r -> j through j's relay r, priced as the sum of its two legs,

      delay = d[i, r] + d[r, j]         1 / bandwidth = k_r * (1 / bandwidth[i, r] + 1 / bandwidth[r, j])
      burst = min(burst[i, r], burst[r, j])

  (store and forward: an upper bound of a relay that streams chunk by chunk, which pays nearer the slower
  leg), where k_r is the number of links relay r carries at once (its bandwidth is shared by them). A relay
  that is not among the planned peers, or that is itself unreachable, makes the link infeasible (priced at
  `_INFEASIBLE_*`, so the search avoids it without special cases).

A pipeline boundary's link from a reachable neighbour is direct too: the NAT'd peer keeps a second Attach to
its other reachable neighbour (`NatWiring.second_neighbour`), so both neighbours' calls take a reverse
connection. `TunnelCost` prices the boundaries so (`relayed_input(neighbours=True)`) and the replicas' averaging
and the tied sum through the relay; `relay_shares` counts only links that pass a relay.

Each direction takes its destination's relay: the activations i -> j go through j's, the gradients j -> i
through i's. Two unreachable peers therefore always talk through a relay, and an unreachable peer costs
nothing extra only next to its own relay (or at the pipeline's end, next to it). Because a relayed link
costs at least its two legs, the search places reachable peers between unreachable ones, and unreachable
peers beside their relays, on its own whenever it can (tests/unit/test_nat_scheduler.py).

The sharing k_r depends on the layout (which relayed links the plan uses), so `plan_relayed` searches with
k_r = 1, counts the layout's relayed links per relay (`relay_shares`), searches again with those shares, and
keeps whichever layout is cheaper once priced with its own shares (`price`).

`relay_extra_s` is what a plan's relayed links add to its predicted step: the same layout priced with them as
their two legs minus priced as if every link were direct (same measurements, same cost model). The live planner
publishes it with each plan that relays a link (plan key `relay_extra_s`), and `swarm experiment nat` judges a
relayed run's measured extra against it.

What the tunnel costs beyond bytes and delays (`TunnelCost`). Every message into an unreachable peer passes the
tunnel, whether through two legs or over the reverse connection from its own relay, and pays a fixed `tunnel_s`
(`TUNNEL_CALL_S`, measured; `swarm bench relay` measures small-call latency direct vs relayed). The messages of a
step into each peer (`tunnelled_messages`), with M micro-batches per pipeline and R replicas per stage:

- the pipeline: M forward into every stage but the first, M backward into every stage but the last;
- the replicas' averaging: one from every other replica of the stage (R > 1);
- the tied sum (a tied model, 2+ stages): one from every other end-stage replica;
- the trainer's calls (the trainer is reachable; its own links are not measured, so a call into an unreachable
  peer costs `tunnel_s` over its direct call, which is what the trainer-side measurement gives): M Forward into
  each first-stage replica; M Backward starts and one PutLabels into each last-stage replica; Grads and Step
  into every replica, and Reduce into every replica of a replicated stage or of an end stage of a tied model.

They are added one after another (`tunnel_s` x count on the step), as the s25 note accounts them: an upper
bound where calls overlap. A middle stage and a first stage receive 2M each, a last stage 2M + 1, so the order
matters through the ends: PutLabels, the ends' Reduce and the tied sum; with both ends unreachable every
trainer call and both directions of the tied sum pass a tunnel. `TunnelCost.complete` therefore also tries the
order that places the cheapest ends (`_end_order`); with no unreachable peer it is `FullCost`, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np

from swarm.scheduler.cost import FullCost, GroupStats, Layout
from swarm.scheduler.graph import open_path_tsp
from swarm.scheduler.plans import Breakdown, ModelSpec, Plan, PlanInput
from swarm.scheduler.search import PeerSpeeds, SearchConfig, layout_to_plan, plan_layout, search_full

__all__ = [
    "TUNNEL_CALL_S", "TunnelCost", "plan_relayed", "price", "relay_extra_s", "relay_paths", "relay_shares",
    "relayed_input", "relays_of", "shared_cost", "shared_input", "tunnelled_messages", "unreachable_of", "with_speeds",
]  # fmt: skip

TUNNEL_CALL_S = 0.2e-3
"""What a call into an unreachable peer costs beyond its bytes and delays, with the relays' data ports (plain TCP,
`swarm.net.splice`): 0.55-0.66 ms per small call through a relay (two legs or the reverse connection) against
0.30-0.46 ms direct, behind the testbed's NAT router (`swarm experiment nat --netns --quick --ping 100`, s26, a
loaded machine). By gRPC frames it was 0.6 ms more (s25). `swarm bench relay` measures it on loopback."""

_INFEASIBLE_DELAY_S = 3600.0
_INFEASIBLE_BYTES_PER_S = 1.0


def relays_of(peers: Iterable) -> dict[str, str | None]:
    """{peer id: its relay's id, or None when it is reachable} from announcements (`PeerAnnouncement`)."""
    return {p.peer_id: p.relay for p in peers}  # validated: relay is None unless reach == "relay"


def relay_paths(plan_input: PlanInput, relays: Mapping[str, str | None]) -> dict[tuple[int, int], int | None]:
    """For each directed pair (i, j) whose bytes pass through a relay (j unreachable, i not its relay): the
    index of that relay, or None when it cannot carry them (not planned, or unreachable itself). Other pairs
    are direct."""
    ids = [p.peer_id for p in plan_input.peers]
    index = {pid: k for k, pid in enumerate(ids)}
    paths: dict[tuple[int, int], int | None] = {}
    for j, pid in enumerate(ids):
        if relays.get(pid) is None:
            continue
        r = index.get(relays[pid])
        usable = r is not None and relays.get(ids[r]) is None
        for i in range(len(ids)):
            if i != j and not (usable and i == r):
                paths[i, j] = r if usable else None
    return paths


def relayed_input(
    plan_input: PlanInput,
    relays: Mapping[str, str | None],
    shares: Mapping[int, int] | None = None,
    neighbours: bool = False,
) -> PlanInput:
    """The swarm with every relayed link replaced by its path through the relay (module docstring).

    Args:
        plan_input: measured links between peers (an unreachable pair's own entry is never used).
        relays: peer id -> its relay's id, None (or absent) for a reachable peer.
        shares: relay index -> links it carries at once (default 1 each): each leg's rate is divided by it.
        neighbours: the links of pipeline neighbours: a reachable sender's stays direct (the reverse connection
            of the NAT'd peer's announced relay or of its second Attach, `NatWiring.second_neighbour`).
    """
    paths = relay_paths(plan_input, relays)
    if neighbours:
        ids = [p.peer_id for p in plan_input.peers]
        paths = {(i, j): r for (i, j), r in paths.items() if relays.get(ids[i]) is not None}
    if not paths:
        return plan_input
    delay = plan_input.delay_s.copy()
    bandwidth = plan_input.bandwidth_bytes_per_s.copy()
    burst = plan_input.burst_bytes.copy()
    d, given_bandwidth, b = plan_input.delay_s, plan_input.bandwidth_bytes_per_s, plan_input.burst_bytes
    for (i, j), r in paths.items():
        if r is None:
            delay[i, j], bandwidth[i, j], burst[i, j] = _INFEASIBLE_DELAY_S, _INFEASIBLE_BYTES_PER_S, 0.0
            continue
        k = max(int((shares or {}).get(r, 1)), 1)
        delay[i, j] = d[i, r] + d[r, j]
        bandwidth[i, j] = 1.0 / (k * (1.0 / given_bandwidth[i, r] + 1.0 / given_bandwidth[r, j]))
        burst[i, j] = min(b[i, r], b[r, j])
    return PlanInput(plan_input.peers, delay, bandwidth, burst)


def _talking_pairs(layout: Layout, reachable: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Directed peer pairs that exchange bytes under a layout: each boundary's pair both ways, and the
    replicas of a stage with each other (gradient averaging). With `reachable` (per peer), a boundary pair
    whose sender is reachable is left out: its calls take the reverse connection (`relayed_input`)."""
    grid = layout.grid
    pairs = []
    for s in range(grid.shape[0] - 1):
        for r in range(grid.shape[1]):
            p, q = int(grid[s, r]), int(grid[s + 1, r])
            pairs += [(a, b) for a, b in ((p, q), (q, p)) if reachable is None or not reachable[a]]
    for row in grid:
        pairs += [(int(a), int(b)) for a in row for b in row if a != b]
    return pairs


def unreachable_of(plan_input: PlanInput, relays: Mapping[str, str | None]) -> np.ndarray:
    """Per planned peer: whether it is unreachable (it announced a relay)."""
    return np.array([relays.get(p.peer_id) is not None for p in plan_input.peers], dtype=bool)


def _checked_tunnel_s(tunnel_s: float) -> float:
    if isinstance(tunnel_s, bool) or not isinstance(tunnel_s, (int, float)) or not math.isfinite(tunnel_s):
        raise ValueError(f"tunnel_s must be a finite number of seconds, got {tunnel_s!r}")
    if tunnel_s < 0:
        raise ValueError(f"tunnel_s must be >= 0, got {tunnel_s!r}")
    return float(tunnel_s)


def _messages_into(grid: np.ndarray, model: ModelSpec) -> Counter:
    """Peer index -> messages a step sends into it (the module docstring's list: pipeline, averaging, tied
    sum, the trainer's calls)."""
    stages, replicas = grid.shape
    m = model.micro_batches_per_pipeline(replicas)
    tied = model.tied and stages > 1
    into: Counter = Counter()
    for s in range(stages - 1):
        for p, q in zip(grid[s], grid[s + 1], strict=True):
            into[int(q)] += m  # forward
            into[int(p)] += m  # backward
    for s, row in enumerate(grid):
        reduce = replicas > 1 or (tied and s in (0, stages - 1))
        for p in row:
            into[int(p)] += (replicas - 1) + 2 + int(reduce)  # averaging partners; Grads, Step; Reduce
    if tied:
        members = np.concatenate([grid[0], grid[-1]])
        for p in members:
            into[int(p)] += len(members) - 1
    for r in range(replicas):
        into[int(grid[0, r])] += m  # the trainer's Forward
        into[int(grid[-1, r])] += m + 1  # its Backward starts and PutLabels
    return into


def tunnelled_messages(grid: np.ndarray, unreachable: np.ndarray, model: ModelSpec) -> int:
    """Messages of one step of the layout `grid` that pass a tunnel: those into an unreachable peer."""
    return sum(count for p, count in _messages_into(np.asarray(grid), model).items() if unreachable[p])


class TunnelCost(FullCost):
    """`FullCost` plus `tunnel_s` for every message of a step that passes a tunnel (module docstring), on links
    already priced as their paths (`relayed_input`)."""

    def __init__(
        self,
        plan_input: PlanInput,
        model: ModelSpec,
        unreachable: np.ndarray,
        tunnel_s: float,
        neighbour_input: PlanInput | None = None,
    ):
        """`plan_input`: every relayed link as its path (replicas' averaging, the tied sum); `neighbour_input`:
        the pipeline boundaries' links, a reachable neighbour's direct (`relayed_input(neighbours=True)`;
        default `plan_input`)."""
        super().__init__(plan_input, model)
        self.unreachable = np.asarray(unreachable, dtype=bool)
        if self.unreachable.shape != (plan_input.n_peers,):
            raise ValueError("unreachable: one flag per peer")
        self.tunnel_s = _checked_tunnel_s(tunnel_s)
        if neighbour_input is not None:
            boundaries = FullCost(neighbour_input, model)
            self.fill_s, self.pace_s = boundaries.fill_s, boundaries.pace_s
            self.boundary_inverse_bandwidth = boundaries.inverse_bandwidth
            self.forward_bytes, self.backward_bytes = boundaries.forward_bytes, boundaries.backward_bytes

    def tunnel_term_s(self, grid: np.ndarray) -> float:
        return self.tunnel_s * tunnelled_messages(grid, self.unreachable, self.model)

    def evaluate(self, layout: Layout) -> Breakdown:
        breakdown = super().evaluate(layout)
        if not math.isfinite(breakdown.total_s):
            return breakdown
        term = self.tunnel_term_s(layout.grid)
        return dataclasses.replace(breakdown, total_s=breakdown.total_s + term, overhead_s=breakdown.overhead_s + term)

    def complete(
        self, groups: list[np.ndarray], stats: list[GroupStats] | None = None, exact_order: bool = True
    ) -> tuple[Breakdown, Layout | None]:
        """`FullCost.complete`, then also the order whose ends pass the fewest tunnels (`_end_order`)."""
        stats = stats or [self.group_stats(g, len(groups)) for g in groups]
        best = super().complete(groups, stats, exact_order)
        s = len(groups)
        if s < 3 or not self.unreachable.any():
            return best
        weight, fill, pace = np.zeros((s, s)), np.zeros((s, s)), np.zeros((s, s))
        perms: dict[tuple[int, int], np.ndarray] = {}
        for i in range(s):
            for j in range(s):
                if i != j:
                    weight[i, j], fill[i, j], pace[i, j], perms[i, j] = self.boundary(groups[i], groups[j])
        found = self._complete_order(groups, stats, self._end_order(groups, weight), fill, pace, perms)
        return found if found[0].total_s < best[0].total_s else best

    def _end_order(self, groups: list[np.ndarray], weight: np.ndarray) -> list[int]:
        """The open path over the boundaries' weights from a start node to an end node, where entering group g
        first costs the tunnels its place as the first stage adds and leaving it last those of the last stage
        (a middle stage's count is the baseline: `_messages_into`)."""
        s, replicas = len(groups), len(groups[0])
        tied = self.model.tied
        # over a middle stage, per unreachable replica: a last stage's PutLabels; an end's Reduce (tied, R = 1)
        # and its tied partners (2R - 1)
        ends = (int(replicas == 1) + 2 * replicas - 1) if tied else 0
        nat = np.array([self.unreachable[np.asarray(g)].sum() for g in groups], dtype=float)
        big = 1e6 + float(np.abs(weight).sum())
        dist = np.full((s + 2, s + 2), big)
        dist[:s, :s] = weight
        dist[s, :s] = self.tunnel_s * ends * nat  # start -> first stage
        dist[:s, s + 1] = self.tunnel_s * (ends + 1) * nat  # last stage -> end
        _, order = open_path_tsp(dist)
        inner = [k for k in order if k < s]
        return inner if order[0] == s and order[-1] == s + 1 else list(range(s))


def relay_shares(layout: Layout, plan_input: PlanInput, relays: Mapping[str, str | None]) -> dict[int, int]:
    """Relay index -> how many directed links of this layout pass through it (a reachable neighbour's boundary
    link takes the reverse connection, not the relay)."""
    paths = relay_paths(plan_input, relays)
    pairs = _talking_pairs(layout, ~unreachable_of(plan_input, relays))
    return dict(Counter(paths[pair] for pair in pairs if paths.get(pair) is not None))


def _cost(
    plan_input: PlanInput, relays: Mapping[str, str | None], model: ModelSpec, shares, tunnel_s: float
) -> FullCost:
    """The cost model on the relayed links: `TunnelCost`, or `FullCost` itself when no peer is unreachable.
    Every pricing goes through here, so this is where `tunnel_s` is checked."""
    tunnel_s = _checked_tunnel_s(tunnel_s)
    effective = relayed_input(plan_input, relays, shares)
    unreachable = unreachable_of(plan_input, relays)
    if not unreachable.any():
        return FullCost(effective, model)
    neighbours = relayed_input(plan_input, relays, shares, neighbours=True)
    return TunnelCost(effective, model, unreachable, tunnel_s, neighbours)


def price(
    layout: Layout,
    plan_input: PlanInput,
    relays: Mapping[str, str | None],
    model: ModelSpec,
    tunnel_s: float = TUNNEL_CALL_S,
) -> Breakdown:
    """A layout's predicted step, its relayed links through their relays, each relay shared by the layout's
    relayed links, and `tunnel_s` per message through a tunnel."""
    shares = relay_shares(layout, plan_input, relays)
    return _cost(plan_input, relays, model, shares, tunnel_s).evaluate(layout)


def plan_relayed(
    plan_input: PlanInput,
    model: ModelSpec,
    relays: Mapping[str, str | None],
    cfg: SearchConfig | None = None,
    version: int = 0,
    tunnel_s: float = TUNNEL_CALL_S,
    speeds_for: PeerSpeeds | None = None,
) -> Plan:
    """`search.plan` for a swarm with unreachable peers (equal to it when every peer is reachable); `tunnel_s`:
    what a message through a tunnel costs beyond its bytes (module docstring); `speeds_for`: the peers' speeds
    under choices made on a finished layout (`search_full`'s), which its price then keeps."""
    best = None
    shares: dict[int, int] = {}
    for _ in range(2):
        cost = _cost(plan_input, relays, model, shares, tunnel_s)
        result = search_full(cost, relayed_input(plan_input, relays, shares), cfg, speeds_for=speeds_for)
        speeds = None if speeds_for is None else speeds_for(result.layout)
        priced = plan_input if speeds is None else with_speeds(plan_input, speeds)
        breakdown = price(result.layout, priced, relays, model, tunnel_s)
        if best is None or breakdown.total_s < best[0].total_s:
            best = (breakdown, result)
        next_shares = relay_shares(result.layout, plan_input, relays)
        if next_shares == shares or not next_shares:
            break
        shares = next_shares
    breakdown, result = best
    return layout_to_plan(result.layout, breakdown, plan_input, "full", result.unused, version)


def with_speeds(plan_input: PlanInput, speeds) -> PlanInput:
    """`plan_input` with its peers computing at `speeds` (FLOP/s, one per peer)."""
    peers = tuple(
        dataclasses.replace(p, compute_flops_per_s=float(s)) for p, s in zip(plan_input.peers, speeds, strict=True)
    )
    return dataclasses.replace(plan_input, peers=peers)


def shared_input(plan_input: PlanInput, relays: Mapping[str, str | None], made: Plan) -> PlanInput:
    """`relayed_input` with each relay shared by the relayed links of the plan `made` (its peers' layout): what
    the live planner prices a plan with (the even-layers re-pricing, the codecs' link figures)."""
    layout = plan_layout(made, plan_input)  # the layers do not matter to the shares
    return relayed_input(plan_input, relays, relay_shares(layout, plan_input, relays))


def shared_cost(
    plan_input: PlanInput,
    relays: Mapping[str, str | None],
    made: Plan,
    model: ModelSpec,
    tunnel_s: float = TUNNEL_CALL_S,
) -> FullCost:
    """The cost model `price` uses for the plan `made`'s peers (each relay shared by its relayed links, the
    tunnels charged), for re-pricing that layout with other layers (the live planner's even layers)."""
    layout = plan_layout(made, plan_input)  # the layers do not matter to the shares
    return _cost(plan_input, relays, model, relay_shares(layout, plan_input, relays), tunnel_s)


def relay_extra_s(
    made: Plan,
    plan_input: PlanInput,
    relays: Mapping[str, str | None],
    model: ModelSpec,
    tunnel_s: float = TUNNEL_CALL_S,
) -> float | None:
    """What the plan `made`'s relayed links and tunnels add to its predicted step: its layout priced with the
    relayed links as their two legs, each relay shared by the layout's relayed links, plus `tunnel_s` for each
    message through a tunnel, the trainer's included (`price`, as the plan is published), minus the same layout
    priced as if every link were direct (`plan_input`: the measured links, an unreachable pair's filled figure).
    None when the layout relays no link and no message passes a tunnel (no unreachable peer, or `tunnel_s`
    0); 0 when the path prices no dearer than that direct figure (a fill: an unreachable pair cannot be
    measured)."""
    from swarm.peers.plan import MAX_RELAY_EXTRA_S

    tunnel_s = _checked_tunnel_s(tunnel_s)
    layout = plan_layout(made, plan_input)
    paths = relay_paths(plan_input, relays)
    unreachable = unreachable_of(plan_input, relays)
    tunnelled = tunnel_s > 0 and bool(unreachable[layout.grid.ravel()].any())
    pairs = _talking_pairs(layout, ~unreachable)
    if model.tied and layout.stages > 1:  # the end stages' tied sum: priced through its relays too (`tied_s`)
        members = [int(p) for p in np.concatenate([layout.grid[0], layout.grid[-1]])]
        pairs += [(a, b) for a in members for b in members if a != b]
    if not tunnelled and not any(pair in paths for pair in pairs):
        return None
    priced = price(layout, plan_input, relays, model, tunnel_s).total_s
    extra = priced - FullCost(plan_input, model).evaluate(layout).total_s
    return min(max(extra, 0.0), MAX_RELAY_EXTRA_S)  # an infeasible relay (no carrier) prices at the bound
