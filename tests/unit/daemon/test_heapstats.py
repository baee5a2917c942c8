"""SWARM_HEAPSTATS_S: glibc's heap statistics read in process, and the watch's switch."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from swarm.daemon.heapstats import ENV, mallinfo, start_from_env

pytestmark = pytest.mark.skipif(mallinfo() is None, reason="this libc has no mallinfo2")


def test_a_block_malloc_keeps_counts_as_in_use_until_freed():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 256 << 10  # below the mmap threshold a peer sets (and glibc's dynamic one): from an arena
    before = mallinfo()
    block = libc.malloc(size)
    try:
        held = mallinfo()
        assert held.in_use_bytes - before.in_use_bytes >= size - 4096  # other threads may free meanwhile
        assert held.arena_bytes >= held.in_use_bytes and held.free_bytes >= 0 and held.line().startswith("arena ")
    finally:
        libc.free(block)


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "nan"])
def test_a_bad_period_is_refused_naming_the_variable(raw):
    with pytest.raises(ValueError, match=ENV):
        start_from_env({ENV: raw})


def test_the_watch_is_off_unless_asked_and_stops_when_told():
    assert start_from_env({}) is None
    thread = start_from_env({ENV: "0.05"})
    try:
        assert thread.is_alive() and thread.daemon
    finally:
        thread.stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_python_threads_are_counted_by_name_without_their_numbers_and_logged_by_the_watch(caplog):
    import logging
    import threading

    from swarm.daemon.heapstats import python_threads

    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait, name=f"heapstats_test_{i}") for i in range(3)]
    for w in workers:
        w.start()
    try:
        assert python_threads()["heapstats_test_"] == 3
        assert sum(python_threads().values()) == threading.active_count()
        with caplog.at_level(logging.INFO, logger="swarm.heapstats"):
            watch = start_from_env({ENV: "0.05"})
            try:
                found = threading.Event()
                for _ in range(1200):  # up to 60 s on a loaded machine, as soon as the line is there
                    if any("heapstats_test_ 3" in r.getMessage() for r in caplog.records):
                        found.set()
                        break
                    stop.wait(0.05)
            finally:
                watch.stop.set()
                watch.join(30)
        assert found.is_set(), "the watch logs the threads by name"
    finally:
        stop.set()
        for w in workers:
            w.join(30)
