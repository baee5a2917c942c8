"""The trainer's liveness pings: a death is a fact, not a hiccup.

While a step runs the driver pings every peer of its routes (`PingLoop`). A peer is declared dead only when it
stays silent for longer than its own round trips make plausible, and then fails one more, patient probe:

- **Adaptive timeouts** (TCP's retransmission timer, RFC 6298): every answered ping is a round-trip sample;
  a peer's timeout is its smoothed round trip plus four times their mean deviation, kept within
  [`floor_s`, `ceiling_s`] (`RoundTrips`). A peer that answers slowly but answers raises its own timeout.
- **A miss window that grows with it**: a peer is suspect after `misses` timeouts' worth of silence
  (`misses * max(interval_s, timeout)`) since its last answer. Silence is counted on the loop's own schedule:
  a beat that comes late because this process was descheduled adds at most two intervals, so a stalled
  trainer never sees everyone as silent (the planner's watcher does the same, `swarm.daemon.liveness`).
- **A confirming probe**: a suspect gets one more `Ping` with a longer deadline (`confirm_s`, or twice its
  timeout if that is longer); only if that fails too is it declared dead. A killed process refuses the
  connection at once, so it is still declared dead after `misses` beats, as fast as a fixed count of misses
  would; a process that hangs forever is declared dead within `HeartbeatConfig.hang_bound_s`.

The ping and the clock are injected: the unit tests drive a fake clock and slow or hung pings, no sleeps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

from swarm.runtime.routing import spawn

__all__ = ["HeartbeatConfig", "PingLoop", "RoundTrips"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeartbeatConfig:
    """How the trainer tells a dead peer from a slow one while a step runs."""

    interval_s: float = 1.0
    """seconds between the pings of each peer"""
    misses: int = 3
    """timeouts' worth of silence (at least `interval_s` each) that make a peer suspect"""
    floor_s: float = 1.0
    """smallest timeout of one ping, seconds (the timeout of a peer never measured)"""
    ceiling_s: float = 10.0
    """largest timeout of one ping, seconds, however slow the peer's answers were"""
    confirm_s: float = 10.0
    """deadline of the probe that confirms a suspect's death, seconds (twice its timeout where that is longer)"""

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and 0 < self.floor_s <= self.ceiling_s and self.confirm_s > 0):
            raise ValueError("HeartbeatConfig: need interval_s > 0, 0 < floor_s <= ceiling_s and confirm_s > 0")
        if self.misses < 1:
            raise ValueError(f"HeartbeatConfig.misses: expected >= 1, got {self.misses}")

    @property
    def hang_bound_s(self) -> float:
        """Longest a peer that stops answering altogether stays alive in the loop's eyes, from its last answer:
        the largest window, the confirming probe, and a beat on either side."""
        window = self.misses * max(self.interval_s, self.ceiling_s)
        return window + max(self.confirm_s, 2 * self.ceiling_s) + 2 * self.interval_s


