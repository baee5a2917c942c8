"""Giving a peer's freed heap pages back to the system: glibc keeps what its threads free, `HeapTrimmer` returns it.

A peer computes and encodes on many threads (32 gRPC workers, the liveness pool, the DHT node's loop). glibc's
malloc keeps every page a thread freed inside its arena for reuse, and returns only a free top of the heap above
the trim threshold (which `swarm.peers.allocator.tune_allocator` raises to 512 MiB for the data path's buffers).
So a peer's RSS is the high-water mark of everything its threads ever held at once, ratcheting up as each pool
thread takes its first calls. Measured in one process with the peer's allocator settings (a toy block's forward
and backward on a pool of 32 threads, 128 passes a round): 317 MiB anonymous after four rounds against 156 MiB
on one thread; with `malloc_trim(0)` after each round, 183 MiB (`docs/reports/footprint.md`).

`malloc_trim(0)` frees the unused pages in the middle of every arena too (glibc >= 2.8, `madvise(MADV_DONTNEED)`),
without moving anything: the pages come back zeroed on their next use. It takes the arenas' locks, so it runs on
a thread of its own, every `every_s` seconds: often enough that a slow creep is cut, rarely enough that its cost
(a few ms over a heap of a few hundred MB) is nothing beside a step. Started once with the peer and never
again, so it keeps the peer's thread count flat.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

__all__ = ["HeapTrimmer", "malloc_trim"]

log = logging.getLogger(__name__)

_libc_trim: Callable[[int], int] | None | bool = False  # False: not looked up yet; None: no malloc_trim here


def malloc_trim() -> bool:
    """Returns every arena's free pages to the system (glibc's `malloc_trim(0)`). Returns whether memory was
    released; False too where libc has no `malloc_trim` (musl, macOS)."""
    global _libc_trim
    if _libc_trim is False:
        try:
            _libc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _libc_trim = None
    return _libc_trim is not None and _libc_trim(0) == 1


class HeapTrimmer:
    """A thread that calls `trim` every `every_s` seconds until `stop()`.

    Args:
        every_s: seconds between trims; 0 disables it (`start` then starts nothing).
        trim: what to call (default `malloc_trim`); a test's counter.
    """

    def __init__(self, every_s: float, trim: Callable[[], bool] = malloc_trim):
        if not every_s >= 0:  # NaN too
            raise ValueError(f"HeapTrimmer: every_s must be >= 0 (0: off), got {every_s}")
        self.every_s, self._trim = every_s, trim
        self.trims = 0
        """trims done so far"""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Starts the thread (once); returns whether it runs (False: every_s is 0)."""
        if self.every_s == 0 or self._thread is not None:
            return self._thread is not None
        self._thread = threading.Thread(target=self._run, name="swarm-heap-trim", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._trim()
            except Exception:  # a failing trim must not end the peer; say it once and stop trying
                log.exception("heap trim failed; no more trims in this process")
                return
            self.trims += 1
