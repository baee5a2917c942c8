"""Issue 28, how a peer ends: a stop order stops a peer once (from an authorized signer, issued after the peer
started; a refused one is logged once); a SIGTERM hands the stage over only while the run trains on and to a
peer that stays with room for it, otherwise it is a stop."""

from __future__ import annotations

import logging
import threading

import pytest

from swarm.daemon.stopping import StopWatch, leave_blocker, room_for, watch_stop_orders
from swarm.peers.dht_config import DHTConfig
from swarm.peers.records import PeerAnnouncement
from tests.unit.peers.test_manifest import NOW, OWNER, STRANGER, manifest
from tests.unit.peers.test_stop import TRAINER, FakeDHT, pid, subkey

GIB = 1 << 30


def peer(name: str, layers: tuple[int, int] | None, memory: int = 8 * GIB, leaving: bool = False) -> PeerAnnouncement:
    where = {} if layers is None else {"stage": 0, "layer_start": layers[0], "layer_end": layers[1]}
    return PeerAnnouncement(name * 12, "127.0.0.1:5000", "cpu", memory, 1.0, leaving=leaving, **where)


def need(layers: int) -> float:
    return layers * GIB + 0.5 * GIB  # a layer is 1 GiB, and half a GiB of activations and working memory


def owned_dht():
    owned = manifest(trainers=[pid(TRAINER)])
    return FakeDHT(DHTConfig(run_name=owned.run_id), owned=owned), owned.run_id


def order(dht, key, run, issued_at, reason=""):
    dht.entries[subkey(key)] = ({"run": run, "issued_at": issued_at, "reason": reason}, issued_at + 60)


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_a_watch_finds_an_authorized_order_issued_after_the_peer_started(monkeypatch):
    monkeypatch.setattr("hivemind.utils.get_dht_time", lambda: NOW + 5)
    dht, run = owned_dht()
    clock = Clock()
    watch = StopWatch(dht, started_at=NOW - 100, every_s=2.0, clock=clock)
    assert watch.poll() is None
    order(dht, TRAINER, run, NOW, "done")
    assert watch.poll() is None, "read at most every 2 s"
    clock.t = 2.0
    found = watch.poll()
    assert found is not None and found.signer == pid(TRAINER) and found.reason == "done"
    dht.entries.clear()
    assert watch.poll() is found, "once stopped, stays stopped"


def test_a_watch_ignores_an_earlier_runs_order_and_logs_a_strangers_once(monkeypatch, caplog):
    monkeypatch.setattr("hivemind.utils.get_dht_time", lambda: NOW + 5)
    dht, run = owned_dht()
    clock = Clock()
    watch = StopWatch(dht, started_at=NOW, every_s=1.0, clock=clock)
    order(dht, OWNER, run, NOW - 1)  # the owner's, but issued before this peer started: a restarted run's past
    order(dht, STRANGER, run, NOW + 1)
    with caplog.at_level(logging.WARNING, logger="swarm.peer"):
        for t in range(4):
            clock.t = float(t)
            assert watch.poll() is None
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and pid(STRANGER) in refusals[0].getMessage()


def test_the_trainers_watch_sets_its_stop_event(monkeypatch):
    monkeypatch.setattr("hivemind.utils.get_dht_time", lambda: NOW)
    dht, run = owned_dht()
    order(dht, OWNER, run, NOW + 1, "maintenance")
    stop, said = threading.Event(), []
    watch_stop_orders(dht, stop, said.append, every_s=0.01)
    assert stop.wait(10), "the trainer's stop event was never set"
    assert said and "maintenance" in said[0] and pid(OWNER) in said[0]


class ShutDownDHT(FakeDHT):
    """A DHT node shut down under the watch: hivemind cancels its pending reads."""

    def read_signed(self, kind):
        from concurrent.futures import CancelledError

        raise CancelledError()


def test_the_trainers_watch_ends_quietly_when_the_dht_node_shuts_down(monkeypatch):
    """Seen at every trainer's exit: the watch thread died with a CancelledError traceback on stderr."""
    monkeypatch.setattr("hivemind.utils.get_dht_time", lambda: NOW)
    owned = manifest(trainers=[pid(TRAINER)])
    dht = ShutDownDHT(DHTConfig(run_name=owned.run_id), owned=owned)
    died: list = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    stop = threading.Event()
    thread = watch_stop_orders(dht, stop, lambda _: None, every_s=0.01)
    thread.join(30)
    assert not thread.is_alive() and not died and not stop.is_set()


