"""glibc's own count of a process's heap (`mallinfo2`), logged over a run: is native memory growing in use (a
leak: `in_use` grows) or kept free inside the arenas (fragmentation: `free` grows while `in_use` stays flat)?

`SWARM_HEAPSTATS_S=S` makes `swarm-peer` log one line every S seconds; unlike `SWARM_MEMWATCH_S` it costs nothing
between its reads (no tracemalloc), so a soak's slope is the same with it on. It also logs the process's Python
threads by name whenever they change (a soak counts threads; this says whose they are).

    SWARM_HEAPSTATS_S=60 swarm bench soak --steps 2000    # then: grep heapstats runs/soak-*/logs/peer0.log
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass

from swarm.daemon.memwatch import seconds_from_env

__all__ = ["HeapStats", "mallinfo", "python_threads", "start_from_env"]

log = logging.getLogger("swarm.heapstats")

ENV = "SWARM_HEAPSTATS_S"


class _Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@dataclass(frozen=True)
class HeapStats:
    """One reading of glibc's heap, in bytes (all arenas summed)."""

    arena_bytes: int
    """taken from the system by brk and by the arenas' own mmaps (`arena`)"""
    in_use_bytes: int
    """handed out by malloc and not freed yet, in the arenas (`uordblks`)"""
    free_bytes: int
    """freed and kept inside the arenas (`fordblks`): what fragmentation holds"""
    mmapped_bytes: int
    """blocks above the mmap threshold, each its own mapping (`hblkhd`)"""
    free_chunks: int
    """free chunks in the arenas (`ordblks`): many small ones is a fragmented heap"""
    top_bytes: int
    """the free space at the top of the main heap that `malloc_trim` could return (`keepcost`)"""

    def line(self) -> str:
        mib = 2**20
        return (
            f"arena {self.arena_bytes / mib:.2f} MiB, in use {self.in_use_bytes / mib:.2f} MiB, free "
            f"{self.free_bytes / mib:.2f} MiB in {self.free_chunks} chunks, top {self.top_bytes / mib:.2f} MiB, "
            f"mmapped {self.mmapped_bytes / mib:.2f} MiB"
        )


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


def mallinfo() -> HeapStats | None:
    """glibc's heap statistics now; None where libc has no `mallinfo2` (not glibc, or older than 2.33)."""
    fn = _libc()
    if fn is None:
        return None
    m = fn()
    return HeapStats(m.arena, m.uordblks, m.fordblks, m.hblkhd, m.ordblks, m.keepcost)


def python_threads() -> dict[str, int]:
    """This process's Python threads counted by name, numbers dropped (`grpc_3` and `grpc_12` are both `grpc_`),
    most first."""
    return dict(Counter(re.sub(r"\d+", "", t.name) for t in threading.enumerate()).most_common())


def start_from_env(environ=os.environ) -> threading.Thread | None:
    """Starts logging `mallinfo()` every `SWARM_HEAPSTATS_S` seconds; None if the variable is unset or this libc
    has no `mallinfo2` (said once in the log).

    Raises:
        ValueError: the variable is set but not a positive number (named in the message).
    """
    every = seconds_from_env(environ, ENV)
    if every is None:
        return None
    if mallinfo() is None:
        log.warning("heapstats: this libc has no mallinfo2; %s ignored", ENV)
        return None
    stop = threading.Event()

    def watch() -> None:
        names: dict[str, int] = {}
        while not stop.wait(every):
            log.info("heapstats: %s", mallinfo().line())
            now = python_threads()
            if now != names:
                listed = ", ".join(f"{name} {n}" for name, n in now.items())
                log.info("heapstats: %d python threads: %s", sum(now.values()), listed)
                names = now

    thread = threading.Thread(target=watch, name="swarm-heapstats", daemon=True)
    thread.stop = stop  # type: ignore[attr-defined]
    thread.start()
    return thread
