"""The application-level link shaper on a fake clock: its long-run rate, its burst and its delay."""

from __future__ import annotations

import pytest

from swarm.peers.shaper import LinkShape, LinkShaping, Shaper
from swarm.testbed.netns import tbf_burst_bytes


class FakeClock:
    """Time that moves only when the shaper sleeps, so every figure is exact and the test takes no time."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def shaper(shape: LinkShape) -> tuple[Shaper, FakeClock]:
    clock = FakeClock()
    return Shaper(shape, clock=clock, sleep=clock.sleep), clock


def bytes_before_first_wait(s: Shaper, clock: FakeClock, chunk: int, limit: int = 1 << 30) -> int:
    passed = 0
    while passed < limit:
        s.consume(chunk)
        if clock.sleeps:
            return passed
        passed += chunk
    raise AssertionError("the shaper never made a sender wait")


@pytest.mark.parametrize("mbit", [1.0, 10.0, 100.0, 1000.0])
@pytest.mark.parametrize("chunk", [1000, 64 << 10, 1 << 20])
def test_the_long_run_rate_is_the_configured_one(mbit, chunk):
    shape = LinkShape.from_mbit(mbit)
    s, clock = shaper(shape)
    start = clock()
    total = 0
    while total < 200 * max(shape.burst, chunk):
        s.consume(chunk)
        total += chunk
    elapsed = clock() - start
    # what exceeds the burst takes its time at the rate: the rate over the run is exact up to that burst
    assert (total - shape.burst) / elapsed == pytest.approx(shape.rate_bytes_per_s, rel=0.01)
    assert total / elapsed == pytest.approx(shape.rate_bytes_per_s, rel=0.01)
    assert s.bytes_sent == total


def test_idle_time_is_not_saved_up_beyond_the_burst():
    shape = LinkShape(rate_bytes_per_s=1e6, burst_bytes=10_000)
    s, clock = shaper(shape)
    for _ in range(100):
        s.consume(5_000)
    clock.now += 3600.0  # an hour idle
    clock.sleeps.clear()
    assert bytes_before_first_wait(s, clock, 100) == pytest.approx(shape.burst, rel=0.01)


@pytest.mark.parametrize(
    "shape,expected_burst",
    [
        (LinkShape.from_mbit(1.0), 10 * 1514),  # the floor: ten frames, not half a second of the link
        (LinkShape.from_mbit(10.0), 10 * 1514),
        (LinkShape.from_mbit(8000.0), int(1e9 * 0.004)),  # 4 ms at 1 GB/s
        (LinkShape(rate_bytes_per_s=1e6, burst_bytes=300_000), 300_000),
    ],
)
def test_a_burst_of_the_configured_size_passes_at_once(shape, expected_burst):
    assert shape.burst == expected_burst
    s, clock = shaper(shape)
    chunk = max(1, expected_burst // 1000)
    assert bytes_before_first_wait(s, clock, chunk) == pytest.approx(expected_burst, rel=0.01)
    assert clock.sleeps[0] <= 2 * chunk / shape.rate_bytes_per_s  # the first wait is for what exceeds the burst


def test_the_one_way_delay_is_applied_once_per_message_and_not_charged_to_the_rate():
    s, clock = shaper(LinkShape.from_mbit(None, delay_ms=25.0))
    for _ in range(3):
        s.delay()
        s.consume(10 << 20)
    assert clock.sleeps == [pytest.approx(0.025)] * 3
    assert s.bytes_sent == 3 * (10 << 20)


def test_delay_and_rate_add_up():
    shape = LinkShape(rate_bytes_per_s=1e6, delay_s=0.040, burst_bytes=0)
    s, clock = shaper(shape)
    start = clock()
    s.delay()
    s.consume(500_000)
    assert clock() - start == pytest.approx(0.040 + 0.5, rel=0.01)


def test_an_unshaped_link_never_waits():
    s, clock = shaper(LinkShape())
    s.delay()
    for _ in range(100):
        s.consume(1 << 20)
    assert clock.sleeps == []
    assert s.bytes_sent == 100 << 20


def test_link_shaping_gives_each_destination_its_own_shaper_and_override():
    fast, slow = LinkShape.from_mbit(1000.0), LinkShape.from_mbit(1.0, 30.0)
    shaping = LinkShaping(default=fast, per_link={"10.0.0.2:5000": slow})
    a = shaping.for_destination("10.0.0.1:5000")
    assert a is shaping.for_destination("10.0.0.1:5000")
    assert a.shape == fast
    assert shaping.for_destination("10.0.0.2:5000").shape == slow


@pytest.mark.parametrize(
    "text,rate,delay",
    [("100", 12.5e6, 0.0), ("10:25", 1.25e6, 0.025), ("none:40", None, 0.040), ("0", None, 0.0)],
)
def test_shapes_parse_from_the_command_line_form(text, rate, delay):
    shape = LinkShape.parse(text)
    assert shape.rate_bytes_per_s == (None if rate is None else pytest.approx(rate))
    assert shape.delay_s == pytest.approx(delay)


@pytest.mark.parametrize("kwargs", [{"rate_bytes_per_s": 0.0}, {"rate_bytes_per_s": -1.0}, {"delay_s": -0.001}])
def test_impossible_shapes_are_refused(kwargs):
    with pytest.raises(ValueError):
        LinkShape(**kwargs)


def test_both_testbeds_give_a_link_the_same_bucket():
    for rate_mbit in (0.5, 1.0, 10.0, 100.0, 1000.0):
        assert LinkShape.from_mbit(rate_mbit).burst == tbf_burst_bytes(rate_mbit)
