"""The planner's heartbeats: a plan peer that stops answering `Ping` is gone long before its DHT record is.

An announcement lives a ttl (tens of seconds) after its peer dies, so waiting for it to expire stalls every
re-plan by that much. The elected planner therefore calls every plan peer's `Ping` every `every_s` (1 s);
a peer unreachable for `gone_after_s` (3 s) is treated as gone and the plan repaired without it, even though
its announcement has not expired; once it answers again it is eligible again (a standby, say). Any reply,
a refusal included (a standby answers `Ping` with "not serving"), proves the peer is there: only
UNAVAILABLE, DEADLINE_EXCEEDED and transport failures count as silence. A peer the plan does not name yet is
planned only once it answered (`answered`, `swarm.daemon.joiners`): an announcement alone is a claim.

Silence is judged on the watcher's own schedule, so that a loaded machine does not make the watcher see
everyone as gone (seen once: a planner declared every peer silent and planned a 1-stage pipeline). Time
the watcher itself was not watching, its rounds late because its process was descheduled or its loop
blocked on the DHT, counts as nobody's silence: each round adds at most `max_gap_s` (2 rounds' worth) to
the silence clock, whatever the wall clock says. And a peer is gone only after `min_misses` consecutive
unanswered pings, not one slow ping spread over the window.

The planner's pings (`status_prober` with `adaptive_trips`) time out as the trainer's do
(`swarm.runtime.heartbeat.RoundTrips`, RFC 6298): each peer's deadline is its smoothed round trip plus four
deviations, within [1 s, 10 s], so a peer that answers in 2 s on a loaded machine is slow, not silent. A killed
peer refuses the connection at once and is still gone after `gone_after_s`.

The prober and the clock are injected: tests drive a fake clock and a fake prober, no sleeps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from swarm.peers.transport import start_all_threads
from swarm.runtime.heartbeat import HeartbeatConfig, RoundTrips
from swarm.runtime.routing import REROUTE_CODES

__all__ = ["Liveness", "LivenessConfig", "adaptive_trips", "status_prober"]

log = logging.getLogger("swarm.daemon.liveness")

SILENT_CODES = REROUTE_CODES
"""The codes that may mean a dead peer, the same the trainer's driver reroutes on."""


POOL_THREADS = 8
"""Threads pinging peers in parallel, started with the watcher."""


@dataclass(frozen=True)
class LivenessConfig:
    every_s: float = 1.0
    """How often each watched peer is pinged."""
    gone_after_s: float = 3.0
    """Unreachable this long since its last answer (or since watching began): gone."""
    timeout_s: float = 1.0
    """One ping's deadline."""
    min_misses: int = 2
    """Consecutive unanswered pings before a peer can be gone, however long the silence."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= self.gone_after_s or self.every_s <= 0 or self.min_misses < 1:
            raise ValueError("LivenessConfig: need every_s > 0, 0 < timeout_s <= gone_after_s and min_misses >= 1")

    @property
    def max_gap_s(self) -> float:
        """The most one round adds to the silence clock: a later round was the watcher's own stall."""
        return 2 * self.every_s


