"""The trainer's liveness pings: slow peers live, killed ones die as fast as before, hung ones within a bound.

A fake clock and pings that block on events the test releases: no sleeps, no timing assertions.
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from swarm.net.stream import StageCallError
from swarm.runtime.heartbeat import HeartbeatConfig, PingLoop, RoundTrips

WAIT_S = 30.0
"""longest a test waits for a ping's thread (generous: a loaded machine)"""


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Peer:
    """A peer's Ping: `refuse` fails at once (a killed process); otherwise each call blocks until the test
    releases its gate (never: a hung process)."""

    def __init__(self) -> None:
        self.refuse = False
        self.gates: queue.Queue[threading.Event] = queue.Queue()
        self.calls = 0

    def __call__(self, peer: str, timeout_s: float) -> None:
        self.calls += 1
        if self.refuse:
            raise StageCallError("connection refused", grpc.StatusCode.UNAVAILABLE)
        gate = threading.Event()
        self.gates.put(gate)
        if not gate.wait(WAIT_S * 4):
            raise StageCallError("deadline", grpc.StatusCode.DEADLINE_EXCEEDED)

    def next_call(self) -> threading.Event:
        """The gate of the next ping, once its thread has read the clock and is waiting."""
        return self.gates.get(timeout=WAIT_S)


def _loop(peer: _Peer, clock: _Clock, dead: list, **config) -> PingLoop:
    return PingLoop(peer, ["p"], dead.append, HeartbeatConfig(**config), clock=clock)


def test_a_peer_whose_pings_take_three_intervals_is_never_declared_dead_and_its_timeout_grows():
    clock, peer, dead = _Clock(), _Peer(), []
    loop = _loop(peer, clock, dead)
    loop.beat()  # t=0: the first ping
    for _ in range(6):  # each ping answers after 3 intervals
        gate = peer.next_call()
        for _ in range(2):
            clock.t += 1.0
            loop.beat()  # pending, silent for 1 s then 2 s: under the 3 s window
        clock.t += 1.0
        gate.set()
        loop._pending["p"].result(timeout=WAIT_S)
        loop.beat()  # answered: alive, its silence starts afresh, the next ping goes out
        assert loop.silence["p"] == 0.0 and dead == [] and not loop.confirming
    assert loop.round_trips.srtt("p") == pytest.approx(3.0)
    assert loop.round_trips.timeout("p") > 3.0 and loop.round_trips.window("p") > 9.0


def test_a_slow_answer_past_the_window_is_confirmed_alive_by_the_longer_probe():
    clock, peer, dead = _Clock(), _Peer(), []
    loop = _loop(peer, clock, dead)
    loop.beat()
    first = peer.next_call()
    for _ in range(3):
        clock.t += 1.0
        loop.beat()
    assert "p" in loop.confirming and dead == []  # silent for the window: suspect, one more probe
    probe = peer.next_call()
    clock.t += 4.0  # the probe's deadline is 10 s: a 4 s answer is in time
    loop.beat()
    first.set()
    probe.set()
    loop.confirming["p"][0].result(timeout=WAIT_S)
    assert dead == [] and not loop.confirming and loop.silence["p"] == 0.0
    loop.beat()  # watched as before
    assert loop._pending["p"] is not None and dead == []


def test_a_killed_peer_is_declared_dead_after_misses_intervals_as_before():
    clock, peer, dead = _Clock(), _Peer(), []
    peer.refuse = True
    loop = _loop(peer, clock, dead, interval_s=1.0, misses=3)
    for _ in range(3):  # beats at 0, 1, 2 s: refused, but not yet `misses` intervals
        loop.beat()
        loop._pending["p"].exception(timeout=WAIT_S)
        assert dead == []
        clock.t += 1.0
    loop.beat()  # t=3 s, as the fixed count of 3 misses declared it: the confirming probe is refused at once
    loop.confirming["p"][0].exception(timeout=WAIT_S)
    assert dead == ["p"] and loop.dead == {"p"}
    loop.beat()  # told once
    assert dead == ["p"]


def test_a_hung_peer_is_declared_dead_within_the_stated_bound_even_where_the_probe_never_times_out():
    clock, peer, dead = _Clock(), _Peer(), []
    config = {"interval_s": 1.0, "misses": 3, "confirm_s": 5.0}
    loop = _loop(peer, clock, dead, **config)
    gates = []
    try:
        loop.beat()
        gates.append(peer.next_call())
        while not dead:
            clock.t += 1.0
            loop.beat()
            if "p" in loop.confirming and len(gates) == 1:
                gates.append(peer.next_call())  # the confirming probe: it hangs too (and no deadline fires here)
            assert clock.t <= HeartbeatConfig(**config).hang_bound_s, "a hung peer outlived its bound"
        assert dead == ["p"] and clock.t > 3.0 + 5.0  # the probe had its whole deadline
        assert peer.calls == 2  # one heartbeat and one probe: a hung peer never gets a ping per beat
    finally:
        for gate in gates:
            gate.set()


def test_time_the_loop_itself_was_stalled_is_nobodys_silence():
    clock, peer, dead = _Clock(), _Peer(), []
    loop = _loop(peer, clock, dead)
    loop.beat()
    gate = peer.next_call()
    clock.t += 100.0  # the trainer's process was descheduled for 100 s
    loop.beat()
    assert loop.silence["p"] == 2.0 and not loop.confirming and dead == []
    gate.set()