class RoundTrips:
    """Each peer's smoothed round trip and its deviation (RFC 6298: gains 1/8 and 1/4), hence its timeout.

    One table lives as long as the driver: what a peer's earlier steps showed carries into the next one.
    """

    def __init__(self, config: HeartbeatConfig):
        self.config = config
        self._srtt: dict[str, float] = {}
        self._rttvar: dict[str, float] = {}
        self._answered: dict[str, float] = {}
        self._lock = threading.Lock()

    def sample(self, peer: str, seconds: float) -> None:
        """An answer from `peer` that took `seconds` from request to reply."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        with self._lock:
            srtt = self._srtt.get(peer)
            if srtt is None:
                self._srtt[peer], self._rttvar[peer] = seconds, seconds / 2
                return
            self._rttvar[peer] = 0.75 * self._rttvar[peer] + 0.25 * abs(srtt - seconds)
            self._srtt[peer] = 0.875 * srtt + 0.125 * seconds

    def answered(self, peer: str, at: float) -> None:
        """`peer` answered a ping at `at` (the loops' clock)."""
        with self._lock:
            self._answered[peer] = max(at, self._answered.get(peer, at))

    def last_answer(self, peer: str) -> float | None:
        """When `peer` last answered a ping, by any loop of this table (None: never)."""
        with self._lock:
            return self._answered.get(peer)

    def timeout(self, peer: str) -> float:
        """How long a ping to `peer` may take before it is late: srtt + 4 rttvar, within [floor, ceiling]."""
        with self._lock:
            srtt = self._srtt.get(peer)
            rto = self.config.floor_s if srtt is None else srtt + 4 * self._rttvar[peer]
        return min(max(rto, self.config.floor_s), self.config.ceiling_s)

    def window(self, peer: str) -> float:
        """Silence since `peer`'s last answer that makes it suspect."""
        return self.config.misses * max(self.config.interval_s, self.timeout(peer))

    def confirm_timeout(self, peer: str) -> float:
        """The deadline of the probe that confirms `peer`'s death."""
        return max(self.config.confirm_s, 2 * self.timeout(peer))

    def srtt(self, peer: str) -> float | None:
        with self._lock:
            return self._srtt.get(peer)


class PingLoop:
    """Pings each of `peers` every `interval_s` while a step runs; declares a peer dead once its silence passed
    its window (`RoundTrips.window`) and a confirming probe failed too. A peer that answered a ping of an earlier
    loop on the same `round_trips` less than `interval_s` ago is not pinged at the first beat (steps are shorter
    than the interval: else every step would begin with a ping of every peer); its silence counts from then.

    At most one heartbeat ping per peer is outstanding: a peer that hangs costs one stuck thread, not one per beat.
    Each ping may take up to `ceiling_s`, so a slow answer still arrives and is measured. `on_dead(peer)` is told
    of each death once, on the loop's thread or on the confirming probe's.

    Args:
        ping: `ping(peer, timeout_s)`, a blocking `Ping` call that raises when the peer does not answer.
        peers: the peers to watch.
        on_dead: told of each death once (never after `stop`).
        config: the intervals, timeouts and misses.
        round_trips: the peers' round trips so far (kept by the driver across steps; default: a fresh table).
        clock: monotonic seconds (injected by tests).
        ping_at_once: ping every peer at the first beat, however recently it answered (only to measure).
    """

    def __init__(
        self,
        ping: Callable[[str, float], object],
        peers: Sequence[str],
        on_dead: Callable[[str], None],
        config: HeartbeatConfig | None = None,
        round_trips: RoundTrips | None = None,
        clock: Callable[[], float] = time.monotonic,
        ping_at_once: bool = False,
    ):
        self.ping, self.peers, self.on_dead = ping, list(dict.fromkeys(peers)), on_dead
        self.ping_at_once = ping_at_once
        """ping every peer at the first beat, however recently it answered (as before; only to measure)"""
        self.config = config or HeartbeatConfig()
        self.round_trips = round_trips or RoundTrips(self.config)
        self.clock = clock
        self.dead: set[str] = set()
        self.silence = dict.fromkeys(self.peers, 0.0)
        """seconds of the loop's own schedule since each peer's last answer (or since watching began)"""
        self.confirming: dict[str, tuple[Future, float, float]] = {}
        """each suspect's confirming probe: (its call, when it was sent, its deadline in seconds)"""
        self._pending: dict[str, Future] = {}
        self._last_beat: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: Future | None = None
        """the loop's run on a call thread (`spawn`), from `__enter__`"""
        self._loop_thread: int | None = None

    def __enter__(self) -> PingLoop:
        self._loop = spawn(self._run, "ping-loop")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None and threading.get_ident() != self._loop_thread:  # not from inside the loop
            wait([self._loop])

    def _timed(self, peer: str, timeout_s: float) -> Callable[[], float]:
        """A ping of `peer` that returns its round trip in seconds (raises as `ping` does)."""

        def call() -> float:
            sent = self.clock()
            self.ping(peer, timeout_s)
            answered = self.clock()
            self.round_trips.sample(peer, answered - sent)
            self.round_trips.answered(peer, answered)
            return answered - sent

        return call

    def beat(self) -> None:
        """One beat: collect the last pings' answers, add to the silent peers' silence, confirm the suspects
        (or declare dead those whose confirming probe ran past its deadline), send the next pings."""
        now, first = self.clock(), self._last_beat is None
        # time the loop was not running (a stalled process) is nobody's silence: at most two intervals a beat
        elapsed = 0.0 if self._last_beat is None else min(max(now - self._last_beat, 0.0), 2 * self.config.interval_s)
        self._last_beat = now
        for peer in self.peers:
            with self._lock:
                if peer in self.dead:
                    continue
                probe = self.confirming.get(peer)
            if probe is not None:
                # the probe's own deadline ends it (gRPC's); a connector that does not enforce one is held to it here
                if now - probe[1] > probe[2] + self.config.interval_s:
                    self._declare(peer, probe[0])
                continue
            pending = self._pending.get(peer)
            if pending is not None and pending.done() and pending.exception() is None:
                self.silence[peer] = 0.0  # answered, however slowly: alive
            else:
                self.silence[peer] += elapsed
            if self.silence[peer] >= self.round_trips.window(peer):
                self._confirm(peer, now)
            elif first and not self.ping_at_once and (since := self._recent_answer(peer, now)) is not None:
                # a loop of an earlier step heard it within the interval (a step is shorter than that): its silence
                # counts from that answer, and the first ping of this loop waits for the next beat
                self.silence[peer] = since
            elif pending is None or pending.done():  # one outstanding: no second ping on top
                self._pending[peer] = spawn(self._timed(peer, self.config.ceiling_s), "heartbeat-ping")

    def _recent_answer(self, peer: str, now: float) -> float | None:
        """Seconds since `peer` last answered a ping of any loop on these round trips, where under an interval."""
        last = self.round_trips.last_answer(peer)
        since = None if last is None else now - last
        return since if since is not None and 0 <= since < self.config.interval_s else None

    def _confirm(self, peer: str, now: float) -> None:
        """One more ping with a longer deadline; its failure declares `peer` dead, its answer clears it."""
        timeout_s = self.round_trips.confirm_timeout(peer)
        log.info("peer %s silent for %.1f s: confirming with a %.0f s probe", peer, self.silence[peer], timeout_s)
        probe = spawn(self._timed(peer, timeout_s), "heartbeat-confirm")
        with self._lock:
            self.confirming[peer] = (probe, now, timeout_s)
        probe.add_done_callback(lambda f, p=peer: self._confirmed(p, f))

    def _confirmed(self, peer: str, probe: Future) -> None:
        """A confirming probe ended: an answer clears the suspect, a failure declares it dead."""
        if probe.exception() is not None:
            self._declare(peer, probe)
            return
        with self._lock:
            if self.confirming.get(peer, (None,))[0] is probe:
                self.silence[peer] = 0.0  # alive: its silence starts afresh
                self._pending.pop(peer, None)
                del self.confirming[peer]

    def _declare(self, peer: str, probe: Future) -> None:
        """`peer`'s confirming probe `probe` failed or ran out: dead (told once, never after `stop`)."""
        with self._lock:
            if self._stop.is_set() or peer in self.dead or self.confirming.get(peer, (None,))[0] is not probe:
                return
            self.dead.add(peer)
        self.on_dead(peer)

    def _run(self) -> None:
        self._loop_thread = threading.get_ident()
        while True:
            try:
                self.beat()
            except Exception:  # a thread of its own printed it; on a call thread it would sit unread in the future
                log.exception("the heartbeat loop failed; no more pings this attempt")
                raise
            # a timer between beats, not a synchronisation: stop() ends the wait at once
            if self._stop.wait(self.config.interval_s):
                return
