"""SIGTERM to a `swarm` command unwinds it as Ctrl-C does: the processes it started are reaped (an experiment
killed with `kill` left its bootstrap, peers and their p2pd running), and it exits 128 + 15 with one line, no
traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

SCRIPT = """
import sys, time
from pathlib import Path
from swarm.cli import unwind_on_sigterm
from swarm.testbed.procs import ProcessGroup

unwind_on_sigterm()
try:
    with ProcessGroup(Path(sys.argv[1])) as procs:
        child = procs.start("child", [sys.executable, "-c", "import time; time.sleep(120)"])
        print(child.pid, flush=True)
        while True:
            time.sleep(0.05)
except KeyboardInterrupt:
    sys.exit(143)
"""


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_unwinds_the_owner_and_its_process_group_reaps_the_child(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(owner.stdout.readline())
        assert psutil.pid_exists(child)
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(30) == 143
        assert _gone(child, 30), "the child outlived its owner's SIGTERM"
    finally:
        owner.kill()
        owner.wait(10)


CLI = """
import os, signal, sys, time, types
from swarm import cli

fake = types.ModuleType("fake_command")
fake.add_arguments = lambda parser: None


def run(args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the handler interrupts this
    return 0


fake.run = run
sys.modules["fake_command"] = fake
cli.COMMANDS[("fake",)] = ("fake_command", "a command SIGTERMed while it runs")
sys.exit(cli.main(["fake"]))
"""


def test_the_cli_turns_a_sigterm_into_an_unwind_one_line_and_exit_143():
    done = subprocess.run([sys.executable, "-c", CLI], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert "swarm fake: stopped by SIGTERM" in done.stderr and "Traceback" not in done.stderr, done.stderr
