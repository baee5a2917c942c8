"""A swarm command's start: the garbage collector paused while its modules import, their objects frozen after.

Importing torch, gRPC, hivemind and swarm makes about 190,000 objects that live as long as the process. Meanwhile the
collector ran 427 times, three of them full passes at 0.05-0.11 s each once torch was in: 0.3 of the 2.1 CPU-s that
`swarm-peer`'s imports took here, and the suite starts a few hundred such processes. Every later full pass walks
them all again: about 0.1 s, a stall of a peer's stage in the middle of a step. So a process started as one of
swarm's commands pauses the collector before its first import (`pause_for_imports`, from `swarm/__init__.py`) and,
once its command's modules are in, moves everything alive into the permanent generation (`gc.freeze`, the pattern
CPython's documentation gives for a process's start) and turns the collector on again (`imports_done`).

Only a command line that runs `swarm` or `swarm-peer` pauses anything: a program or a test that imports swarm as a
library keeps its collector as it was. What the imports left unreachable stays frozen with the rest, never collected:
about 7,000 objects, 0.65 MB (shallow sizes) for swarm-peer's, against a full pass (0.15 s) to free them first.
"""

from __future__ import annotations

import gc
import sys

__all__ = ["entry_point", "imports_done", "pause_for_imports"]

MODULES = {"swarm.cli": "swarm", "swarm.daemon.peer": "swarm-peer"}
"""`python -m` modules -> the command they run"""
SCRIPTS = ("swarm", "swarm-peer")
"""console scripts, named as their command"""

_paused = False


def entry_point(orig_argv: list[str]) -> str | None:
    """The swarm command this process's command line (`sys.orig_argv`) runs, "swarm" or "swarm-peer": a console
    script, or `python [options] -m swarm.cli` / `-m swarm.daemon.peer`; None for anything else."""
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "-m":
            return MODULES.get(next(args, None))
        if arg == "-c":  # code, not a script
            return None
        if arg in ("-X", "-W"):
            next(args, None)  # the option's value
        elif not arg.startswith("-"):
            script = arg.rsplit("/", 1)[-1]
            return script if script in SCRIPTS else None
    return None


def pause_for_imports() -> None:
    """Pauses the collector where this process runs a swarm command and nothing turned it off before."""
    global _paused
    if gc.isenabled() and entry_point(sys.orig_argv) is not None:
        gc.disable()
        _paused = True


def imports_done() -> None:
    """Freezes what the imports made and turns the collector on again; nothing where `pause_for_imports` paused
    nothing (a library user's process, a command called in-process)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
