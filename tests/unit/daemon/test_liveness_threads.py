"""A peer's liveness watcher keeps one thread count for its whole life (issue 28: a soak's peer went from 120 to
122 threads): its ping pool's threads all start with it, so a round that begins before the last round's threads
are marked idle (a loaded machine) finds a thread instead of starting one."""

from __future__ import annotations

import time

from swarm.daemon.liveness import POOL_THREADS, Liveness, LivenessConfig


def _pool_threads(live: Liveness) -> int:
    """This watcher's live pool threads (not another test's watcher, whose threads may still be ending)."""
    return sum(t.is_alive() for t in live._pool._threads)


def test_the_ping_pool_starts_whole_and_stays_so_through_many_rounds():
    now = [0.0]

    def ping(pid: str) -> bool:
        time.sleep(0.001 * (hash(pid) % 3))  # pings of uneven length, as on a network
        return True

    live = Liveness(ping, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=lambda: now[0])
    try:
        assert _pool_threads(live) == POOL_THREADS
        peers = [f"peer{i}" for i in range(POOL_THREADS + 3)]  # more peers than threads: they queue
        for i in range(200):
            now[0] += 1.0
            assert live.round(peers[: 1 + i % len(peers)])
        assert _pool_threads(live) == POOL_THREADS
        assert live.gone() == frozenset()
    finally:
        live.close()
