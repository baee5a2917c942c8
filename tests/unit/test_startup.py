"""swarm.startup: a swarm command's imports run without the garbage collector, their objects frozen after; a
program that imports swarm keeps its collector."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.startup import entry_point

CHECK = """
import gc, sys
import swarm
paused = not gc.isenabled()
import swarm.startup
swarm.startup.imports_done()
print(paused, gc.isenabled(), gc.get_freeze_count() > 0)
"""


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["/v/bin/python3", "/v/bin/swarm-peer", "--address-file", "a"], "swarm-peer"),
        (["/v/bin/python3", "/v/bin/swarm", "bench", "soak"], "swarm"),
        (["python3", "-m", "swarm.daemon.peer", "--help"], "swarm-peer"),
        (["python3", "-X", "importtime", "-u", "-m", "swarm.cli", "train"], "swarm"),
        (["python3", "-m", "swarm.daemon.peerx"], None),
        (["python3", "-m", "swarm.experiments.liar_peer"], None),
        (["/v/bin/python3", "-c", "import swarm.cli"], None),  # -c's code is not a script path
        (["/v/bin/python3", "/v/bin/pytest", "tests/"], None),
        (["/v/bin/python3", "/v/bin/swarmx"], None),
        (["python3"], None),
        ([], None),
    ],
)
def test_only_swarms_command_lines_are_its_commands(argv, command):
    assert entry_point(argv) == command


def _run(argv: list[str]) -> list[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_swarm_command_imports_without_the_collector_and_freezes_what_it_imported(tmp_path):
    script = tmp_path / "swarm"  # a console script named as swarm's
    script.write_text(CHECK)
    paused, enabled, frozen = _run([sys.executable, str(script)])
    assert (paused, enabled, frozen) == ("True", "True", "True")


def test_a_program_that_imports_swarm_keeps_its_collector():
    paused, enabled, frozen = _run([sys.executable, "-c", CHECK])
    assert (paused, enabled, frozen) == ("False", "True", "False")
