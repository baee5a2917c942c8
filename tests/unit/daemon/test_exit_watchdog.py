"""A stopped peer exits even when its exit hangs: its Python exit timer ends it, and where that timer cannot run
(another thread holds the GIL in native code, or the interpreter is finalizing), faulthandler's native watchdog
does. Each case is a child process that arms the watchdog and then never exits by itself; it is reaped."""

from __future__ import annotations

import subprocess
import sys

import pytest

DEADLINE_S = 240.0
"""How long a child may take to be ended (its watchdog fires after ~1 s; importing torch on a loaded machine is
the slow part). Its hang lasts far longer, so a child still alive at the deadline is the failure."""

ARM = "from swarm.daemon import peer\npeer.HARD_EXIT_AFTER_S = 0.5\npeer._exit_within(0.5, 0)\n"
ARM_WATCHDOG_ONLY = (
    "import threading\n"
    "class NoTimer:\n"
    "    def __init__(self, *args): pass\n"
    "    def start(self): pass\n"
    "threading.Timer = NoTimer\n"
    "from swarm.daemon import peer\npeer.HARD_EXIT_AFTER_S = 15.0\npeer._exit_within(0.5, 0)\n"
)
"""The watchdog's 15 s (not the peer's 0.5): under the suite's load the finalizer took more than 5 s to reach the
hang (the teardown of the modules torch loaded comes first), and the watchdog fired before it (CI-shaped run, s61)."""

HANGS = {
    # a native call that keeps the GIL (ctypes.PyDLL does not release it): the Python timer never runs
    "gil_held": "import ctypes\nctypes.PyDLL(None).sleep(3600)\n",
    # the interpreter finalizing: an object torn down at exit waits in native code with the GIL released (as gRPC's
    # and the DHT's teardown can); the timer, a daemon thread, may no longer take the GIL then (checked by hand: the
    # timer alone left this child hanging). The Python timer is left out and the watchdog given 15 s from arming,
    # which comes after the imports: the script's last lines and the finalizer's start stand between it and the
    # hang (the test fails, never passes, if the watchdog came first: "stuck at exit" is then missing);
    # collaborators are defaults: globals are gone then
    "at_finalization": (
        "import ctypes, os, threading\n"
        "class Stuck:\n"
        "    def __del__(self, sleep=ctypes.CDLL(None).sleep, write=os.write):\n"
        "        write(1, b'stuck at exit\\n')\n"
        "        sleep(3600)\n"
        "stuck = Stuck()\n"
    ),
}


def _run(code: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as e:  # subprocess.run kills and reaps the child
        pytest.fail(f"the stopped peer's process was still alive after {DEADLINE_S} s: {e.stdout!r} {e.stderr!r}")


def test_the_exit_timer_ends_a_peer_whose_exit_waits_on_a_thread():
    done = _run(ARM + "import threading\nthreading.Event().wait()\n")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "still running" in done.stderr and "most recent call first" in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("hang", sorted(HANGS))
def test_a_peer_whose_exit_timer_cannot_run_is_still_ended(hang):
    done = _run((ARM_WATCHDOG_ONLY if hang == "at_finalization" else ARM) + HANGS[hang])
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])  # faulthandler's exit status
    assert "most recent call first" in done.stdout, done.stdout[-2000:]  # every thread's stack, in the peer's log
    if hang == "at_finalization":
        assert "stuck at exit" in done.stdout, "the hang under test never ran: the case tests nothing"
