"""`swarm bench idle`: the CPU an idle swarm burns, process by process.

A loopback swarm as real processes (`swarm.testbed.local`: a DHT bootstrap node and `--peers` swarm-peer
processes, the default toy model, every peer on stage `--stages` of a plan with `--replicas` replicas) is started
and left to settle; then each process tree's CPU time (user + system, psutil) is read twice, `--seconds` apart,
with nobody training. What remains is what the swarm's own upkeep costs a volunteer's machine: each peer polls the
DHT for announcements and plans, the planner pings every plan peer's Status and renews its lease, every p2pd
serves the DHT's requests. Rows: each process (role peer, p2pd, bootstrap) with its CPU seconds and its share of
one core over the window, each peer's tree summed, and the whole swarm. A figure for the record, no target.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.flags import Flags
from swarm.report import print_table

__all__ = ["IdleConfig", "add_arguments", "cpu_rows", "run"]

COLUMNS = ["process", "role", "cpu_s", "core_pct"]


@dataclass(frozen=True)
class IdleConfig:
    """`swarm bench idle`: the swarm measured and for how long."""

    peers: int = 5
    """swarm-peer processes (the default toy model)"""
    stages: int = 2
    """pipeline stages of the plan (peers beyond stages x replicas stand by)"""
    replicas: int = 2
    """replicas of every stage"""
    settle_s: float = 5.0
    """seconds between the plan being served and the first reading (the start-up's work done)"""
    seconds: float = 30.0
    """the measured window"""
    out: str | None = None
    """folder for the processes' logs (none: runs/idle-*)"""
    json: bool = False
    """print one JSON object per row instead of a table"""


_FLAGS = Flags(IdleConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A loopback swarm of swarm-peer processes (default toy model) is left idle, nobody training: the CPU "
        "seconds each process (peer, its p2pd, the bootstrap node) spends over --seconds, and its share of a core."
    )
    _FLAGS.add_to(parser)


def _cpu(proc) -> float | None:
    import psutil

    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _role(proc, depth: int, name: str) -> str:
    try:
        exe = proc.name()
    except Exception:
        exe = ""
    if "p2pd" in exe:
        return "p2pd"
    return ("bootstrap" if name == "bootstrap" else "peer") if depth == 0 else "child"


def cpu_rows(before: dict[int, float], after: dict[int, float], names: dict[int, tuple[str, str]], seconds: float):
    """Rows of the window: one per process alive at both readings (`names`: pid -> (label, role)), one sum per
    label prefix (a peer with its p2pd), and the swarm's sum. A process that ended in the window is left out."""
    row = lambda process, role, used: {"process": process, "role": role, "cpu_s": round(used, 2),
                                       "core_pct": round(100 * used / seconds, 1)}  # fmt: skip
    rows, sums = [], {}
    for pid, (label, role) in names.items():
        if pid not in before or pid not in after:
            continue
        used = max(after[pid] - before[pid], 0.0)
        rows.append(row(label, role, used))
        owner = label.split("/", 1)[0]
        sums[owner] = sums.get(owner, 0.0) + used
    rows += [row(owner, "sum", used) for owner, used in sums.items()]
    rows.append(row("swarm", "total", sum(sums.values())))
    return rows


def run(args: argparse.Namespace) -> int:
    from swarm.testbed.local import local_swarm

    cfg = _FLAGS.from_args(args)
    if cfg.peers < 1 or cfg.stages < 1 or cfg.replicas < 1 or cfg.seconds <= 0 or cfg.settle_s < 0:
        print("error: need --peers, --stages, --replicas >= 1, --seconds > 0 and --settle-s >= 0", file=sys.stderr)
        return 2
    if cfg.peers < cfg.stages * cfg.replicas:
        print(f"error: {cfg.stages} stages x {cfg.replicas} replicas need at least that many --peers", file=sys.stderr)
        return 2
    out = Path(cfg.out or f"runs/idle-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say = lambda line: print(f"[idle] {line}", file=sys.stderr)
    flags = ["--num-stages", str(cfg.stages), "--replicas", str(cfg.replicas), "--min-peers", str(cfg.peers)]
    flags += ["--compute-speed", "50", "--no-link-probe"]  # declared and unprobed: no measurement in the window
    say(f"starting a bootstrap node and {cfg.peers} peers ({cfg.stages} stages x {cfg.replicas} replicas)")
    with local_swarm(out, cfg.peers, flags, say, n_stages=cfg.stages) as swarm:
        time.sleep(cfg.settle_s)  # the start-up's settling time, not a synchronisation
        procs, names = {}, {}  # pid -> its psutil.Process, and its (label, role)
        for name, proc in swarm.procs.procs.items():
            for depth, p in enumerate(_tree(proc.pid)):
                role = _role(p, depth, name)
                procs[p.pid], names[p.pid] = p, (name if depth == 0 else f"{name}/{role}", role)
        before = {pid: c for pid, p in procs.items() if (c := _cpu(p)) is not None}
        say(f"measuring {cfg.seconds:.0f} s with nobody training")
        start = time.monotonic()
        time.sleep(cfg.seconds)  # the measured window, not a synchronisation
        seconds = time.monotonic() - start
        swarm.procs.check_alive()
        after = {pid: c for pid, p in procs.items() if (c := _cpu(p)) is not None}
    rows = cpu_rows(before, after, names, seconds)
    if cfg.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows, COLUMNS, f"idle: {cfg.peers} peers, nobody training, CPU over {seconds:.0f} s")
    return 0
