"""`swarm bench footprint`: how much memory a default toy `swarm-peer` takes once it has served some steps.

A loopback swarm as real processes (`swarm.testbed.local`: a DHT bootstrap node and `--peers` swarm-peer
processes with every flag at its default, the default toy model) trains `--steps` steps with `swarm train`;
then, the trainer gone and the peers still serving, each peer's process tree is read (`soak.sample_tree`): the
peer's own python process (its DHT node is a thread of it, `swarm.peers.dht_node`) and its p2pd; with
`DHTConfig.separate_process`, a hivemind DHT process (a fork of the peer, role "dht") between them. For each
process: RSS, and PSS and USS from /proc/PID/smaps_rollup (psutil's `memory_full_info`). A fork shares its
parent's pages, so a tree's summed RSS counts those twice; its summed PSS is what the tree really holds of the
machine's memory (each shared page split among the processes sharing it: the shared libraries' pages too, so
the same peer reads a little higher on a machine where fewer processes map torch). The target (issue 28): a
peer's summed PSS at most 450 MB (MB = 10**6 bytes); the summed RSS, the issue's own measure, is reported
beside it. A figure for the record, not a timed test.

Each process's PSS is split into anonymous pages (heaps, thread stacks, relocated library data: what the process
itself holds) and file-backed ones (library code, shared with every process mapping it), and its threads are
counted by name (`thread_names` in `--json`: Python's names where set, the kernel's `comm` otherwise), which is
where a footprint cut starts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from swarm.flags import Flags
from swarm.report import print_table

__all__ = ["FootprintConfig", "TARGET_MB", "add_arguments", "measure_tree", "read_pss_split", "run", "thread_names"]

TARGET_MB = 450.0
"""Issue 28: a default toy swarm-peer (with its p2pd) holds at most this many MB."""
COLUMNS = ["process", "role", "rss_mb", "pss_mb", "pss_anon_mb", "pss_file_mb", "uss_mb", "threads", "verdict"]


@dataclass(frozen=True)
class FootprintConfig:
    """`swarm bench footprint`: the swarm measured and how long it trains first."""

    steps: int = 30
    """training steps served before the measurement"""
    peers: int = 2
    """swarm-peer processes (default flags, default toy model), one stage each"""
    settle_s: float = 2.0
    """seconds after the trainer exits before reading (the peers finish their last step's bookkeeping)"""
    out: str | None = None
    """folder for logs and the trainer's outputs (none: runs/footprint-*)"""
    json: bool = False
    """print one JSON object per process and per peer (its sum) instead of a table"""


_FLAGS = Flags(FootprintConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A loopback swarm of default toy swarm-peer processes serves --steps training steps; then each peer's "
        "memory is read: RSS, PSS and USS of the peer process (its DHT node is a thread of it) and its p2pd, "
        f"separately and summed. PASS when a peer's summed PSS is at most {TARGET_MB:.0f} MB (PSS splits each shared "
        "page among the processes mapping it; the summed RSS, which counts shared pages in full, is shown too)."
    )
    _FLAGS.add_to(parser)


def _role(name: str, depth: int) -> str:
    if name == "p2pd":
        return "p2pd"
    return "peer" if depth == 0 else "dht"


def read_pss_split(pid: int) -> tuple[float, float] | None:
    """(anonymous, file-backed) PSS of `pid` in bytes, from /proc/PID/smaps_rollup (Linux >= 5.x: Pss_Anon,
    Pss_File and Pss_Shmem, counted as file); None if the process is gone or the kernel has no such fields."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(re.findall(r"^(Pss_\w+):\s+(\d+) kB", f.read(), re.MULTILINE))
    except OSError:
        return None
    if "Pss_Anon" not in fields:
        return None
    kib = lambda name: int(fields.get(name, 0)) * 1024
    return float(kib("Pss_Anon")), float(kib("Pss_File") + kib("Pss_Shmem"))


def thread_names(pid: int) -> dict[str, int]:
    """`pid`'s threads counted by name, numbers dropped (`grpc_3` and `grpc_12` are both `grpc_`); empty if
    the process is gone."""
    import os

    names: Counter[str] = Counter()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[re.sub(r"\d+", "", f.read().strip())] += 1
        except OSError:
            continue  # a thread that ended while being read
    return dict(names.most_common())


def measure_tree(pid: int) -> list[dict]:
    """One row per process of `pid`'s tree (the root first): name, pid, role (peer, dht, p2pd), rss/pss/uss in
    MB and threads, read by the soak's `sample_tree`. Empty if `pid` is gone; a child that ends while being read
    is left out."""
    from swarm.bench.soak import sample_tree

    mb = lambda mib: round(mib * 2**20 / 1e6, 1)
    rows = []
    for depth, (key, s) in enumerate(sample_tree(pid, full=True).items()):
        name, child = key.rsplit(" ", 1)
        role = _role(name, min(depth, 1))
        split = read_pss_split(int(child))
        anon, file = (None, None) if split is None else (round(split[0] / 1e6, 1), round(split[1] / 1e6, 1))
        rows.append(
            {"process": key, "role": role, "rss_mb": mb(s.rss_mib), "pss_mb": mb(s.pss_mib), "pss_anon_mb": anon,
             "pss_file_mb": file, "uss_mb": mb(s.uss_mib), "threads": s.threads,
             "thread_names": thread_names(int(child))}
        )  # fmt: skip
    return rows


def summed_row(name: str, rows: list[dict]) -> dict:
    """A peer's tree summed, with its verdict against `TARGET_MB` (on PSS)."""
    keys = ("rss_mb", "pss_mb", "pss_anon_mb", "pss_file_mb", "uss_mb", "threads")
    total = {k: round(sum(r.get(k) or 0 for r in rows), 1) for k in keys}
    ok = bool(rows) and total["pss_mb"] <= TARGET_MB
    return {"process": name, "role": "sum", **total, "processes": len(rows), "verdict": "PASS" if ok else "FAIL"}


def run(args: argparse.Namespace) -> int:
    from swarm.daemon.peer_config import PeerConfig, peer_flags
    from swarm.options import MODEL_FLAGS, ModelFlags
    from swarm.testbed.local import local_swarm
    from swarm.testbed.procs import swarm_command
    from swarm.train.trainer import train_flags

    cfg = _FLAGS.from_args(args)
    if cfg.steps < 1 or cfg.peers < 1 or cfg.settle_s < 0:
        print("error: need --steps >= 1, --peers >= 1 and --settle-s >= 0", file=sys.stderr)
        return 2
    out = Path(cfg.out or f"runs/footprint-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say = lambda line: print(f"[footprint] {line}", file=sys.stderr)
    model = ModelFlags()
    peer_argv = [*peer_flags().to_argv(PeerConfig()), *MODEL_FLAGS.to_argv(model)]
    say(f"starting a bootstrap node and {cfg.peers} default toy peers")
    rows: list[dict] = []
    with local_swarm(out, cfg.peers, peer_argv, say) as swarm:
        procs = swarm.procs
        flags = train_flags()
        train = replace(
            flags.base, model=model.build(), address_file=str(swarm.address_file), num_stages=cfg.peers,
            steps=cfg.steps, out=str(out / "train"),
        )  # fmt: skip
        say(f"training {cfg.steps} steps")
        trainer = procs.start("trainer", swarm_command("train", *flags.to_argv(train)))
        while trainer.poll() is None:
            procs.check_alive()  # a peer that died fails here, naming it and its log's last lines
            time.sleep(0.5)  # polling the trainer's exit, not a synchronisation
        if trainer.returncode != 0:
            print(f"error: the trainer exited with {trainer.returncode}:\n{procs.tail('trainer')}", file=sys.stderr)
            return 1
        time.sleep(cfg.settle_s)  # the measurement's settling time, not a synchronisation
        for name, proc in procs.procs.items():
            if name == "trainer":
                continue
            tree = measure_tree(proc.pid)
            rows += [{**r, "process": f"{name}/{r['process']}"} for r in tree]
            if name != "bootstrap":
                rows.append(summed_row(name, tree))
            else:
                rows.append({**summed_row(name, tree), "verdict": "-"})  # the bootstrap is no peer: no target
    if cfg.json:
        for row in rows:
            print(json.dumps(row))
    else:
        title = (
            f"footprint: {cfg.peers} default toy swarm-peer after {cfg.steps} steps; MB = 10**6 bytes; "
            f"target: a peer's summed PSS <= {TARGET_MB:.0f} MB"
        )
        print_table(rows, COLUMNS, title)
    return 0  # a FAIL row is a figure to read, not a failure of the benchmark
