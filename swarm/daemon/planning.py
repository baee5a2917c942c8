"""The scheduler in a live swarm: peers measure their links, one peer plans, every peer follows the plan.

- `LinkProber`: each peer measures round-trip time and bytes/s to the other announced peers with the stage
  service's Probe and Sink calls, through the same application-level shaper as its real traffic, a few
  peers per round (a budget, so N peers do not flood each other), and stores `LinkMeasurement`s in the DHT.
- `swarm_plan_input`: turns the DHT's announcements and link measurements into the scheduler's `PlanInput`,
  the same structure a JSON file or a scenario gives, so simulations and live swarms share one code path.
- `Planner`: the elected peer (`elected_planner`: the lowest id holding a planner lease, else the lowest id
  whose lease has not lapsed; among the owner's delegated planners in an owned run, the trusted planners in a
  private one, every announced peer only in an unowned run) plans, when enough peers have announced and
  whenever the set of peers changes, and publishes the plan in the DHT with the next version number. It renews
  its lease (--planner-lease-s, 3 s) every third of it, so a joiner with a lower id does not depose it and a
  dead planner is replaced within a lease. A new planner inherits the plan the peers follow (`followed_plan`)
  and republishes its stages under the next version (repaired if peers are lost), numbering on from the
  versions the peers follow. A new or departed trainer re-publishes the current stages with the new
  `trainer_ids` under the next version.
- `role_in_plan`: what a peer serves under a published plan; the daemon switches roles between steps only
  (see `StageServicer.when_idle`), and stages refuse calls stamped with another plan version, so no step
  ever mixes two plans.

Replicas: `--replicas N` plans N replicas of every stage in the first plan (0: the cost model's choice); peers
it leaves out stay on standby. After a loss the planner first REPAIRS the current plan (`swarm.daemon.repair`:
the lost place goes to a standby, else the stage serves with fewer replicas, nobody else moves) and searches
anew only when that fails. A joiner becomes one more replica of the busiest stage (`grow_plan`), so stages may
have different replica counts (the runtime's routes, `swarm.peers.routes`). Plan peers that
stop answering its `Status` heartbeats (`swarm.daemon.liveness`) or announce that they are leaving count as
gone at once, without waiting for their announcements to expire.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from swarm.daemon.bans import RunBans
from swarm.daemon.calibrate import Calibrator
from swarm.daemon.codec_choice import CodecChoice, at_precisions
from swarm.daemon.joiners import JoinWatch, unproven
from swarm.daemon.lease import AdaptiveLease
from swarm.daemon.liveness import Liveness
from swarm.daemon.precision_watch import PrecisionWatch
from swarm.daemon.repack import with_frozen
from swarm.daemon.repair import grow_plan, repair_plan
from swarm.peers.fields import MAX_PLAN_VERSION
from swarm.peers.plan import MAX_PLAN_TRAINERS, PlanDocument
from swarm.peers.records import (
    LinkMeasurement,
    PeerAnnouncement,
    PlanRecord,
    elected_planner,
)
from swarm.runtime.host import StageRole
from swarm.scheduler import ModelSpec, Peer, Plan, PlanInput, SearchConfig
from swarm.scheduler.bits import BitsPolicy, CodecSpeed
from swarm.scheduler.precision_choice import precision_speeds
from swarm.scheduler.relays import (
    plan_relayed,
    relay_extra_s,
    relayed_input,
    relays_of,
    shared_cost,
    shared_input,
)

if TYPE_CHECKING:
    from swarm.daemon.peer_config import PlanningConfig

log = logging.getLogger("swarm.daemon.planning")

DEFAULT_BYTES_PER_S = 100e6 / 8
"""Assumed for a link nobody has measured yet when no other link is known either (100 Mbit/s)."""
_UNKNOWN_MEMORY_BYTES = 1 << 40


@dataclass(frozen=True)
class SwarmInput:
    plan_input: PlanInput
    measured_links: int
    """Directed links with a measurement of their own (the rest are filled in, see `swarm_plan_input`)."""
    filled_links: int
    direct_input: PlanInput | None = None
    """`plan_input` before relayed links became their paths (`relays`: who relays whom), for `plan_relayed`."""
    relays: dict = dataclasses.field(default_factory=dict)


def swarm_plan_input(peers: list[PeerAnnouncement], links: list[LinkMeasurement], spec: ModelSpec) -> SwarmInput:
    """The scheduler's input from the DHT's announcements and link measurements.

    Compute speed: each peer measured layers/s of one reference micro-batch, times the FLOPs of that layer.
    A link i->j takes its own measurement, else the reverse direction's, else the median of all measured
    links (100 Mbit/s and 1 ms when none is known): a new peer is planned at a typical speed until probed.
    One-way delay is half the round-trip time, the smaller of the two ends' (both time the same round trip, and
    a probe answered behind queued bytes reads long).
    """
    if not peers:
        raise ValueError("no peers announced")
    ids = [p.peer_id for p in sorted(peers, key=lambda p: p.peer_id)]
    by_id = {p.peer_id: p for p in peers}
    index = {pid: i for i, pid in enumerate(ids)}
    n = len(ids)
    bandwidth = np.full((n, n), np.nan)
    delay = np.full((n, n), np.nan)
    burst = np.full((n, n), np.nan)
    measured = 0
    for m in links:
        if m.src in index and m.dst in index and m.bytes_per_s > 0:
            bandwidth[index[m.src], index[m.dst]] = m.bytes_per_s
            delay[index[m.src], index[m.dst]] = m.rtt_s / 2
            burst[index[m.src], index[m.dst]] = m.burst_bytes
            measured += 1
    # a link's two ends each time the same round trip (out one direction, back the other); queueing only adds to
    # it, so the smaller is the link's: a probe answered behind the other end's probe bytes read 513 ms on a 1 ms
    # link (s56's 1 Mbit/s namespace cell, whose plan then predicted 1.35 s a step for a 0.71 s one)
    delay = np.fmin(delay, delay.T)
    # the reverse direction's figure, then the median of the measured links
    known_bandwidth = bandwidth[~np.isnan(bandwidth)]
    known_delay = delay[~np.isnan(delay)]
    bandwidth = np.where(np.isnan(bandwidth), bandwidth.T, bandwidth)
    known_burst = burst[~np.isnan(burst)]  # an unmeasured direction's bucket comes with the rate it borrows
    burst = np.where(np.isnan(burst), burst.T, burst)
    burst = np.where(np.isnan(burst), np.median(known_burst) if known_burst.size else 0.0, burst)
    off = ~np.eye(n, dtype=bool)
    filled = int((np.isnan(bandwidth) & off).sum())
    bandwidth = np.where(
        np.isnan(bandwidth), np.median(known_bandwidth) if known_bandwidth.size else DEFAULT_BYTES_PER_S, bandwidth
    )
    delay = np.where(np.isnan(delay), np.median(known_delay) if known_delay.size else 1e-3, delay)
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(delay, 0.0)
    planned = tuple(
        Peer(
            peer_id=pid,
            compute_flops_per_s=max(by_id[pid].compute_layers_per_s, 1e-6) * max(spec.flops_per_layer, 1.0),
            memory_bytes=float(by_id[pid].memory_bytes or _UNKNOWN_MEMORY_BYTES),
            region=by_id[pid].address,
        )
        for pid in ids
    )
    np.fill_diagonal(burst, 0.0)
    # two unreachable peers talk through a relay: their link is priced as its two legs (swarm.scheduler.relays)
    direct, relays = PlanInput(planned, delay, bandwidth, burst), relays_of(peers)
    return SwarmInput(relayed_input(direct, relays), measured, filled, direct, relays)


def live_search(n_stages: int | None, seed: int = 0, replicas: int = 1) -> SearchConfig:
    """`n_stages` fixed (or the planner's choice); `replicas` per stage where the peers allow it (fewer when
    there are not enough: peers // stages), 0: the cost model's choice."""
    if not replicas:
        return SearchConfig(seed=seed, stages=n_stages)
    return SearchConfig(seed=seed, stages=n_stages, max_replicas=replicas, replica_fractions=(1.0,))


def with_even_layers(made: Plan, plan_input: PlanInput, spec: ModelSpec, cost=None) -> Plan:
    """`made`'s peers, order and pairing with the layers split evenly, and that layout's predicted step (by
    `cost`, default `FullCost` on `plan_input`; with NAT'd peers `relays.shared_cost`, the tunnels priced)."""
    from swarm.scheduler.cost import FullCost, Layout, even_layers
    from swarm.scheduler.search import layout_to_plan

    index = {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    grid = np.array([[index[pid] for pid in stage.peer_ids] for stage in made.stages])
    layout = Layout(grid, even_layers(spec.layers, len(made.stages)))
    unused = np.array([index[pid] for pid in made.unused_peer_ids], dtype=np.int64)
    breakdown = (cost or FullCost(plan_input, spec)).evaluate(layout)
    return layout_to_plan(layout, breakdown, plan_input, made.cost_model, unused, made.version)


def role_in_plan(record: PlanRecord, peer_id: str) -> StageRole | None:
    """This peer's stage (and replica: its index in the stage's `peer_ids`) under a published plan, or None if
    it is on standby."""
    place = record.document.place_of(peer_id)
    if place is None:
        return None
    stage = record.document.stages[place[0]]
    n_stages = record.document.n_stages
    return StageRole(place[0], n_stages, stage.layer_start, stage.layer_end, record.version, replica=place[1])


class Planner:
    """Makes and publishes plans when this peer leads (`elected_planner`) and the membership changed.

    Lease: while elected it renews its planner lease (`dht.planner_until`, DHT time, now + lease_s) and
    re-announces (`reannounce`) every lease_s/3, from `round` and from `keep_lease`'s thread (a long search
    must not let it lapse). Only the planner re-announces that often; it stops renewing once it is not elected.

    A change that loses plan peers (dead: missed heartbeats; leaving: announced so) is REPAIRED (`repair_plan`):
    published at once, without the settle wait, since nobody moves but the standby. A joiner becomes one more
    replica of the busiest stage (`grow_plan`), also at once; the plan's standbys stay the takeover reserve.
    `replicas` (--replicas N) sizes the first plan (and a full re-search) only.
    """

    def __init__(
        self,
        cfg: PlanningConfig,
        dht,
        spec: ModelSpec,
        n_stages: int | None,
        *,
        settle_s: float = 2.0,
        probe_wait_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
        liveness: Liveness | None = None,
        codec_bytes: Callable[[str], float] | None = None,
        epilogue: bool = False,
        codec_speed: Callable[[], CodecSpeed] | None = None,
        epilogue_only: Callable[..., str | None] | None = None,
        bits: BitsPolicy | None = None,
        dht_time: Callable[[], float] = time.time,
        reannounce: Callable[[], object] | None = None,
        calibrator: Calibrator | None = None,
        precisions: Callable[..., tuple[str, ...] | None] | None = None,
        repack=None,  # a swarm.daemon.repack.RepackWatch: repacks the plan when its stages froze more layers
    ):
        """`cfg` says how to plan (min peers, seed, replicas, even layers, lease); the rest are collaborators.
        Without link probes (`cfg.probe_links` False) it waits for none (`probe_wait_s` 0)."""
        self.dht, self.spec, self.n_stages, self.min_peers = dht, spec, n_stages, cfg.min_peers or n_stages or 1
        self.settle_s, self.seed, self.clock = settle_s, cfg.seed, clock
        self.probe_wait_s = probe_wait_s if cfg.probe_links else 0.0
        self.replicas, self.liveness, self.even_layers = cfg.replicas, liveness, cfg.even_layers
        self.codecs = CodecChoice(spec, codec_bytes, epilogue, codec_speed, bits)
        """the plan's link and epilogue codecs, chosen from the measured links (`swarm.daemon.codec_choice`)"""
        self.epilogue_only = epilogue_only
        """Chooses a plan's epilogue-only compression (`--plan-epilogue-only`: its `bw_epilogue`, or None) when the
        planner makes it, from the announced speeds, and again when it calibrates it, from the stages' measured
        clocks: (stages, plan input, spec[, seconds a micro-batch per stage]); None: plans leave it to the peers'
        flags."""
        self.calibrator, self.precisions, self.repack = calibrator, precisions, repack
        """precisions: `precision_planner`'s (stage dicts, announcements, quiet=False) -> one per stage, or None;
        called for each shape's best layout inside the search (`precision_speeds`) and on the plan made"""
        self.precision_watch = PrecisionWatch(precisions) if precisions is not None else None  # from announced figures
        """Re-predicts the followed plan from its peers' measured clocks (`swarm.daemon.calibrate`); None: off."""
        self.lease_s, self.dht_time, self.reannounce = cfg.planner_lease_s, dht_time, reannounce  # time.time: DHT time
        self.lease = AdaptiveLease(cfg.planner_lease_s)
        """the lease's current length: `lease_s`, stretched while renewals come late (`swarm.daemon.lease`)"""
        self._claimed_s = cfg.planner_lease_s
        """the length of the lease last claimed (its renewal was at `dht.planner_until` minus this)"""
        self._stretched = False
        """whether the last claim was stretched (logged only when that changes)"""
        self.leading = False
        """Whether the last look at the DHT elected this peer: what `keep_lease` renews on."""
        self._led_since: float | None = None
        self._lapsed_silent: dict[tuple[str, float], bool] = {}
        self._dropped: dict[str, str] = {}
        """the current plan's peers left out of the last round, and why (logged when it changes)"""
        self._seen: tuple[frozenset[str], tuple[str, ...]] = (frozenset(), ())
        self._since = 0.0
        self._exhausted = False
        self.bans = RunBans()
        """peers the run's trainers banned (`swarm.daemon.bans`): gone for every plan of this run"""
        self.joins = JoinWatch(clock=liveness.schedule_s if liveness is not None else clock)
        """peers newly named in a plan that never follow it (`swarm.daemon.joiners`): gone, held back a while"""
        self._last: PlanRecord | None = None
        """The newest valid plan seen: what to repair once its lost peer's announcement expired (then the
        plan no longer validates and the DHT's reader falls back to an older one)."""
        self._last_at = 0.0
        """when `_last` last changed version (`quiet_for`)"""
        self._watched: frozenset[str] = frozenset()
        """the peers the last round's heartbeats went to (`beat` keeps them going between whole looks)"""
        self._silent_seen: frozenset[str] = frozenset()
        """the peers the heartbeats found silent as of the last round"""

    def is_leader(self, peers: list[PeerAnnouncement]) -> bool:
        """Whether this peer plans now: elected by lease among the delegated planners of an owned run (the
        trusted ones of a private run), among every announced peer in an unowned run."""
        planners = _planners(self.dht)
        if _restricted(self.dht) and self.dht.peer_id not in planners:
            return False  # not delegated: never plans, whatever its id or lease
        return elected_planner(peers, planners, now=self.dht_time()) == self.dht.peer_id

    def renew_lease(self) -> bool:
        """Renews the lease (and re-announces) if this peer leads and a third of the lease has passed."""
        now = self.dht_time()
        renewed_at = getattr(self.dht, "planner_until", 0.0) - self._claimed_s
        if not self.leading or now < renewed_at + self.lease_s / 3:  # every third of the configured lease
            return False
        # the lease claimed covers a late renewal's gap and the store's own time (measured last renewal): it
        # stretches while renewals stall (`swarm.daemon.lease`), so a loaded planner does not lapse and flap
        length = self._claimed_s = self.lease.claim(now)
        stretched = length > self.lease_s * 1.5
        if stretched != self._stretched:  # told when it starts and ends, not at every renewal
            self._stretched = stretched
            log.info("planner lease renewals are %s: lease %.0f s", "late (a loaded machine)" if stretched else
                     "prompt again", length)  # fmt: skip
        self.dht.planner_until = now + length
        if self.reannounce is not None:
            try:
                self.reannounce()
            except Exception as e:  # the next renewal retries; the lease lapses only if all of them fail
                log.warning("planner lease renewal failed: %s", e)
        self.lease.stored(self.dht_time() - now)
        return True

    def keep_lease(self, stop) -> None:
        """Renews the lease every lease_s/3 while this peer leads, until `stop` (a threading.Event) is set."""
        while not stop.wait(self.lease_s / 3):
            self.renew_lease()

    def inherit(self, peers: list[PeerAnnouncement], current: PlanRecord | None) -> PlanRecord | None:
        """The plan the peers follow, when it is newer than the authority's `current` (the authority changed
        and this planner has published nothing yet): its stages are republished, not searched anew."""
        newest = current.version if current is not None else 0
        if max((p.plan_version for p in peers), default=0) <= newest or not hasattr(self.dht, "followed_plan"):
            return None
        found = self.dht.followed_plan(self.spec.layers, peers)
        return found if found is not None and found.version > newest else None

    def gone(self, peers: list[PeerAnnouncement]) -> frozenset[str]:
        """Announced peers to plan without: leaving, or silent to the heartbeats for 3 s."""
        leaving = {p.peer_id for p in peers if p.leaving}
        silent = self.liveness.gone() if self.liveness is not None else frozenset()
        return frozenset(leaving | ((silent | self.lapsed_and_silent(peers)) - {self.dht.peer_id}))

    def lapsed_and_silent(self, peers: list[PeerAnnouncement]) -> set[str]:
        """Former planners whose lease lapsed and that do not answer one `Status` ping: gone at once.

        Their lease renewals were heartbeats (every lease_s/3): a lapsed lease is already a silence, which the
        watch that began when this planner took over would otherwise wait `gone_after_s` more to see. Only in
        that first `gone_after_s` of leading, one ping per lapsed lease; after it the watch alone decides (a
        stalled planner that answers again is eligible again, as a standby).
        """
        if self.liveness is None or self._led_since is None:
            return set()
        if self.clock() - self._led_since > self.liveness.cfg.gone_after_s:
            self._lapsed_silent.clear()
            return set()
        now = self.dht_time()
        for p in peers:
            key = (p.peer_id, p.planner_until)
            if 0 < p.planner_until <= now and p.peer_id != self.dht.peer_id and key not in self._lapsed_silent:
                try:
                    self._lapsed_silent[key] = not self.liveness.ping(p.peer_id)
                except Exception:  # a broken prober counts as silence, as in the watch
                    self._lapsed_silent[key] = True
                if self._lapsed_silent[key]:
                    log.info("planner %s: lease lapsed and silent to Status: planned without", p.peer_id)
        return {pid for (pid, _), silent in self._lapsed_silent.items() if silent}

    def round(self, peers: list[PeerAnnouncement] | None = None) -> Plan | PlanRecord | None:
        """One look at the swarm; publishes and returns a new plan (or re-published record) if one is due.
        `peers`: the run's announcements if the caller has just read them (else they are read here). After a
        publish the heartbeats go out at once: each says the new version (`PingRequest.newest_plan`), and a peer
        settled in the old plan looks at the DHT for it then (`swarm.daemon.peer`) instead of polling."""
        peers = self.dht.peers() if peers is None else peers
        if self.liveness is None:
            return self._round(peers)
        before = self.dht.published_plan
        done = self._round(peers)
        if self.dht.published_plan > before:
            self.liveness.tell(p.peer_id for p in peers if p.peer_id != self.dht.peer_id)
        return done

    def quiet_for(self, seconds: float) -> bool:
        """Whether this planner leads a swarm that has been quiet for `seconds`: the plan it sees, the peers it
        counts alive and the trainers all unchanged that long, and nothing left to calibrate. Then its
        whole look at the DHT may come less often (`swarm.daemon.peer`), its heartbeats going on in between
        (`beat`): a settled planner read the run's keys twice a second, searches that every other peer's DHT node
        serves."""
        now = self.clock()
        return (
            self.leading
            and self._last is not None
            and now - self._since >= seconds
            and now - self._last_at >= seconds
            and (self.calibrator is None or self.calibrator.done)
        )

    def beat(self) -> bool:
        """Between two whole looks of a leading planner: the heartbeat round, when one is due, to the peers the
        last look watched (no DHT read). Whether the heartbeats found a peer silent that the last look did not:
        then the next look is due at once, so a death is planned around as soon as before."""
        if not self.leading or self.liveness is None or not self._watched:
            return False
        self.liveness.round(self._watched)
        return bool(self.liveness.gone() - self._silent_seen)

    def _round(self, peers: list[PeerAnnouncement]) -> Plan | PlanRecord | None:
        self.leading = self.is_leader(peers)
        if not self.leading:
            self._led_since = None
            self.lease.forget()
            return None
        self._led_since = self.clock() if self._led_since is None else self._led_since
        self.renew_lease()
        current = self.dht.get_plan(self.spec.layers, peers=peers, check_trainers=False)
        if current is not None and (self._last is None or current.version >= self._last.version):
            if self._last is None or current.version != self._last.version:
                self._last_at = self.clock()
            self._last = current
        current = self._last if current is None or current.version < self._last.version else current
        inherited = self.inherit(peers, current)
        if inherited is not None:
            log.info("inheriting plan %d, which the peers follow: republishing its stages", inherited.version)
            current = self._last = inherited
        if self.repack is not None:  # a frozen prefix the stages applied, held for the next plan published
            current = self.repack.carried(current)
        if self.liveness is not None and current is not None:
            self._watched = frozenset(current.document.named_peers() | {p.peer_id for p in peers} - {self.dht.peer_id})
            self.liveness.round(self._watched)
        announced = self.dht.trainers()
        why: dict[str, str] = {p.peer_id: "leaving" for p in peers if p.leaving}
        silent = self.gone(peers)
        self._silent_seen = self.liveness.gone() if self.liveness is not None else frozenset()
        why |= {pid: "silent to the heartbeats" for pid in silent if pid not in why}
        banned = self.bans.update(announced, current)  # a peer the trainers banned counts as gone
        held = self.joins.update(current, peers)  # named by a plan, never followed it: held back
        why |= {pid: "banned by a trainer" for pid in banned} | {pid: "never followed its plan" for pid in held}
        gone = silent | banned | held
        alive = frozenset(p.peer_id for p in peers) - gone
        if current is not None and self.liveness is not None:  # a joiner counts once the heartbeats reached it
            alive -= unproven(alive, current.document.named_peers(), self.liveness.answered, self.dht.peer_id)
        self._note_dropped(current, peers, alive, why)
        trainers = sorted(t.peer_id for t in announced)[:MAX_PLAN_TRAINERS]
        now = self.clock()
        if (alive, tuple(trainers)) != self._seen:
            self._seen, self._since = (alive, tuple(trainers)), now
        same_peers = current is not None and current.document.named_peers() == alive
        # the first plan waits for --min-peers; later ones heal the swarm with whoever is left (a plan naming a
        # peer that left no longer validates, so "a plan exists" is whether the authority published any)
        if current is None and len(alive) < self.min_peers and not self.plan_existed(peers):
            return None
        unchanged = same_peers and inherited is None and list(current.document.trainer_ids or ()) == trainers
        if unchanged and self.repack is not None and (done := self.repack.round(self, current, peers)):
            return done
        if unchanged and self.calibrator is not None and (done := self.recalibrate(current, peers, alive)):
            return done
        watch = self.precision_watch
        if unchanged and watch is not None and (done := watch.round(self, current, peers)):
            return done
        if unchanged and self.codecs.enabled and alive:
            return self.rechoose_codecs(current, peers, alive)
        if not alive or unchanged:
            return None
        repaired = None
        if current is not None and not same_peers:
            # a loss is repaired (nobody else moves); a joiner becomes one more replica of the busiest stage
            lost = any(p not in alive for p in current.document.used_peers())
            repaired = repair_plan(current.document, alive, gone)
            if repaired is not None:
                repaired = grow_plan(repaired, {p.peer_id: p.compute_layers_per_s for p in peers if p.peer_id in alive})
            if repaired is None and inherited is not None and not lost:
                repaired = current.document  # a new planner first keeps the followed stages
        if repaired is None and inherited is None and now - self._since < self.settle_s:
            return None  # peers are still arriving (or leaving): wait for the set to settle
        version = self.next_version(peers)
        if version is None:
            return None
        if same_peers or repaired is not None:  # no layer moves; only a standby takes a lost place
            self.dht.publish_plan(version, (repaired or current.document).replace(trainer_ids=tuple(trainers)))
            what = "repaired" if repaired is not None and repaired.stages != current.document.stages else "same"
            log.info("published plan %d: plan %d's stages (%s), trainers %s", version, current.version, what, trainers)
            return self.dht.get_plan(self.spec.layers, peers=peers, check_trainers=False)
        links = self.dht.links()
        swarm = swarm_plan_input([p for p in peers if p.peer_id in alive], links, self.spec)
        if swarm.filled_links and now - self._since < self.probe_wait_s:
            return None  # give the probes a little time: planning on guesses moves stages twice
        stages = min(self.n_stages, len(alive)) if self.n_stages else None
        # a relay's rate is divided among the relayed links the layout sends through it (swarm.scheduler.relays)
        search = live_search(stages, self.seed, self.replicas)
        # the stages' precisions under the loss budget are chosen for each shape's best layout inside the search
        speeds_for = None if self.precisions is None else precision_speeds(self.precisions, swarm.direct_input, peers)
        made = plan_relayed(swarm.direct_input, self.spec, swarm.relays, search, version=version, speeds_for=speeds_for)
        if self.even_layers:
            shared = shared_input(swarm.direct_input, swarm.relays, made)
            made = with_even_layers(
                made, shared, self.spec, shared_cost(swarm.direct_input, swarm.relays, made, self.spec)
            )
        # the scheduler's plan as the document peers follow, keeping the frozen prefix (F)
        document = with_frozen(
            PlanDocument.from_wire(made.to_dict()),
            current.document if current else None,
            compute_keys={p.peer_id: p.compute_key for p in peers},
        )
        precisions = self.precisions(document.stage_dicts(), peers) if self.precisions else None
        document = document if precisions is None else document.with_precisions(precisions)
        if self.precisions:  # the stages measure what the precisions are then chosen again from (PrecisionWatch)
            document = document.replace(probe_sensitivity=True)
        priced = at_precisions(swarm.plan_input, document, peers)  # codecs chosen at the stages' speeds to be
        document = self.codecs.apply(document, priced)
        if self.epilogue_only is not None:  # which backward messages go compressed, from the same measurements
            chosen = self.epilogue_only(document.stage_dicts(), priced, self.spec, links=document.codecs)
            document = document.replace(bw_epilogue=chosen)
        # what the relayed links' two legs add (None: no relayed link): the tunnels' per-message cost is in the
        # plan's step, not here, so `swarm experiment nat`'s "no more than its two legs" is judged on the legs
        extra = relay_extra_s(made, swarm.direct_input, swarm.relays, self.spec, tunnel_s=0.0)
        self.dht.publish_plan(version, document.replace(relay_extra_s=extra, trainer_ids=tuple(trainers)))
        log.info(
            "published plan %d: %d stages x %d replicas over %d peers (%d links measured, %d assumed), "
            "predicted %.3f s/step",
            version,
            made.n_stages,
            len(made.stages[0].peer_ids) if made.stages else 0,
            len(alive),
            swarm.measured_links,
            swarm.filled_links,
            made.step_time_s,
        )
        return made

    def _note_dropped(self, current: PlanRecord | None, peers, alive: frozenset[str], why: dict[str, str]) -> None:
        """Logs, once per change, why a peer the current plan uses is not among those planned with now: a plan
        that drops a live peer (a slow link's late heartbeats or lapsed announcement) says which it was."""
        if current is None:
            return
        announced = {p.peer_id for p in peers}
        lapsed, unreached = "not announced (its DHT record lapsed)", "not reached by a heartbeat yet"
        dropped = {
            pid: why.get(pid) or (lapsed if pid not in announced else unreached)
            for pid in current.document.used_peers()
            if pid not in alive and pid != self.dht.peer_id
        }
        if dropped and dropped != self._dropped:
            listed = ", ".join(f"{p} ({w})" for p, w in dropped.items())
            log.info("planning without plan %d's %s", current.version, listed)
        self._dropped = dropped

    def rechoose_codecs(self, current: PlanRecord, peers: list[PeerAnnouncement], alive: frozenset[str]):
        """Republishes the current stages with codecs chosen again once the links' measurements moved past the
        hysteresis (the same stages: only the codecs change); None while they hold."""
        plan = current.document
        swarm = swarm_plan_input([p for p in peers if p.peer_id in alive], self.dht.links(), self.spec)
        priced = at_precisions(swarm.plan_input, plan, peers)
        if not self.codecs.moved(plan, priced):
            return None
        chosen = self.codecs.apply(plan, priced)
        if chosen.same_codecs(plan):
            return None  # moved, but to the same choice: nothing to switch
        version = self.next_version(peers)
        if version is None:
            return None
        self.dht.publish_plan(version, chosen)
        log.info("published plan %d: plan %d's stages with codecs chosen again", version, current.version)
        return self.dht.get_plan(self.spec.layers, peers=peers, check_trainers=False)

    def recalibrate(self, current: PlanRecord, peers: list[PeerAnnouncement], alive: frozenset[str]):
        """Republishes the current stages with the step time predicted from the peers' measured clocks, once
        their window of steps is complete (`Calibrator`); None until then."""
        from swarm.daemon.calibrate import calibrated_breakdown

        plan = current.document
        measured = self.calibrator.observe(plan)
        if measured is None:
            return None
        swarm = swarm_plan_input([p for p in peers if p.peer_id in alive], self.dht.links(), self.spec)
        after, before = calibrated_breakdown(plan, swarm.plan_input, self.spec, measured)
        version = self.next_version(peers)
        if version is None:
            return None
        figures = {pid: dataclasses.asdict(m) for pid, m in sorted(measured.items())}
        first = plan.first_step_time_s if plan.first_step_time_s is not None else plan.step_time_s
        calibrated = plan.replace(
            step_time_s=after.total_s,
            breakdown=tuple(dataclasses.asdict(after).items()),
            measured=tuple((pid, tuple(f.items())) for pid, f in figures.items()),
            first_step_time_s=first,
        )
        if self.epilogue_only is not None:  # chosen again from the stages' measured clocks (head and loss included)
            clocks = [max((measured[p].micro_batch_s for p in st.peer_ids if p in measured), default=0.0)
                      for st in plan.stages]  # fmt: skip
            if all(c > 0 for c in clocks):
                chosen = self.epilogue_only(plan.stage_dicts(), swarm.plan_input, self.spec, clocks, links=plan.codecs)
                calibrated = calibrated.replace(bw_epilogue=chosen)
        self.dht.publish_plan(version, calibrated)
        log.info(
            "published plan %d: plan %d's stages, predicted %.3f s/step from the peers' clocks (%.3f before; "
            "overhead %.3f s, compute %.3f s): %s",
            version, current.version, after.total_s, before.total_s, after.overhead_s, after.compute_s, figures,
        )  # fmt: skip
        return self.dht.get_plan(self.spec.layers, peers=peers, check_trainers=False)

    def plan_existed(self, peers: list[PeerAnnouncement]) -> bool:
        """Whether the swarm has followed a plan: the authority published one, or a peer follows one (this
        planner took over from a planner that died, whose plans no longer count)."""
        return self.dht.newest_plan_version(peers) > 0 or any(p.plan_version > 0 for p in peers)

    def next_version(self, peers: list[PeerAnnouncement]) -> int | None:
        """One above every version the authority published and (in an unowned run) the peers follow.

        A planner taking over from one that left numbers on from what the peers follow, so they switch. In an
        unowned run (no delegated or trusted planners) an announced peer can inflate that floor (as it can win
        the election with a ground key): at MAX_PLAN_VERSION this planner stops publishing, with an error,
        rather than overflow.
        """
        floor = self.dht.newest_plan_version(peers)
        if not _restricted(self.dht):
            floor = max([floor, *(p.plan_version for p in peers)])
        if floor >= MAX_PLAN_VERSION:
            if not self._exhausted:
                log.error("plan versions are exhausted (%d published or followed): not publishing", floor)
                self._exhausted = True
            return None
        return floor + 1


def _planners(dht) -> tuple[str, ...]:
    """The planners the run names (`SwarmDHT.planners`: an owned run's delegates, a private run's trusted ones)."""
    named = getattr(dht, "planners", None)
    return tuple(named()) if named is not None else tuple(dht.config.trusted_planners)


def _restricted(dht) -> bool:
    """Whether the run names its planners (owned or private) rather than electing the lowest id."""
    return bool(getattr(dht, "restricted", bool(dht.config.trusted_planners)))
