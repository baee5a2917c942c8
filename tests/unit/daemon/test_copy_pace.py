"""A background copy of a buddy stage is paced at a share of the measured link and rests between copies.

At 1 Mbit/s in the namespace testbed an unpaced copy (5 MB with the AdamW moments) held the link for about a
minute at step 20: the planner's lease renewals and pings queued behind it, and the planner planned the live
stage 0 away (docs/reports/throttled.md). The holder now sends at what the copy asks (`max_bytes_per_s`), in
chunks small beside a second of it; a takeover's fetch still asks for nothing and goes as fast as it can.
"""

from __future__ import annotations

import grpc
import pytest

from swarm.daemon.held import HeldStore
from swarm.daemon.replication import COPY_LINK_SHARE, COPY_REST_FACTOR, Replicator, copy_rate, copy_timeout_s
from swarm.net.connect import LocalRpcError, _LocalContext, method_path
from swarm.peers.records import LinkMeasurement, PlanRecord
from swarm.peers.shaper import PACED_CHUNK_MIN_BYTES, STATE_MIN_BYTES_PER_S, paced, paced_chunk_bytes
from swarm.proto import stage_pb2
from swarm.runtime import service
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.daemon.test_held import TINY, Clock, ann, decode, servicer_of
from tests.unit.daemon.test_repair import A, B, C


