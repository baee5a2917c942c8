"""The planner's pings time out per peer (swarm.daemon.liveness.status_prober with adaptive_trips): a peer that
answers slowly on a loaded machine raises its own deadline and stays planned, a silent one is still gone, and a
refusal is an answer. A fake Ping on a fake clock, no network and no sleeps."""

from __future__ import annotations

import threading

import grpc
import pytest

from swarm.daemon.liveness import Liveness, LivenessConfig, adaptive_trips, status_prober
from swarm.proto import stage_pb2_grpc


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class FakePeers:
    """Ping answers after `delay[address]` seconds of the fake clock (None: never; a code: refused with it)."""

    def __init__(self):
        self.now = 0.0
        self.delay: dict[str, object] = {}
        self.deadlines: dict[str, list[float]] = {}
        self.said: dict[str, list[int]] = {}
        """address -> the newest plan each of its pings said"""

    def clock(self) -> float:
        return self.now

    def stub(self, address: str):
        peers = self

        class Stub:
            def Ping(self, request, timeout):  # noqa: N802 (gRPC's name)
                peers.deadlines.setdefault(address, []).append(timeout)
                peers.said.setdefault(address, []).append(request.newest_plan)
                delay = peers.delay[address]
                if isinstance(delay, grpc.StatusCode):
                    raise Refusal(delay)
                if delay is None or delay > timeout:
                    peers.now += timeout
                    raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED)
                peers.now += delay

        return Stub()


class Channels:
    def get(self, address: str) -> str:
        return address


@pytest.fixture
def peers(monkeypatch):
    fake = FakePeers()
    monkeypatch.setattr(stage_pb2_grpc, "StageStub", fake.stub)
    return fake


def prober(peers: FakePeers, adaptive: bool = True):
    addresses = {"slow": "slow", "fast": "fast", "hung": "hung", "refuser": "refuser"}
    trips = adaptive_trips(1.0) if adaptive else None
    return status_prober(Channels(), lambda: addresses, trips=trips, clock=peers.clock)


def test_a_slow_peer_raises_its_own_deadline_and_keeps_answering(peers):
    peers.delay.update(slow=1.6, fast=0.01)
    ping = prober(peers)
    answers = [ping("slow") for _ in range(6)]
    assert answers[0] is False  # never measured: the 1 s floor
    assert all(answers[1:]), answers  # then twice that, and its samples hold it there
    assert peers.deadlines["slow"][1] == 2.0 and all(d > 1.6 for d in peers.deadlines["slow"][1:])
    assert all(ping("fast") for _ in range(5)) and peers.deadlines["fast"][-1] == 1.0  # a fast peer keeps the floor


def test_with_a_fixed_deadline_the_same_peer_misses_every_ping(peers):
    peers.delay.update(slow=1.6)
    ping = prober(peers, adaptive=False)
    assert not any(ping("slow") for _ in range(6))


def test_a_hung_peer_backs_off_to_the_ceiling_and_is_gone(peers):
    peers.delay.update(hung=None, fast=0.01)
    ping = prober(peers)
    live = Liveness(ping, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=peers.clock)
    try:
        for _ in range(8):
            peers.now += 1.0
            live.round(["hung", "fast"])
        assert live.gone() == frozenset({"hung"})
        assert peers.deadlines["hung"][:5] == [1.0, 2.0, 4.0, 8.0, 10.0]
    finally:
        live.close()


def test_a_slow_peer_is_never_gone_and_a_refusal_is_an_answer(peers):
    peers.delay.update(slow=1.6, refuser=grpc.StatusCode.FAILED_PRECONDITION)  # a standby: "not serving"
    live = Liveness(prober(peers), LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=peers.clock)
    try:
        for _ in range(10):
            peers.now += 1.0
            live.round(["slow", "refuser"])
            assert live.gone() == frozenset()
        assert live.answered("slow") and live.answered("refuser")
    finally:
        live.close()


def _rounds_to_gone(peers: FakePeers, adaptive: bool) -> int:
    live = Liveness(prober(peers, adaptive), LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=peers.clock)
    try:
        rounds = 0
        while not live.gone() and rounds < 50:
            peers.now += 1.0
            live.round(["slow"])
            rounds += 1
        return rounds
    finally:
        live.close()


def test_a_killed_peer_is_gone_as_fast_as_with_fixed_deadlines(peers):
    peers.delay.update(slow=grpc.StatusCode.UNAVAILABLE)  # connection refused at once: no deadline to wait out
    adaptive = _rounds_to_gone(peers, adaptive=True)
    assert adaptive == _rounds_to_gone(peers, adaptive=False) <= 5
    assert peers.deadlines["slow"][:adaptive] == [1.0] * adaptive


def test_a_ping_says_the_newest_plan_its_peer_published(peers):
    peers.delay.update(fast=0.01)
    published = [0]
    ping = status_prober(Channels(), lambda: {"fast": "fast"}, clock=peers.clock, newest_plan=lambda: published[0])
    assert ping("fast")
    published[0] = 7
    assert ping("fast") and ping("fast")
    plain = status_prober(Channels(), lambda: {"fast": "fast"}, clock=peers.clock)  # a trainer's, say
    assert plain("fast")
    assert peers.said["fast"] == [0, 7, 7, 0]


def test_tell_pings_at_once_outside_the_rounds():
    pinged, done = [], threading.Condition()

    def ping(pid: str) -> bool:
        with done:
            pinged.append(pid)
            done.notify_all()
        return False  # silent: a told peer's answer is no evidence either way

    live = Liveness(ping, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=lambda: 100.0)
    assert live.round(["a"])
    live.tell(["a", "b", "b"])
    with done:
        assert done.wait_for(lambda: len(pinged) == 3, timeout=30), pinged
    assert sorted(pinged) == ["a", "a", "b"]
    assert live._misses == {"a": 1} and "b" not in live._last_answer, "the rounds' bookkeeping is untouched"
    live.close()