def test_room_a_replica_or_a_peer_whose_memory_holds_both_stages():
    me = "a" * 12
    assert room_for((0, 2), me, [peer("b", (0, 2), memory=0)], need) == "b" * 12, "a replica: nothing moves"
    assert room_for((0, 2), me, [peer("b", (2, 4), memory=4 * GIB)], need) is None, "needs 4.5 GiB"
    assert room_for((0, 2), me, [peer("b", (2, 4), memory=5 * GIB)], need) == "b" * 12
    assert room_for((0, 2), me, [peer("b", None, memory=3 * GIB)], need) == "b" * 12, "a standby"
    assert room_for((0, 2), me, [peer("b", None, memory=0)], need) is None, "unknown memory is not counted on"
    assert room_for((0, 2), me, [peer("b", (0, 2), leaving=True), peer("a", None)], need) is None


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"layers": None}, "serves no stage"),
        ({"stopping": True}, "the run is stopping"),
        ({"trainers": 0}, "no trainer is announced"),
        ({"active": False}, "saw no call"),
        ({"peers": [peer("b", (2, 4), memory=GIB)]}, "no peer that stays has room for layers [0, 2) (2.50 GiB more)"),
        ({}, None),
    ],
)
def test_a_leave_hands_over_only_while_the_run_trains_and_a_peer_has_room(changes, why):
    args = {"layers": (0, 2), "peers": [peer("b", (2, 4))], "stopping": False, "trainers": 1, "active": True}
    args.update(changes)
    blocker = leave_blocker(args.pop("layers"), "a" * 12, args.pop("peers"), need, **args)
    assert blocker == why if why is None else why in blocker


class _Servicer:
    """`when_idle` as the servicer runs it once the open step ended: the change, under its lock."""

    def __init__(self, host):
        self.host, self.previous, self.waited = host, None, []

    def when_idle(self, change, timeout_s):
        self.waited.append(timeout_s)
        change(self)
        return True


def _host():
    from types import SimpleNamespace

    return SimpleNamespace(role=SimpleNamespace(stage=1, layer_start=2, layer_end=4, n_stages=2), steps_done=7)


def ending(tmp_dir=None, host=None, dht=None):
    from types import SimpleNamespace

    from swarm.daemon.stopping import PeerEnding

    saved = []
    checkpoints = SimpleNamespace(save=lambda h, final: saved.append((h, final)))
    cfg = SimpleNamespace(checkpoint_dir=tmp_dir)
    dht = dht or owned_dht()[0]
    out = PeerEnding(cfg, dht, _Servicer(host), checkpoints, threading.Event(), started_at=NOW - 100)
    return out, saved


def test_a_stop_takes_the_stage_out_of_service_between_steps_and_saves_its_own_layers(tmp_path):
    host = _host()
    end, saved = ending(str(tmp_path), host)
    assert end.retire() is host
    assert end.servicer.host is None and end.servicer.previous is host and end.servicer.waited == [30.0]
    end.save_final(host)
    assert saved == [(host, True)]


def test_a_stop_without_a_checkpoint_dir_says_the_layers_are_not_saved(caplog):
    host = _host()
    end, saved = ending(None, host)
    with caplog.at_level(logging.WARNING, logger="swarm.peer"):
        end.save_final(host)
    assert not saved and "layers [2, 4) at step 7 are not saved" in caplog.text
    assert ending(None, None)[0].retire() is None, "a standby has nothing to retire"


def test_an_order_sets_the_peers_stop_and_a_slow_dht_read_is_retried(monkeypatch):
    monkeypatch.setattr("hivemind.utils.get_dht_time", lambda: NOW + 5)
    dht, run = owned_dht()
    end, _ = ending(dht=dht)
    reads = {"n": 0}
    real = dht.read_signed

    def slow_once(kind):
        reads["n"] += 1
        if reads["n"] == 1:
            raise TimeoutError("slow DHT")
        return real(kind)

    dht.read_signed = slow_once
    order(dht, OWNER, run, NOW, "done")
    assert not end.ordered() and not end.stop.is_set()
    end.watch._next = 0.0  # the next read is due
    assert end.ordered() and end.stop.is_set() and end.ordered()


def test_a_leave_reads_the_trainers_and_the_stages_last_call():
    from types import SimpleNamespace

    host = _host()
    idle = {"orphaned": False}
    host.ledger = SimpleNamespace(orphaned=lambda s: idle["orphaned"])
    end, _ = ending(host=host)
    end.dht.trainers = lambda: ["t"]
    spec = SimpleNamespace(stage_memory_bytes=lambda n, stages, replicas: n * GIB)
    peers = [peer("b", (0, 2), memory=8 * GIB)]
    assert end.leave_blocker(host, peers, spec) is None
    idle["orphaned"] = True
    assert "saw no call" in end.leave_blocker(host, peers, spec)
    end.dht.trainers = lambda: (_ for _ in ()).throw(TimeoutError("slow"))
    idle["orphaned"] = False
    assert "no trainer" in end.leave_blocker(host, peers, spec), "unknown trainers: no handover"
    end.dht.trainers = lambda: ["t"]
    assert end.leave_blocker(host, [peer("b", (0, 2), memory=3 * GIB)], spec).startswith("no peer that stays")


def test_a_leave_waiting_on_a_taker_gives_up_once_the_taker_leaves_too():
    """Two peers SIGTERMed together: the first saw the second staying with room and began to wait for a plan
    without it; the second stopped (no taker for it). The first must see that the taker is leaving (a stopping
    peer announces `leaving`) and stop too, instead of waiting out its leave timeout (SIGKILLed in the suite)."""
    from types import SimpleNamespace

    host = _host()
    end, _ = ending(host=host)
    spec = SimpleNamespace(stage_memory_bytes=lambda n, stages, replicas: n * GIB)
    assert end.taker(host, [peer("b", (2, 4), memory=8 * GIB)], spec) == "b" * 12
    assert end.taker(host, [peer("b", (2, 4), memory=8 * GIB, leaving=True)], spec) is None
    assert end.taker(host, [], spec) is None
