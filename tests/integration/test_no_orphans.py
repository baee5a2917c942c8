"""Issue 28, "No orphans": a `kill -9` of a `swarm-peer` takes its p2pd (and any other child) with it.

Before, its hivemind DHT process and p2pd ran on with parent 1 (~260 MB); the DHT node now runs in a thread of the
peer (`swarm.peers.dht_node`), so p2pd is its one helper process. The peer runs alone (no bootstrap: a new DHT);
once it logs that it joined, its descendants are read with psutil, the peer is SIGKILLed, and every descendant must
be gone within a deadline (waited on, polled; a zombie counts as gone). Whatever is left is killed so the test leaves
nothing.
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from swarm.daemon.peer_config import PeerConfig, peer_flags
from swarm.testbed.procs import ProcessGroup, peer_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL_FLAGS = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16"]


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def test_a_sigkilled_peer_leaves_no_dht_process_or_p2pd(tmp_path):
    argv = peer_command(*peer_flags().to_argv(PeerConfig(compute_layers_per_s=100.0)), *MODEL_FLAGS)
    with ProcessGroup(tmp_path) as procs:
        peer = procs.start("peer", argv)
        deadline = time.monotonic() + 90
        while "joined the DHT as" not in procs.tail("peer", 200):
            procs.check_alive()
            assert time.monotonic() < deadline, procs.tail("peer")
            time.sleep(0.1)  # polling the log; the line is what synchronizes
        children = psutil.Process(peer.pid).children(recursive=True)
        names = sorted(p.name() for p in children)
        assert "p2pd" in names, names
        assert not any(p.name().startswith("python") for p in children), names  # the DHT node is a thread
        peer.send_signal(signal.SIGKILL)
        peer.wait(10)
        deadline = time.monotonic() + 15  # torch's shm manager exits on its own within a few seconds
        while (left := _running(children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in left:
            p.kill()
    assert not left, f"left running after the peer's SIGKILL: {[(p.pid, p.name()) for p in left]}"
