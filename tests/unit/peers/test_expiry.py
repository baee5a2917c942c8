"""`swarm.peers.expiry`: hivemind's record storage keeps a bounded expiration heap however often a key is stored
again, and expires and evicts exactly what it did before."""

from __future__ import annotations

import pytest

from swarm.daemon.lean import defer_hivemind_init

defer_hivemind_init()

from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.dht.storage import DHTLocalStorage  # noqa: E402
from hivemind.utils import timed_storage  # noqa: E402
from hivemind.utils.timed_storage import TimedStorage  # noqa: E402

from swarm.peers.expiry import GHOST_SLACK, bound_expiration_heaps, compact  # noqa: E402

bound_expiration_heaps()


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(timed_storage, "get_dht_time", lambda: now[0])
    return now


def test_a_key_stored_again_ten_thousand_times_leaves_a_bounded_heap(clock):
    storage = TimedStorage()
    for i in range(10_000):
        for key in ("plan", "links", "peers"):
            storage.store(key, i, clock[0] + 3600 + i)  # a long TTL, refreshed at every store
        clock[0] += 0.01
    assert len(storage.expiration_heap) <= GHOST_SLACK + 1
    assert storage.get("plan").value == 9_999


def test_dictionary_records_keep_bounded_heaps_outside_and_inside(clock):
    storage = DHTLocalStorage()
    key = DHTID.generate(source="run.peers")
    for _ in range(5_000):
        for peer in (b"p1", b"p2"):
            assert storage.store(key, b"announcement", clock[0] + 300, subkey=peer)
        clock[0] += 0.05
    inner = storage.get(key).value
    assert len(storage.expiration_heap) <= GHOST_SLACK + 1
    assert len(inner.expiration_heap) <= GHOST_SLACK + 2
    assert set(dict(inner.items())) == {b"p1", b"p2"}


def test_expiry_is_unchanged_by_compaction(clock):
    storage = TimedStorage()
    t = clock[0]
    for i in range(500):  # "a" refreshed often: its ghosts expire at t+10 .. t+509, its value at t+600
        storage.store("a", i, t + 10 + i)
    storage.store("a", "last", t + 600)
    storage.store("b", "b", t + 50)
    storage.store("c", "stale", t + 40)
    assert storage.store("c", "older", t + 20) is False, "an older record is refused, as before"
    clock[0] = t + 60
    assert storage.get("a").value == "last" and storage.get("b") is None
    clock[0] = t + 601
    assert storage.get("a") is None
    assert len(storage.expiration_heap) <= GHOST_SLACK


def test_a_full_storage_evicts_the_earliest_live_record_ghosts_or_not(clock):
    storage = TimedStorage(maxsize=2)
    t = clock[0]
    for i in range(300):
        storage.store("x", i, t + 100 + i)  # ghosts of x expire before y's value
    storage.store("y", "y", t + 200)
    storage.store("z", "z", t + 1000)  # one too many: the earliest live record goes (y)
    assert storage.get("y") is None and storage.get("x").value == 299 and storage.get("z").value == "z"


def test_compact_leaves_a_small_heap_alone_and_install_is_idempotent():
    storage = TimedStorage()
    storage.store("k", 1, timed_storage.get_dht_time() + 100)
    assert compact(storage) is False
    assert bound_expiration_heaps() is False, "installed once per process"
