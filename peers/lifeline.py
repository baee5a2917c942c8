"""Tying a helper process's life to its parent's, so a `kill -9` of a peer leaves no DHT process or p2pd behind.

hivemind runs the DHT in a forked child (`hivemind.DHT`, a daemon `multiprocessing` process) and that child
starts the p2p daemon (`p2pd`, Go) as its own child. Both are stopped by the parent's clean shutdown only:
SIGKILL the parent and the DHT process (~260 MB) and p2pd run on, reparented to init. Two ties cut them loose
no more:

- the DHT process asks the kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), when it was forked
  from the parent's main thread (the kernel ties the signal to the forking *thread*, so a fork from a worker
  thread would die with that thread), and in every case watches its parent's pid (`watch_parent`): a
  reparented process exits within `poll_s`;
- p2pd, forked by the DHT process's main (event-loop) thread, gets `PR_SET_PDEATHSIG` between fork and exec
  (`pdeathsig_preexec`), so it dies with the DHT process whichever way that one ends.

Linux only (`prctl`); elsewhere the watch thread alone applies (and p2pd is left to hivemind's shutdown).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["die_with_parent", "p2pd_dies_with_this_process", "pdeathsig_preexec", "set_pdeathsig", "watch_parent"]

_PR_SET_PDEATHSIG = 1


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Asks the kernel to send `sig` to this process when the thread that forked it ends; False where unsupported.

    Async-signal-safe enough for a `preexec_fn` (one libc call, no allocation beyond ctypes' own)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pdeathsig_preexec() -> None:
    """A `preexec_fn` for a child that must die with the process starting it (p2pd in the DHT process)."""
    set_pdeathsig(signal.SIGKILL)


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], poll_s: float = 0.5) -> threading.Thread:
    """Starts a daemon thread calling `on_orphaned()` once this process's parent is no longer `parent_pid`
    (it died and this process was reparented to init or a subreaper)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(poll_s)
        on_orphaned()

    thread = threading.Thread(target=watch, name="swarm-parent-watch", daemon=True)
    thread.start()
    return thread


def die_with_parent(parent_pid: int, forked_from_main_thread: bool, poll_s: float = 0.5) -> None:
    """Called first thing in a forked helper process: it is SIGKILLed (or exits) once `parent_pid` is gone.

    Args:
        parent_pid: the parent's pid as the parent saw it before forking (if it already differs from
            `os.getppid()`, the parent died before this line and the process exits now).
        forked_from_main_thread: whether the parent forked from its main thread, whose end is the process's
            end; only then is the kernel's parent-death signal safe to ask for.
        poll_s: how often the watch thread compares the parent's pid.
    """
    if forked_from_main_thread:
        set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:  # died between the fork and prctl: the kernel will not signal any more
        os._exit(0)

    def orphaned() -> None:
        with contextlib.suppress(OSError):  # p2pd has PR_SET_PDEATHSIG: it goes with this process
            os.kill(os.getpid(), signal.SIGKILL)

    watch_parent(parent_pid, orphaned, poll_s)


def p2pd_dies_with_this_process() -> None:
    """Makes every child this process starts through asyncio (hivemind starts p2pd so) die with it.

    Call only in a process of its own (the DHT process): it replaces `asyncio.subprocess.create_subprocess_exec`,
    which hivemind's `P2P.create` calls, for the whole process."""
    import asyncio.subprocess

    original = asyncio.subprocess.create_subprocess_exec

    async def spawn(*args, **kwargs):
        kwargs.setdefault("preexec_fn", pdeathsig_preexec)
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = spawn
