"""Peers behind NAT as the scheduler sees them: a link that needs a relay is the path through it.

A peer announces `reach == "relay"` when others cannot dial it, with the reachable peer it keeps a
connection to (`relay`), as the relay transport builds it (swarm/net/relay.py): a caller reaches an
unreachable peer j through j's relay r, which forwards over the connection j keeps to it; only r itself
reaches j without an extra hop (the reverse connection). So a directed link i -> j is

- direct when j is reachable (i dials it, whatever i's own reach);
- direct when j is unreachable and i is j's relay;
- otherwise the path i -> r -> j through j's relay r, priced as the sum of its two legs,

      delay = d[i, r] + d[r, j]         1 / bw = k_r * (1 / bw[i, r] + 1 / bw[r, j])
      burst = min(burst[i, r], burst[r, j])

  (store and forward: an upper bound of a relay that streams chunk by chunk, which pays nearer the slower
  leg), where k_r is the number of links relay r carries at once (its bandwidth is shared by them). A relay
  that is not among the planned peers, or that is itself unreachable, makes the link infeasible (priced at
  `_INFEASIBLE_*`, so the search avoids it without special cases).

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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from swarm.scheduler.cost import FullCost, Layout
from swarm.scheduler.plans import Breakdown, ModelSpec, Plan, PlanInput
from swarm.scheduler.search import SearchConfig, layout_to_plan, search_full

__all__ = [
    "plan_relayed", "price", "relay_extra_s", "relay_paths", "relay_shares", "relayed_input", "relays_of",
    "shared_input",
]  # fmt: skip

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
    plan_input: PlanInput, relays: Mapping[str, str | None], shares: Mapping[int, int] | None = None
) -> PlanInput:
    """The swarm with every relayed link replaced by its path through the relay (module docstring).

    Args:
        plan_input: measured links between peers (an unreachable pair's own entry is never used).
        relays: peer id -> its relay's id, None (or absent) for a reachable peer.
        shares: relay index -> links it carries at once (default 1 each): each leg's rate is divided by it.
    """
    paths = relay_paths(plan_input, relays)
    if not paths:
        return plan_input
    delay = plan_input.delay_s.copy()
    bandwidth = plan_input.bandwidth_bytes_per_s.copy()
    burst = plan_input.burst_bytes.copy()
    d, bw, b = plan_input.delay_s, plan_input.bandwidth_bytes_per_s, plan_input.burst_bytes
    for (i, j), r in paths.items():
        if r is None:
            delay[i, j], bandwidth[i, j], burst[i, j] = _INFEASIBLE_DELAY_S, _INFEASIBLE_BYTES_PER_S, 0.0
            continue
        k = max(int((shares or {}).get(r, 1)), 1)
        delay[i, j] = d[i, r] + d[r, j]
        bandwidth[i, j] = 1.0 / (k * (1.0 / bw[i, r] + 1.0 / bw[r, j]))
        burst[i, j] = min(b[i, r], b[r, j])
    return PlanInput(plan_input.peers, delay, bandwidth, burst)


def _talking_pairs(layout: Layout) -> list[tuple[int, int]]:
    """Directed peer pairs that exchange bytes under a layout: each boundary's pair both ways, and the
    replicas of a stage with each other (gradient averaging)."""
    grid = layout.grid
    pairs = []
    for s in range(grid.shape[0] - 1):
        for r in range(grid.shape[1]):
            p, q = int(grid[s, r]), int(grid[s + 1, r])
            pairs += [(p, q), (q, p)]
    for row in grid:
        pairs += [(int(a), int(b)) for a in row for b in row if a != b]
    return pairs


def relay_shares(layout: Layout, plan_input: PlanInput, relays: Mapping[str, str | None]) -> dict[int, int]:
    """Relay index -> how many directed links of this layout pass through it."""
    paths = relay_paths(plan_input, relays)
    return dict(Counter(paths[pair] for pair in _talking_pairs(layout) if paths.get(pair) is not None))


def price(layout: Layout, plan_input: PlanInput, relays: Mapping[str, str | None], model: ModelSpec) -> Breakdown:
    """A layout's predicted step, its relayed links through their relays, each relay shared by the layout's
    relayed links."""
    shares = relay_shares(layout, plan_input, relays)
    return FullCost(relayed_input(plan_input, relays, shares), model).evaluate(layout)


def plan_relayed(
    plan_input: PlanInput,
    model: ModelSpec,
    relays: Mapping[str, str | None],
    cfg: SearchConfig | None = None,
    version: int = 0,
) -> Plan:
    """`search.plan` for a swarm with unreachable peers (equal to it when every peer is reachable)."""
    best = None
    shares: dict[int, int] = {}
    for _ in range(2):
        effective = relayed_input(plan_input, relays, shares)
        result = search_full(FullCost(effective, model), effective, cfg)
        breakdown = price(result.layout, plan_input, relays, model)
        if best is None or breakdown.total_s < best[0].total_s:
            best = (breakdown, result)
        next_shares = relay_shares(result.layout, plan_input, relays)
        if next_shares == shares or not next_shares:
            break
        shares = next_shares
    breakdown, result = best
    return layout_to_plan(result.layout, breakdown, plan_input, "full", result.unused, version)


def _layout_of(made: Plan, plan_input: PlanInput) -> Layout:
    """The plan `made` as a layout over `plan_input`'s peers (its stages' peers and layer counts)."""
    import numpy as np

    index = {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    grid = np.array([[index[pid] for pid in stage.peer_ids] for stage in made.stages])
    return Layout(grid, np.array([s.layer_end - s.layer_start for s in made.stages], dtype=np.int64))


def shared_input(plan_input: PlanInput, relays: Mapping[str, str | None], made: Plan) -> PlanInput:
    """`relayed_input` with each relay shared by the relayed links of the plan `made` (its peers' layout): what
    the live planner prices a plan with (the even-layers re-pricing, the codecs' link figures)."""
    layout = _layout_of(made, plan_input)  # the layers do not matter to the shares
    return relayed_input(plan_input, relays, relay_shares(layout, plan_input, relays))


def relay_extra_s(
    made: Plan, plan_input: PlanInput, relays: Mapping[str, str | None], model: ModelSpec
) -> float | None:
    """What the plan `made`'s relayed links add to its predicted step: its layout priced with them as their two
    legs, each relay shared by the layout's relayed links (`price`, as the plan is published), minus the same
    layout priced as if every link were direct (`plan_input`: the measured links, an unreachable pair's
    filled figure). None when the layout relays no link; 0 when the path prices no dearer than that direct
    figure (a fill: an unreachable pair cannot be measured)."""
    from swarm.peers.plan_keys import MAX_RELAY_EXTRA_S

    layout = _layout_of(made, plan_input)
    paths = relay_paths(plan_input, relays)
    if not any(pair in paths for pair in _talking_pairs(layout)):
        return None
    extra = price(layout, plan_input, relays, model).total_s - FullCost(plan_input, model).evaluate(layout).total_s
    return min(max(extra, 0.0), MAX_RELAY_EXTRA_S)  # an infeasible relay (no carrier) prices at the bound
