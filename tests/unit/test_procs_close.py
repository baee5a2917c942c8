"""`ProcessGroup.close(sig=...)`: a local swarm's children get the signal asked for (`swarm demo` stops its peers
with SIGINT, a stop, rather than SIGTERM, a leave), and one that ignores it is killed after the grace."""

from __future__ import annotations

import signal
import sys

from swarm.testbed.procs import ProcessGroup

CHILD = """
import signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(5))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(6))
print("ready", flush=True)
time.sleep(60)
"""

STUBBORN = """
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


def test_close_sends_the_signal_asked_for_and_kills_what_ignores_it(tmp_path):
    with ProcessGroup(tmp_path) as procs:
        procs.start("polite", [sys.executable, "-c", CHILD])
        procs.start("stubborn", [sys.executable, "-c", STUBBORN])
        for name in ("polite", "stubborn"):
            procs.wait_for_file(tmp_path / f"{name}.log", 60)
        codes = procs.close(grace_s=2.0, sig=signal.SIGINT)
    assert codes == {"polite": 5, "stubborn": -signal.SIGKILL}
