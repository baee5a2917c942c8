"""Tying a helper process's life to its parent's, so a `kill -9` of a peer leaves no DHT process or p2pd behind.

A peer's DHT node runs in a thread of the peer (`swarm.peers.dht_node`) and starts the p2p daemon (`p2pd`, Go)
from that thread: `p2pd_dies_with_its_thread` gives p2pd `PR_SET_PDEATHSIG`, so it dies with that thread, which
ends with the node's shutdown or with the process, whichever way the process ends (SIGKILL included).

hivemind's own `DHT` (`DHTConfig.separate_process`) runs the DHT in a forked child (a daemon `multiprocessing`
process) and that child starts p2pd as its own child. Both are stopped by the parent's clean shutdown only:
SIGKILL the parent and the DHT process (~260 MB) and p2pd run on, reparented to init. Two ties cut them loose no
more:

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

__all__ = [
    "P2PD_GOGC",
    "die_with_parent",
    "p2pd_dies_with_its_thread",
    "p2pd_dies_with_this_process",
    "pdeathsig_preexec",
    "set_pdeathsig",
    "watch_parent",
]

_PR_SET_PDEATHSIG = 1
P2PD_GOGC = "25"
"""p2pd's GOGC unless the environment sets one: with Go's default (100) its heap grew by ~4 MiB per 1000 training
steps for minutes (`swarm bench soak`), garbage waiting for a collection; at 25 its RSS stays flat, for a little
more of its (small) CPU time."""
_hook_lock = threading.Lock()
_prctl: Callable[..., int] | None = None


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


def _resolved_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up before any fork: a child forked beside other threads must not dlopen (a lock
    another thread held at the fork stays held in the child)."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def p2pd_dies_with_its_thread(gogc: str = P2PD_GOGC) -> None:
    """Makes every p2pd this process starts through asyncio (hivemind's `P2P.create`) die with the thread that
    starts it (the DHT node's, `swarm.peers.dht_node`), and run with GOGC=`gogc` unless its environment has one.

    Other programs started through asyncio are left as they are. Installed once per process; idempotent."""
    import asyncio.subprocess

    prctl = _resolved_prctl()
    with _hook_lock:
        original = asyncio.subprocess.create_subprocess_exec
        if getattr(original, "_swarm_p2pd_hook", False):
            return

        def preexec() -> None:  # runs in the forked child, before exec: one resolved libc call
            if prctl is not None:
                prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

        async def spawn(program, *args, **kwargs):
            if os.path.basename(str(program)) == "p2pd":
                kwargs.setdefault("preexec_fn", preexec)
                env = kwargs.get("env")
                env = dict(os.environ) if env is None else env
                env.setdefault("GOGC", gogc)
                kwargs["env"] = env
            return await original(program, *args, **kwargs)

        spawn._swarm_p2pd_hook = True  # type: ignore[attr-defined]
        asyncio.subprocess.create_subprocess_exec = spawn


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