class FakeTime:
    """A clock that only the pacer's sleeps move."""

    def __init__(self):
        self.t, self.slept = 0.0, []

    def clock(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def test_paced_items_leave_at_the_rate_never_more_than_an_item_ahead():
    fake = FakeTime()
    rate, size, n = 4 * STATE_MIN_BYTES_PER_S, 8192, 20
    sent_at = []
    for _ in paced(range(n), rate, size=lambda _: size, clock=fake.clock, sleep=fake.sleep):
        sent_at.append(fake.t)
    assert len(sent_at) == n
    for i, t in enumerate(sent_at):  # item i may leave once the i before it took their time at the rate
        assert t == pytest.approx(i * size / rate)
    assert fake.t == pytest.approx((n - 1) * size / rate)


def test_closing_a_paced_stream_closes_its_source_at_once():
    closed = []

    def source():
        try:
            yield from range(10)
        finally:
            closed.append(True)

    fake = FakeTime()
    src = source()  # still referenced (as gRPC's servicer frame may hold it): only an explicit close ends it
    stream = paced(src, STATE_MIN_BYTES_PER_S, size=lambda _: 1024, clock=fake.clock, sleep=fake.sleep)
    assert next(stream) == 0
    stream.close()  # what gRPC does with a cancelled call's generator
    assert closed == [True]


def test_a_crawling_or_empty_rate_is_raised_to_the_floor_and_chunks_stay_bounded():
    fake = FakeTime()
    list(paced(range(3), 1.0, size=lambda _: STATE_MIN_BYTES_PER_S, clock=fake.clock, sleep=fake.sleep))
    assert fake.t == pytest.approx(2.0)  # at the floor, not at 1 byte/s
    assert paced_chunk_bytes(1.0, 1 << 20) == PACED_CHUNK_MIN_BYTES  # 20 ms at the floor's pace is less
    share = 1.25e6 * COPY_LINK_SHARE  # a 10 Mbit/s link's share: 20 ms of it holds that link 5 ms
    assert paced_chunk_bytes(share, 1 << 20) == 6250 and paced_chunk_bytes(share, 1 << 20) / 1.25e6 <= 0.005
    assert paced_chunk_bytes(1e12, 1 << 20) == 1 << 20


def _get_state(servicer, pipe, rate: float) -> list:
    request = stage_pb2.StateRequest(stage=0, max_bytes_per_s=rate)
    signer = pipe.hosts[1].outbox.connector.signer  # a plan peer
    metadata = signer.metadata(pipe.hosts[0].peer_id, method_path("GetState"), request)
    return list(servicer.GetState(request, _LocalContext(metadata)))


def test_get_state_paces_what_it_is_asked_to_and_sends_the_same_state(monkeypatch):
    pipe = LocalPipeline(TINY, 2)
    try:
        servicer = servicer_of(pipe, 0)
        fake, rates = FakeTime(), []

        def recorded(items, rate):
            rates.append(rate)
            return paced(items, rate, clock=fake.clock, sleep=fake.sleep)

        monkeypatch.setattr(service, "paced", recorded)
        unpaced = _get_state(servicer, pipe, 0.0)
        assert rates == [] and fake.t == 0.0  # a takeover's fetch asks for nothing: as fast as the link goes
        rate = 2 * STATE_MIN_BYTES_PER_S
        items = _get_state(servicer, pipe, rate)
        assert rates == [rate]
        total = sum(item.ByteSize() for item in items)
        assert total > 8 * paced_chunk_bytes(rate, 1 << 20)  # enough items to pace
        assert max(len(item.chunk.data) for item in items) <= paced_chunk_bytes(rate, 1 << 20)
        largest = max(item.ByteSize() for item in items)
        assert (total - largest) / rate <= fake.t <= total / rate  # the rate's time, an item ahead at most
        same, before = decode(items), decode(unpaced)
        assert set(same) == set(before) and all(same[k].equal(before[k]) for k in before)
        for bad in (float("nan"), -1.0, float("inf")):
            with pytest.raises(LocalRpcError) as e:
                _get_state(servicer, pipe, bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_bytes_per_s" in e.value.details()
    finally:
        pipe.close()


def _link(src: str, dst: str, bytes_per_s: float) -> LinkMeasurement:
    return LinkMeasurement(src, dst, 0.005, bytes_per_s, 1.0)


def test_the_copy_rate_is_a_share_of_the_slower_measured_direction():
    links = [_link(A, B, 400_000.0), _link(B, A, 240_000.0), _link(A, C, 1e9)]
    assert copy_rate(links, A, B) == COPY_LINK_SHARE * 240_000.0
    assert copy_rate(links[:1], A, B) == COPY_LINK_SHARE * 400_000.0  # the one direction measured
    assert copy_rate(links[1:2], A, B) == COPY_LINK_SHARE * 240_000.0
    assert copy_rate(links, C, B) == 0.0 and copy_rate(links, None, B) == 0.0  # unmeasured or unknown: unpaced
    assert copy_rate([_link(A, B, 0.0)], A, B) == 0.0
    assert copy_rate([_link(A, B, 1.0)], A, B) == STATE_MIN_BYTES_PER_S  # a measurement that lies low: the floor
    assert copy_timeout_s(5 << 20, 0.0) == 120.0
    assert copy_timeout_s(5 << 20, 31_250.0) == pytest.approx(2 * (5 << 20) / 31_250.0 + 60.0)
    assert copy_timeout_s(8 << 30, STATE_MIN_BYTES_PER_S) == 3600.0  # bounded whatever the state's size


def test_a_copy_that_took_t_seconds_rests_the_next_for_a_multiple_of_t(tmp_path):
    plan = PlanRecord(version=2, document={"stages": [
        {"layer_start": 0, "layer_end": 2, "peer_ids": [A]},
        {"layer_start": 2, "layer_end": 3, "peer_ids": [B]},
    ]}, created_at=1.0)  # fmt: skip
    clock, took, pulls = Clock(), 10.0, []
    steps = {"done": 20}

    def fetch(address, stage, version):  # a paced copy: 10 s of the clock
        pulls.append(clock.t)
        clock.t += took
        return {}

    rep = Replicator(A, HeldStore(tmp_path), every_steps=20, status=lambda a: steps["done"], fetch=fetch, clock=clock)
    assert rep.tick(plan, [ann(A), ann(B)])
    rep._busy.acquire()  # the pull thread is done once it releases
    rep._busy.release()
    steps["done"] = 1000  # due by steps from here on: only the rest holds the next copy back
    clock.t = pulls[0] + took + COPY_REST_FACTOR * took - 1.0
    assert not rep.tick(plan, [ann(A), ann(B)]), "still resting"
    clock.t += 1.0
    assert rep.tick(plan, [ann(A), ann(B)])
    rep._busy.acquire()
    rep._busy.release()
    assert len(pulls) == 2


def test_closing_cancels_an_in_flight_copy_waits_for_it_and_starts_no_other(tmp_path):
    """A peer that stops during a copy used to exit with the pull thread still inside gRPC (the process aborted:
    "terminate called without an active exception"); `close` cancels the call and waits for the thread."""
    import threading

    plan = PlanRecord(version=2, document={"stages": [
        {"layer_start": 0, "layer_end": 2, "peer_ids": [A]},
        {"layer_start": 2, "layer_end": 3, "peer_ids": [B]},
    ]}, created_at=1.0)  # fmt: skip
    started, ended = threading.Event(), threading.Event()

    class Call:  # a stalled stream: nothing arrives until the call is cancelled
        def __init__(self):
            self.cancelled = threading.Event()

        def cancel(self):
            self.cancelled.set()

    first = Call()

    def fetch(address, stage, version):
        rep.track(first)
        started.set()
        try:
            if not first.cancelled.wait(30):
                raise AssertionError("never cancelled")
            raise grpc.RpcError("cancelled")
        finally:
            ended.set()

    rep = Replicator(A, HeldStore(tmp_path), every_steps=20, status=lambda a: 20, fetch=fetch, clock=Clock())
    assert rep.tick(plan, [ann(A), ann(B)]) and started.wait(30)
    assert rep.close(timeout_s=30) and first.cancelled.is_set() and ended.is_set()
    assert not rep._busy.locked(), "the pull thread finished"
    rep._next = 0.0
    assert not rep.tick(plan, [ann(A), ann(B)]), "no pull after close"
    late = Call()
    rep.track(late)  # a call made after close (a fetch that was about to call) is cancelled at once
    assert late.cancelled.is_set()
