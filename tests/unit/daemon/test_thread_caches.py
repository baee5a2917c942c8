"""swarm-peer starts without glibc's per-thread malloc caches (swarm.daemon.lean.exec_without_thread_caches): the
setting reaches the peer process (replaced once, same pid) and its children, a user's own setting stands, and no
other program that imports swarm.daemon is replaced."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from swarm.daemon.lean import NO_THREAD_CACHES, runs_swarm_peer, without_thread_caches

DEADLINE_S = 240.0
"""for a peer process on a loaded machine to start and replace itself"""


@pytest.mark.parametrize(
    ("argv", "peer"),
    [
        (["/v/bin/python3", "/v/bin/swarm-peer", "--address-file", "a"], True),
        (["python3", "-m", "swarm.daemon.peer", "--help"], True),
        (["python3", "-X", "importtime", "-u", "-m", "swarm.daemon.peer"], True),
        (["python3", "-m", "swarm.daemon.peerx"], False),
        (["python3", "-m", "swarm.cli", "train"], False),
        (["/v/bin/python3", "/v/bin/swarm", "bench", "soak"], False),
        (["/v/bin/python3", "-c", "import swarm.daemon"], False),  # -c's code is not a script path
        (["/v/bin/python3", "/v/bin/pytest", "tests/"], False),
        (["python3"], False),
        ([], False),
    ],
)
def test_only_swarm_peers_command_lines_are_peers(argv, peer):
    assert runs_swarm_peer(argv) is peer


def test_the_caches_are_turned_off_once_and_a_users_choice_stands():
    env = without_thread_caches({"PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == NO_THREAD_CACHES and env["PATH"] == "/bin"
    assert without_thread_caches(env) is None, "a replaced process must never replace itself again"
    other = without_thread_caches({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{NO_THREAD_CACHES}"
    assert without_thread_caches({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}) is None  # the user's own
    # a libc that dropped the variable (a setuid start): the marker alone stops a second replacement
    assert without_thread_caches({k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}) is None


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_peer_process_replaces_itself_without_the_caches(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SWARM_REEXECED_FOR_MALLOC")}
    argv = [sys.executable, "-m", "swarm.daemon.peer", "--address-file", str(tmp_path / "never.addr")]
    peer = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        seen = {}
        while time.monotonic() < deadline and peer.poll() is None:  # it waits for the address file forever
            seen = _environ(peer.pid)
            if seen.get("SWARM_REEXECED_FOR_MALLOC"):
                break
            time.sleep(0.2)  # polling /proc, not a synchronisation
        assert peer.poll() is None, f"the peer exited ({peer.returncode}): {peer.stderr.read()[-2000:]}"
        assert seen.get("GLIBC_TUNABLES") == NO_THREAD_CACHES, "the peer (same pid) did not restart without caches"
    finally:
        peer.kill()
        peer.wait(30)
        peer.stderr.close()


def test_another_program_importing_swarm_daemon_is_not_replaced():
    code = "import os, swarm.daemon; print(os.environ.get('SWARM_REEXECED_FOR_MALLOC'), os.getpid())"
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SWARM_REEXECED_FOR_MALLOC")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "None"
