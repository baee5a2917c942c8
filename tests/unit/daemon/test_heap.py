"""`swarm.daemon.heap`: the peer's heap trimmer runs on one thread for its whole life, trims on its period, stops,
survives nothing worse than a failing trim, and is refused a bad period by name."""

from __future__ import annotations

import math
import threading
import time

import pytest

from swarm.daemon.heap import HeapTrimmer, malloc_trim
from swarm.daemon.peer_config import PeerConfig


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)


def test_it_trims_on_its_period_on_one_thread_and_stops():
    calls = []
    trimmer = HeapTrimmer(0.01, trim=lambda: calls.append(threading.current_thread().name) or True)
    before = threading.active_count()
    assert trimmer.start() and trimmer.start()  # a second start starts nothing more
    wait_for(lambda: trimmer.trims >= 20)
    assert threading.active_count() == before + 1, "the trimmer keeps one thread for its whole life"
    assert set(calls) == {"swarm-heap-trim"}
    trimmer.stop()
    done = trimmer.trims
    assert threading.active_count() == before
    time.sleep(0.05)  # nothing to wait for: a stopped trimmer must not trim again
    assert trimmer.trims == done


def test_zero_is_off_and_a_bad_period_is_refused():
    trimmer = HeapTrimmer(0, trim=lambda: pytest.fail("an off trimmer trimmed"))
    assert trimmer.start() is False
    trimmer.stop()
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="every_s"):
            HeapTrimmer(bad)
        with pytest.raises(ValueError, match="heap_trim_s"):
            PeerConfig(heap_trim_s=bad)
    assert PeerConfig().heap_trim_s > 0, "a peer trims by default"


def test_a_failing_trim_ends_the_trimmer_not_the_process(caplog):
    def boom() -> bool:
        raise OSError("no trim here")

    trimmer = HeapTrimmer(0.01, trim=boom)
    trimmer.start()
    wait_for(lambda: not trimmer._thread.is_alive())
    assert trimmer.trims == 0
    assert "heap trim failed" in caplog.text


def test_malloc_trim_returns_a_bool():
    assert malloc_trim() in (True, False)  # glibc: whether pages were released; elsewhere False


def test_it_counts_what_each_trim_released_and_reports_it(caplog):
    readings = iter([500, 400, 450, 460, 460, 300] + [300] * 1000)  # before/after pairs: -100, +10 (grew), -160
    trimmer = HeapTrimmer(0.01, trim=lambda: True, resident=lambda: next(readings) << 20, report_every=3)
    with caplog.at_level("INFO", logger="swarm.daemon.heap"):
        trimmer.start()
        wait_for(lambda: trimmer.trims >= 3)
        trimmer.stop()
    assert trimmer.trims >= 3
    assert trimmer.released_bytes == 260 << 20, "a trim after which RSS grew releases nothing, never a negative"
    assert "heap trims: 3 so far released 260.0 MiB" in caplog.text


def test_a_bad_report_period_is_refused_by_name():
    with pytest.raises(ValueError, match="report_every"):
        HeapTrimmer(1.0, report_every=-1)


def test_resident_bytes_reads_this_process():
    from swarm.daemon.heap import resident_bytes

    assert resident_bytes() > 1 << 20  # a Python process with pytest loaded holds more than a MiB
