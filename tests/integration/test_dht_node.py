"""`swarm.peers.dht_node.DHTThread`: hivemind's DHT node in a thread of the calling process, started and shut
down cleanly (its p2pd and its thread gone), refusing requests once shut down, and failing to start with a
clear error; and the forked-process node (`DHTConfig.separate_process`) still there for who asks for it.

Real hivemind nodes and p2pd on loopback, each bounded by the DHT's own timeouts.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from swarm.peers.dht import SwarmDHT, quiet_hivemind
from swarm.peers.dht_config import DHTConfig
from swarm.peers.dht_node import DHTThread
from swarm.peers.records import TrainerAnnouncement

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _p2pds() -> set[int]:
    return {p.pid for p in psutil.Process().children() if p.name() == "p2pd" and p.status() != psutil.STATUS_ZOMBIE}


def _gone(pids: set[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pids & _p2pds() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the children's state; the deadline bounds it
    return not pids & _p2pds()


def _dht_threads() -> int:
    return sum(t.name == "swarm-dht" and t.is_alive() for t in threading.enumerate())


def test_a_node_in_a_thread_serves_records_and_shuts_down_with_its_p2pd():
    quiet_hivemind()
    before, threads = _p2pds(), _dht_threads()
    with SwarmDHT(DHTConfig(run_name="node-thread")) as dht:
        assert isinstance(dht._dht, DHTThread) and dht.is_alive()
        mine = _p2pds() - before
        assert len(mine) == 1, "one p2pd, a child of this process"
        assert _dht_threads() == threads + 1
        ann = TrainerAnnouncement(peer_id=dht.peer_id, started_at=1.0)
        assert dht.announce(ann)
        assert [t.peer_id for t in dht.trainers()] == [dht.peer_id]
    assert not dht.is_alive()
    assert _gone(mine), "p2pd outlived its node's shutdown"
    assert _dht_threads() == threads, "the node's thread outlived its shutdown"
    with pytest.raises(RuntimeError, match="shut down"):
        dht.peers()
    dht.shutdown()  # twice: nothing happens
    with pytest.raises(RuntimeError, match="not running"):
        dht._dht.get("x")


def test_a_node_that_cannot_join_fails_clearly_and_leaves_nothing():
    quiet_hivemind()
    before, threads = _p2pds(), _dht_threads()
    nowhere = "/ip4/127.0.0.1/tcp/9/p2p/QmQ2Q5cYEyuRvM4iQ6ZU8pp6aAkh5dvoPhRbh7jgRHA1ne"
    with pytest.raises(RuntimeError, match="could not start a DHT node and join"):
        SwarmDHT(DHTConfig(initial_peers=(nowhere,), start_timeout_s=15.0))
    assert _gone(_p2pds() - before)
    deadline = time.monotonic() + 10
    while _dht_threads() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dht_threads() == threads


def test_shutting_down_a_node_while_it_starts_ends_it():
    quiet_hivemind()
    before, threads = _p2pds(), _dht_threads()
    node = DHTThread(None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=15.0)
    node.shutdown()  # at once: before or during DHTNode.create
    with pytest.raises(RuntimeError, match="shut down"):
        node.wait_until_ready(timeout=30)
    assert not node.is_alive()
    assert _gone(_p2pds() - before)
    assert _dht_threads() == threads


def test_a_node_in_a_separate_process_is_still_an_option():
    quiet_hivemind()
    with SwarmDHT(DHTConfig(run_name="node-process", separate_process=True)) as a:
        assert not isinstance(a._dht, DHTThread) and a._dht.pid is not None and a.is_alive()
        joined = DHTConfig(run_name="node-process", initial_peers=tuple(a.visible_maddrs()))
        with SwarmDHT(dataclasses.replace(joined, client_mode=True)) as b:  # a thread's node reads the process's
            ann = TrainerAnnouncement(peer_id=a.peer_id, started_at=1.0)
            assert a.announce(ann)
            assert [t.peer_id for t in b.trainers()] == [a.peer_id]
    assert not a.is_alive()


def test_a_daemons_dht_node_works_without_hiveminds_package_init():
    code = textwrap.dedent(
        """
        import sys
        import swarm.daemon  # defers hivemind's package __init__ (swarm.daemon.lean)
        from swarm.peers.dht import SwarmDHT, quiet_hivemind
        from swarm.peers.dht_config import DHTConfig
        from swarm.peers.records import TrainerAnnouncement

        quiet_hivemind()
        with SwarmDHT(DHTConfig(run_name="deferred")) as dht:
            assert dht.announce(TrainerAnnouncement(peer_id=dht.peer_id, started_at=1.0))
            assert [t.peer_id for t in dht.trainers()] == [dht.peer_id]
            dht.visible_maddrs()
        print(sorted(m for m in ("hivemind.moe", "hivemind.optim", "scipy", "pydantic") if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("injected", ["once", "every-attempt"])
def test_a_p2pd_that_fails_to_start_is_started_again_and_failing_every_attempt_is_reported(monkeypatch, injected):
    """gRPC's poller, in a process that runs gRPC, can print into the pipe of the p2pd being forked before its exec,
    which hivemind reads as "Daemon failed to start": the node starts p2pd again, up to `P2PD_START_ATTEMPTS` times
    in all, then reports it. (A real failure on a loaded machine may add an attempt to the injected ones.)"""
    import swarm.peers.dht_node as dht_node

    quiet_hivemind()
    failures = 1 if injected == "once" else dht_node.P2PD_START_ATTEMPTS
    original, calls = dht_node.DHTNode.create, []

    async def create(*args, **kwargs):
        calls.append(1)
        if len(calls) <= failures:
            raise RuntimeError("Daemon failed to start: E1128 ev_epoll1_linux.cc:373] epoll_wait error: Bad fd")
        return await original(*args, **kwargs)

    monkeypatch.setattr(dht_node.DHTNode, "create", create)
    if failures < dht_node.P2PD_START_ATTEMPTS:
        with SwarmDHT(DHTConfig(run_name="p2pd-again")) as dht:
            assert dht.is_alive() and failures + 1 <= len(calls) <= dht_node.P2PD_START_ATTEMPTS
    else:
        with pytest.raises(RuntimeError, match="Daemon failed to start"):
            SwarmDHT(DHTConfig(run_name="p2pd-again", start_timeout_s=30.0))
        assert len(calls) == dht_node.P2PD_START_ATTEMPTS
