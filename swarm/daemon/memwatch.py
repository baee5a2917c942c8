"""Finding slow growth in a running process: `SWARM_MEMWATCH_S=S` makes `swarm-peer` log, every S seconds,
what has grown since its first look: the allocation sites (tracemalloc, grouped by 4-frame traceback) and
the object counts by type (gc) that grew most, and each module imported after the first look, with the stack that
imported it (a late import is a step in RSS that a soak's slope counts as growth). A diagnostic for
`swarm bench soak` runs: off unless the variable is set, because tracemalloc slows every allocation.

    SWARM_MEMWATCH_S=120 swarm bench soak --steps 3000    # then: grep memwatch runs/soak-*/logs/peer0.log
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import traceback
from collections import Counter

__all__ = ["seconds_from_env", "start_from_env"]

log = logging.getLogger("swarm.memwatch")

ENV = "SWARM_MEMWATCH_S"
TOP = 12


def _types() -> Counter:
    return Counter(type(o).__name__ for o in gc.get_objects())


class _LateImports:
    """A `sys.meta_path` finder that finds nothing: it logs each top-level package first imported after the
    baseline, with the stack that imported it (the importer's frames, the import system's left out)."""

    def __init__(self) -> None:
        self.armed = False
        self.seen: set[str] = set()

    def find_spec(self, name: str, path=None, target=None):
        top = name.partition(".")[0]
        if self.armed and top not in self.seen and top not in sys.modules:
            self.seen.add(top)
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames[-6:]))
            log.info("memwatch: %s imported after the baseline, at %s", name, where)
        return None


def seconds_from_env(environ, name: str) -> float | None:
    """`environ[name]` as a positive number of seconds; None if unset or empty.

    Raises:
        ValueError: the variable is set but not a positive number (named in the message).
    """
    raw = environ.get(name)
    if not raw:
        return None
    try:
        every = float(raw)
    except ValueError:
        every = -1.0
    if not every > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
    return every


def start_from_env(environ=os.environ) -> threading.Thread | None:
    """Starts the watch if `SWARM_MEMWATCH_S` is a positive number of seconds; None if it is unset.

    Raises:
        ValueError: the variable is set but not a positive number (named in the message).
    """
    every = seconds_from_env(environ, ENV)
    if every is None:
        return None
    import tracemalloc

    tracemalloc.start(4)
    stop = threading.Event()
    late = _LateImports()
    sys.meta_path.insert(0, late)

    def watch() -> None:
        first = types = None
        while not stop.wait(every):
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            counts = _types()
            if first is None:
                first, types = snap, counts
                late.armed = True
                log.info("memwatch: baseline taken (%d objects)", sum(counts.values()))
                continue
            for stat in snap.compare_to(first, "traceback")[:TOP]:
                where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in stat.traceback)
                log.info("memwatch: %+.1f KiB %+d blocks at %s", stat.size_diff / 1024, stat.count_diff, where)
            grown = [(name, n - types.get(name, 0)) for name, n in counts.items()]
            top = sorted((g for g in grown if g[1] > 0), key=lambda g: -g[1])[:TOP]
            log.info("memwatch: objects grown: %s", ", ".join(f"{name} {n:+d}" for name, n in top) or "none")

    thread = threading.Thread(target=watch, name="swarm-memwatch", daemon=True)
    thread.stop = stop  # type: ignore[attr-defined]
    thread.start()
    return thread