def test_round_trips_follow_rfc6298_within_floor_and_ceiling():
    config = HeartbeatConfig(floor_s=1.0, ceiling_s=10.0, misses=3, confirm_s=10.0)
    rtt = RoundTrips(config)
    assert rtt.timeout("new") == 1.0 and rtt.window("new") == 3.0 and rtt.confirm_timeout("new") == 10.0
    for _ in range(20):
        rtt.sample("fast", 0.01)
    assert rtt.timeout("fast") == 1.0  # the floor
    rtt.sample("slow", 2.0)
    assert rtt.timeout("slow") == pytest.approx(2.0 + 4 * 1.0)
    rtt.sample("slow", 4.0)  # rttvar = 0.75 * 1 + 0.25 * 2, srtt = 0.875 * 2 + 0.125 * 4
    assert rtt.timeout("slow") == pytest.approx(2.25 + 4 * 1.25)
    assert rtt.confirm_timeout("slow") == pytest.approx(2 * (2.25 + 4 * 1.25))
    rtt.sample("slower", 60.0)
    assert rtt.timeout("slower") == 10.0 and rtt.window("slower") == 30.0  # the ceiling
    for bad in (float("nan"), float("inf"), -1.0):
        rtt.sample("odd", bad)
    assert rtt.srtt("odd") is None


@pytest.mark.parametrize(
    "bad",
    [{"interval_s": 0}, {"misses": 0}, {"floor_s": 0}, {"floor_s": 5, "ceiling_s": 1}, {"confirm_s": 0}],
)
def test_config_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="HeartbeatConfig"):
        HeartbeatConfig(**bad)


def test_no_death_is_told_after_stop_and_the_loop_ends():
    peer, dead = _Peer(), []
    peer.refuse = True
    loop = PingLoop(peer, ["p"], dead.append, HeartbeatConfig(interval_s=60.0))
    with loop:
        pass
    assert loop._loop.done() and loop._loop.exception() is None
    loop._confirm("p", 0.0)  # a probe that ends after the attempt did
    loop.confirming["p"][0].exception(timeout=WAIT_S)
    assert dead == [] and loop.dead == set()


def _answer(peer: _Peer, loop: PingLoop) -> None:
    """Answers `loop`'s outstanding ping of "p" and waits until the loop has heard it."""
    gate = peer.next_call()
    gate.set()
    loop._pending["p"].result(timeout=WAIT_S)


def test_a_step_that_begins_within_an_interval_of_the_last_answer_sends_no_first_ping():
    """Each step runs its own loop on the driver's round trips: a loop whose first beat comes less than an interval
    after the peer answered an earlier loop's ping leaves it alone until its next beat, and counts its silence
    from that answer; one that comes an interval later or more pings at once."""
    clock, peer, dead, trips = _Clock(), _Peer(), [], RoundTrips(HeartbeatConfig())
    loop = PingLoop(peer, ["p"], dead.append, HeartbeatConfig(), trips, clock=clock)
    loop.beat()
    clock.t += 0.25
    _answer(peer, loop)  # answered at 0.25 s
    loop.stop()
    clock.t += 0.5  # the next step's loop, 0.5 s after that answer
    step = PingLoop(peer, ["p"], dead.append, HeartbeatConfig(), trips, clock=clock)
    step.beat()
    assert peer.calls == 1 and "p" not in step._pending and step.silence["p"] == pytest.approx(0.5)
    clock.t += 1.0
    step.beat()  # its next beat pings, silent 1.5 s since the answer: under the 3 s window
    assert "p" in step._pending and step.silence["p"] == pytest.approx(1.5) and not step.confirming
    _answer(peer, step)
    step.stop()
    clock.t += 1.0  # a loop a whole interval after the last answer pings at its first beat
    late = PingLoop(peer, ["p"], dead.append, HeartbeatConfig(), trips, clock=clock)
    late.beat()
    assert "p" in late._pending
    peer.next_call().set()
    late.stop()


def test_a_peer_that_hangs_right_after_an_answer_is_still_declared_dead_within_the_bound():
    """The skipped first ping does not lengthen the bound: the silence counts from the last answer, so the peer is
    declared dead within the bound of the loop's start, as where the loop pinged at its first beat."""
    config = HeartbeatConfig(interval_s=1.0, misses=3, ceiling_s=1.0, confirm_s=2.0)
    clock, peer, dead, trips = _Clock(), _Peer(), [], RoundTrips(config)
    loop = PingLoop(peer, ["p"], dead.append, config, trips, clock=clock)
    loop.beat()
    _answer(peer, loop)  # answered at t=0; the peer hangs from here on
    loop.stop()
    clock.t += 0.5
    step = PingLoop(peer, ["p"], dead.append, config, trips, clock=clock)
    step.beat()
    while not dead and clock.t <= 0.5 + config.hang_bound_s:
        clock.t += 1.0
        step.beat()
    assert dead == ["p"] and clock.t <= 0.5 + config.hang_bound_s
    while not peer.gates.empty():
        peer.gates.get().set()
    step.stop()
