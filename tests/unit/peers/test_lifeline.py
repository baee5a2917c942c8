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


THREAD_SPAWN = textwrap.dedent(
    """
    import asyncio, sys, threading, time
    from swarm.peers.lifeline import p2pd_dies_with_its_thread

    p2pd_dies_with_its_thread()
    p2pd_dies_with_its_thread()  # idempotent: one hook, not a hook around a hook

    async def start():
        child = await asyncio.subprocess.create_subprocess_exec(sys.argv[1], stdout=asyncio.subprocess.PIPE)
        print(child.pid, (await child.stdout.readline()).decode().strip(), flush=True)
        await asyncio.sleep(0.2)

    thread = threading.Thread(target=asyncio.run, args=(start(),))
    thread.start()
    thread.join()
    print("thread ended", flush=True)
    time.sleep(60)
    """
)


def _spawn_from_a_thread(program: str, env: dict) -> tuple[subprocess.Popen, int, str]:
    """A process that starts `program` through asyncio from a thread that then ends (the process stays):
    returns the process, the program's pid and its first output line."""
    argv = [sys.executable, "-c", THREAD_SPAWN, program]
    starter = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    pid, line = starter.stdout.readline().split(maxsplit=1)
    assert starter.stdout.readline().strip() == "thread ended"
    return starter, int(pid), line.strip()


def _script(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_text('#!/bin/sh\necho "GOGC=${GOGC:-unset}"\nexec sleep 60\n')
    path.chmod(0o755)
    return str(path)


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the process's state; the deadline bounds it
    return not alive(pid)


def _reap(starter: subprocess.Popen, pid: int) -> None:
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
    starter.kill()
    starter.wait(10)


@pytest.mark.parametrize("name", ["p2pd", "other"])
def test_only_a_p2pd_started_from_a_thread_dies_with_that_thread_and_runs_with_a_low_gogc(tmp_path, name):
    env = {k: v for k, v in os.environ.items() if k != "GOGC"}
    starter, pid, line = _spawn_from_a_thread(_script(tmp_path, name), env)
    try:
        if name == "p2pd":
            assert line == "GOGC=25"
            assert _gone_within(pid, 10), "p2pd outlived the thread that started it"
        else:
            assert line == "GOGC=unset"
            time.sleep(0.5)  # an absence: the program must still run after its starter thread ended
            assert alive(pid), "a program that is not p2pd got the parent-death signal or the GOGC"
    finally:
        _reap(starter, pid)


def test_a_users_gogc_stands(tmp_path):
    starter, pid, line = _spawn_from_a_thread(_script(tmp_path, "p2pd"), {**os.environ, "GOGC": "100"})
    _reap(starter, pid)
    assert line == "GOGC=100"
