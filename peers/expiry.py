"""hivemind's record storage with a bounded expiration heap: a key stored again leaves no entry behind for long.

hivemind's `TimedStorage` (a DHT node's local storage, its cache, and each dictionary record's subkeys) pushes an
entry onto its expiration heap at every store and never removes the one it replaces: that stays in the heap as a
"ghost" until its own expiration time comes round, and is popped and ignored then. So a key stored again every P
seconds with a TTL of T seconds holds T / P entries: a peer that refreshes a 300 s link record every few seconds,
or a 3,600 s plan record, carries hundreds to thousands of them per key, and a soak shorter than the longest TTL
counts them as growth (`docs/reports/footprint.md`: memwatch named `HeapEntry` and `dht/storage.py`).

`bound_expiration_heaps()` makes every store rebuild the heap from the live entries once the ghosts outnumber
them (more than `GHOST_SLACK` entries and twice the live keys): each live key keeps exactly the entry hivemind's
own bookkeeping (`key_to_heap`) says is current, so what expires when, and what `maxsize` evicts, is unchanged,
and rebuilding costs O(keys) once per O(keys) stores. Installed once per process by the DHT node's start
(`swarm.peers.dht_node.DHTThread`); idempotent.
"""

from __future__ import annotations

import heapq
import threading

__all__ = ["GHOST_SLACK", "bound_expiration_heaps", "compact"]

GHOST_SLACK = 64
"""heap entries beyond the live keys' that a storage may hold before it is rebuilt (a small heap never is)"""

_install_lock = threading.Lock()


def compact(storage) -> bool:
    """Rebuilds `storage`'s (a hivemind `TimedStorage`) expiration heap from its live entries if the ghosts
    outnumber them; returns whether it did."""
    heap, live = storage.expiration_heap, storage.key_to_heap
    if len(heap) <= max(GHOST_SLACK, 2 * len(live)):
        return False
    heap[:] = live.values()  # in place: whoever holds the list sees the compacted one
    heapq.heapify(heap)
    return True


def bound_expiration_heaps() -> bool:
    """Makes hivemind's `TimedStorage.store` (and so every subclass's) compact the heap after each store.
    Returns whether it installed the hook now (False: already installed)."""
    from hivemind.utils.timed_storage import TimedStorage

    with _install_lock:
        original = TimedStorage.store
        if getattr(original, "_swarm_bounded", False):
            return False

        def store(self, key, value, expiration_time):
            stored = original(self, key, value, expiration_time)
            compact(self)
            return stored

        store._swarm_bounded = True  # type: ignore[attr-defined]
        store.__doc__ = original.__doc__
        TimedStorage.store = store
        return True
