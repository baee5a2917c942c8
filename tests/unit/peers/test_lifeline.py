"""`swarm.peers.lifeline`: a helper dies with the process that started it, however that one dies.

A middle process forks a helper that calls `die_with_parent` (with and without the kernel's parent-death
signal: a fork from a worker thread must rely on the pid watch alone) and starts a grandchild through asyncio
after `p2pd_dies_with_this_process` (as hivemind starts p2pd); the middle one is SIGKILLed and both must be gone
within a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

MIDDLE = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from swarm.peers.lifeline import die_with_parent, p2pd_dies_with_this_process

    parent, from_main = os.getpid(), sys.argv[1] == "main"
    pid = os.fork()
    if pid == 0:  # the helper (hivemind's DHT process)
        die_with_parent(parent, from_main, poll_s=0.05)
        p2pd_dies_with_this_process()

        async def start():
            return await asyncio.subprocess.create_subprocess_exec("sleep", "60")

        grandchild = asyncio.run(start())
        print(os.getpid(), grandchild.pid, flush=True)
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
    """
)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("forked_from", ["main", "thread"])
def test_a_helper_and_its_child_die_with_a_sigkilled_parent(forked_from):
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, forked_from], stdout=subprocess.PIPE, text=True)
    try:
        helper, grandchild = map(int, middle.stdout.readline().split())
        assert alive(helper) and alive(grandchild)
        middle.send_signal(signal.SIGKILL)
        middle.wait(10)
        deadline = time.monotonic() + 10
        while (alive(helper) or alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the processes' state; the deadline bounds it
        assert not alive(helper), "the helper outlived its parent"
        assert not alive(grandchild), "the helper's child outlived it"
    finally:
        for pid in locals().get("helper", None), locals().get("grandchild", None):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        if middle.poll() is None:
            middle.kill()
            middle.wait(10)


def test_a_helper_whose_parent_died_before_it_looked_exits_at_once():
    code = textwrap.dedent(
        """
        import os
        from swarm.peers.lifeline import die_with_parent
        die_with_parent(os.getppid() + 1_000_000, False)
        raise SystemExit(7)
        """
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