class Liveness:
    """Who among the watched peers answers; `gone()` is the set to plan without."""

    def __init__(
        self,
        ping: Callable[[str], bool],
        cfg: LivenessConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        heard: Callable[[str], float | None] | None = None,
    ):
        """`ping(peer_id)` -> True if the peer answered (any reply), False if silent; must not raise.
        `heard(peer_id)` -> when (on `clock`) an authenticated call of that peer last reached this one, None if
        never: a peer whose call arrived since the previous round is not silent, whatever its ping did (over a
        saturated slow link the ping's answer waits behind the tensor bytes that peer is sending us; seen at
        1 Mbit/s: the planner dropped the live stage 0 feeding it activations and planned a 1-stage pipeline).
        It does not make a peer `answered`: only a ping proves this peer can dial it."""
        self.ping, self.cfg, self.clock, self.heard = ping, cfg or LivenessConfig(), clock, heard
        self._last_answer: dict[str, float] = {}
        """peer -> the silence clock (`_watched`) at its last answer, or when watching it began"""
        self._misses: dict[str, int] = {}
        """peer -> consecutive unanswered pings"""
        self._answered: set[str] = set()
        """watched peers that answered at least one ping since watching them began"""
        self._watched = 0.0
        """The silence clock: seconds the watcher was on schedule, as of its last round (at `_round_at`)."""
        self._round_at: float | None = None
        self.stalled_s = 0.0
        """Total lateness of the watcher's own rounds, not counted as anyone's silence (for logs and tests)."""
        self._next = 0.0
        self._pool = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="liveness")
        # all now: a ping still running when the next round starts (a loaded machine) would otherwise add a
        # thread mid-run, and a soak counts a peer's threads (issue 28: one peer went from 120 to 122)
        start_all_threads(self._pool, POOL_THREADS)

    def round(self, peers: Iterable[str]) -> bool:
        """Pings `peers` (in parallel) if a round is due; returns whether it pinged. Peers no longer watched
        are forgotten (a re-watched peer starts a new grace period)."""
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.cfg.every_s
        previous = self._round_at
        self._advance(now)
        peers = sorted(set(peers))
        self._last_answer = {p: self._last_answer.get(p, self._watched) for p in peers}
        self._misses = {p: self._misses.get(p, 0) for p in peers}
        self._answered &= set(peers)
        was_gone = self.gone()
        for pid, answered in zip(peers, self._pool.map(self._safe_ping, peers), strict=True):
            # a peer that called us since the last round is alive though its ping's answer queued behind them
            if not (answered or self._heard_since(pid, previous)):
                self._misses[pid] += 1
                continue
            if pid in was_gone:
                log.info("peer %s %s again: eligible again", pid, "answers" if answered else "calls this one")
            self._last_answer[pid], self._misses[pid] = self._watched, 0
            if answered:
                self._answered.add(pid)
        self._advance(self.clock())  # the pings' own time counts, up to the cap (a stalled round is no proof)
        return True

    def tell(self, peers: Iterable[str]) -> None:
        """Pings `peers` now, on the pool and without waiting, outside the rounds and their bookkeeping: a ping says
        the newest plan this peer published (`status_prober`'s `newest_plan`), so a planner that just published
        one has its peers hear of it at once rather than at the next round."""
        for pid in sorted(set(peers)):
            self._pool.submit(self._safe_ping, pid)

    def _advance(self, now: float) -> None:
        """Moves the silence clock to `now`, counting at most `max_gap_s` since the last round."""
        if self._round_at is not None:
            elapsed = max(0.0, now - self._round_at)
            late = max(0.0, elapsed - self.cfg.max_gap_s)
            if late > 0:
                self.stalled_s += late
                log.info("heartbeat round %.1f s late (this process was stalled): not counted as silence", late)
            self._watched += elapsed - late
        self._round_at = now

    def _silence(self, now: float) -> float:
        """The silence clock at `now`: as of the last round, plus up to `max_gap_s` since."""
        since = 0.0 if self._round_at is None else min(max(0.0, now - self._round_at), self.cfg.max_gap_s)
        return self._watched + since

    def _heard_since(self, pid: str, since: float | None) -> bool:
        if self.heard is None or since is None:
            return False
        try:
            at = self.heard(pid)
        except Exception as e:  # noqa: BLE001 - a broken source must not take the planner down: no proof
            log.debug("heard(%s) failed: %s", pid, e)
            return False
        return at is not None and at >= since

    def _safe_ping(self, pid: str) -> bool:
        try:
            return bool(self.ping(pid))
        except Exception as e:  # a broken prober must not take the planner down: count it as silence
            log.debug("ping of %s failed: %s", pid, e)
            return False

    def gone(self) -> frozenset[str]:
        """Watched peers silent for more than `gone_after_s` of the watcher's own schedule, with at least
        `min_misses` consecutive pings unanswered."""
        now = self._silence(self.clock())
        return frozenset(
            p
            for p, t in self._last_answer.items()
            if now - t > self.cfg.gone_after_s and self._misses.get(p, 0) >= self.cfg.min_misses
        )

    def schedule_s(self) -> float:
        """Seconds the watcher has been on schedule (its own stalls left out): a clock for deadlines that a loaded
        planner must not see pass while it was not looking (`swarm.daemon.joiners.JoinWatch`)."""
        return self._silence(self.clock())

    def answered(self, peer_id: str) -> bool:
        """Whether `peer_id` answered a ping since it is watched, and its latest ping too: a peer is planned only
        once it proved it can be reached (an announcement is a claim; a stranger behind a relay that does not
        hold it, or with no server at all, never answers), and not while it misses pings."""
        return peer_id in self._answered and self._misses.get(peer_id, 0) == 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def status_prober(
    channels,
    addresses: Callable[[], dict[str, str]],
    timeout_s: float = 1.0,
    trips: RoundTrips | None = None,
    clock: Callable[[], float] = time.monotonic,
    newest_plan: Callable[[], int] | None = None,
) -> Callable[[str], bool]:
    """A `ping` over the stage service's `Ping` (what `Status` answers, without its ~1.4 KB reply): any reply, or
    any refusal but silence, is an answer (an older peer's UNIMPLEMENTED too).

    Args:
        channels: the peer's (signed) channel cache.
        addresses: peer id -> address, from the announcements (read each ping: addresses change on restart).
        timeout_s: the ping's deadline (without `trips`).
        trips: each peer's round trips (`swarm.runtime.heartbeat.RoundTrips`, as the trainer's pings): a ping's
            deadline is then that peer's adaptive timeout, and every answer is a sample of it; after a ping
            that timed out the next one waits twice as long (TCP's backoff, up to the table's ceiling), until
            an answer. A peer that answers slowly on a loaded machine raises its own deadline instead of missing
            ping after ping.
        clock: for the round trips.
        newest_plan: the newest plan version this peer published, said in every ping (`PingRequest.newest_plan`):
            a peer settled in an older plan looks at the DHT at once (`swarm.daemon.peer`) instead of polling it.
    """
    from swarm.proto import stage_pb2, stage_pb2_grpc

    backoff: dict[str, float] = {}
    """peer -> the deadline its next ping gets after a timeout (doubled per timeout)"""
    lock = threading.Lock()

    def ping(pid: str) -> bool:
        address = addresses().get(pid)
        if address is None:
            return False
        if trips is None:
            deadline = timeout_s
        else:
            with lock:
                deadline = max(trips.timeout(pid), backoff.get(pid, 0.0))
        begun = clock()
        try:
            request = stage_pb2.PingRequest(newest_plan=newest_plan() if newest_plan is not None else 0)
            stage_pb2_grpc.StageStub(channels.get(address)).Ping(request, timeout=deadline)
        except grpc.RpcError as e:
            if e.code() in SILENT_CODES:
                if trips is not None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    with lock:
                        backoff[pid] = min(2 * deadline, trips.config.ceiling_s)
                return False
        if trips is not None:
            trips.sample(pid, clock() - begun)
            with lock:
                backoff.pop(pid, None)
        return True

    return ping


def adaptive_trips(every_s: float, ceiling_s: float = 10.0) -> RoundTrips:
    """The planner's round-trip table: timeouts from 1 s (a peer never measured) up to `ceiling_s`."""
    return RoundTrips(HeartbeatConfig(interval_s=every_s, floor_s=min(1.0, ceiling_s), ceiling_s=ceiling_s))
