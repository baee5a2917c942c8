"""Where a namespace cell's CPU goes, swarm's beside PyTorch's own pipeline: by library and by process and thread.

    python scripts/measure_step_cpu.py [--rate 1000] [--setting fp32/fp32] [--steps 300] [--out DIR] [--json]

Runs the issue's command for one rate and setting (`swarm experiment throttled --netns --baseline torch`; root),
and meanwhile:

- `perf record -a -k mono` samples every core (`--no-perf`, or no perf on PATH: left out). Each sample's leaf is
  credited to its shared object (libtorch_cpu, libpython, the kernel, gRPC's core, ...) when it falls in a step
  after the first epoch of its cell, in a process of that cell (swarm's peers, trainer, bootstrap node and p2pd
  daemons; torch's ranks). The intervals a held-out evaluation ran in are left out, as the cell's own accounting
  (`cpu_ms_per_step`) leaves them out.
- every process of the run and each of its threads is read from /proc twice a second; a `sitecustomize` on
  PYTHONPATH names each Python thread for the OS (Python 3.11 does not), so a thread reads as `swarm-dht` or
  `grpc-...`, not `python` (the pooled call threads, which take each call's name in turn, as `call-threads`). Only
  sample pairs with no held-out evaluation between them count.

Prints, in ms of CPU a step, each library's share for swarm's cell and torch's, and each process's threads;
`--json` prints them as one object. Nothing in the product changes: the hook only names threads.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from swarm.experiments.throttled import Cell, ThrottledConfig
from swarm.train.steplog import step_spans

PERF_HZ = 499
SAMPLE_S = 0.5

THREAD_NAMES = """
import ctypes, threading
_prctl = ctypes.CDLL(None).prctl
_inner = threading.Thread._bootstrap_inner

def _named(self):
    # pooled call threads (`swarm.runtime.routing.CallThreads`) take each call's name in turn: one name for them all
    pooled = getattr(getattr(self, "_target", None), "__qualname__", "") == "CallThreads._loop"
    try:
        _prctl(15, ("call-threads" if pooled else self.name).encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass
    return _inner(self)

threading.Thread._bootstrap_inner = _named
"""
"""The sitecustomize every process of the run imports: OS thread names from Python's (`/proc/PID/task/TID/comm`)."""


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """A process's threads: tid -> (name, user + system CPU seconds)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / ticks)  # utime, stime
    return out


def _role(cmd: list[str], parent: str | None) -> str:
    line = " ".join(cmd)
    if "p2pd" in line:
        return f"p2pd of {parent or '?'}"
    if "swarm.daemon.peer" in line:
        return f"peer {cmd[cmd.index('--host') + 1]}" if "--host" in cmd else "peer"
    if "torch_baseline" in line:
        return f"torch rank {cmd[cmd.index('--rank') + 1]}" if "--rank" in cmd else "torch rank"
    if " train " in f" {line} ":
        return "trainer"
    if "bootstrap" in line:
        return "bootstrap"
    return "other"


def _is_daemon(proc: psutil.Process) -> bool:
    try:
        return proc.name() == "p2pd"
    except psutil.Error:
        return False


class Sampler:
    """Snapshots of the run's processes and threads (`SAMPLE_S` apart) until `stop`."""

    def __init__(self, root: int):
        self.root, self.snaps, self.roles = root, [], {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                procs = psutil.Process(self.root).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            snap = {}
            # parents first: a p2pd daemon is named after the process that started it
            for proc in sorted(procs, key=_is_daemon):
                try:
                    if proc.pid not in self.roles:
                        self.roles[proc.pid] = _role(proc.cmdline(), self.roles.get(proc.ppid()))
                    snap[proc.pid] = _threads(proc.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ValueError):
                    continue
            self.snaps.append((time.time(), snap))


def _intervals(rows: list[dict], per_epoch: int) -> list[tuple[float, float]]:
    """The unix-time intervals of the steps the cells' `cpu_ms_per_step` counts (`machine_cpu`): after the first
    epoch, none a held-out evaluation ran in (`step_spans`)."""
    return [(start, end) for start, end, _ in step_spans(rows[per_epoch:])]


def _inside(intervals: list[tuple[float, float]], t: float) -> bool:
    i = bisect.bisect_right(intervals, (t, float("inf"))) - 1
    return i >= 0 and intervals[i][0] <= t <= intervals[i][1]


def _library(dso: str) -> str:
    name = dso.rsplit("/", 1)[-1]
    if name.startswith(("[JIT]", "perf-")):
        return "JIT code (MKL's kernels, p2pd's Go)"
    return re.sub(r"\.cpython-\d+-[^.]+\.so$|\.abi3\.so$", "", name) or "?"


def by_library(perf_data: Path, groups: dict, offset: float) -> dict[str, dict[str, float]]:
    """ms of CPU a step by library, per group {name: (pids, intervals)}; perf's monotonic times + `offset` = unix."""
    text = subprocess.run(
        ["perf", "script", "-i", str(perf_data), "-F", "pid,time,ip,dso"], capture_output=True, text=True, check=True
    ).stdout
    counts = {g: collections.Counter() for g in groups}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+\((.*)\)\s*$", line)
        if not m or m.group(1) == "0":
            continue
        pid, t = int(m.group(1)), float(m.group(2)) + offset
        for g, (pids, intervals) in groups.items():
            if pid in pids and _inside(intervals, t):
                counts[g][_library(m.group(3))] += 1
    return {g: {lib: 1000 * n / PERF_HZ / len(groups[g][1]) for lib, n in counts[g].most_common()} for g in groups}


def by_thread(sampler: Sampler, pids: set[int], intervals: list[tuple[float, float]], step_s: float) -> dict:
    """ms of CPU a step by process role and thread name, from sample pairs with no evaluation between them."""
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(intervals, intervals[1:], strict=False) if a1 - b0 > 1e-3]
    start, end = intervals[0][0], intervals[-1][1]
    cpu: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    wall = 0.0
    for (t0, s0), (t1, s1) in zip(sampler.snaps, sampler.snaps[1:], strict=False):
        if t0 < start or t1 > end or any(g0 < t1 and g1 > t0 for g0, g1 in gaps):
            continue
        wall += t1 - t0
        for pid in pids & s0.keys() & s1.keys():
            for tid, (name, seconds) in s1[pid].items():
                if tid in s0[pid]:
                    cpu[sampler.roles[pid]][re.sub(r"[-_]?\d+$", "", name)] += seconds - s0[pid][tid][1]
    if wall <= 0:
        return {}
    scale = 1000 * step_s / wall
    return {
        role: {"total": scale * sum(c.values()), **{n: scale * v for n, v in c.most_common() if scale * v >= 0.05}}
        for role, c in sorted(cpu.items(), key=lambda kv: -sum(kv[1].values()))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rate", default="1000", help="the link's Mbit/s (one rate)")
    parser.add_argument("--setting", default="fp32/fp32", help="swarm's FW/BW codecs")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each cell")
    parser.add_argument("--out", type=Path, default=None, help="output folder (none: runs/step-cpu-<time>)")
    parser.add_argument("--no-perf", action="store_true", help="no perf record: the per-thread table only")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("the namespace cells need root")
    out = (args.out or Path(f"runs/step-cpu-{time.strftime('%Y%m%d-%H%M%S')}")).absolute()
    hook = out / "sitecustomize"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(THREAD_NAMES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "swarm.cli", "experiment", "throttled", "--netns", "--baseline", "torch",
               "--rates", args.rate, "--settings", args.setting, "--steps", str(args.steps), "--json",
               "--out", str(out / "run")]  # fmt: skip
    perf = None if args.no_perf or shutil.which("perf") is None else out / "perf.data"
    if perf is not None:
        command = ["perf", "record", "-a", "-k", "mono", "-F", str(PERF_HZ), "-o", str(perf), "--", *command]
    offset = time.time() - time.monotonic()
    with open(out / "run.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(proc.pid)
        sampler.start()
        code = proc.wait()
        sampler.stop()
    if code:
        print(f"the run failed ({code}); see {out / 'run.log'}", file=sys.stderr)
        return code
    rows = json.loads((out / "run" / "results.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    cfg = ThrottledConfig()
    per_epoch = cfg.train_samples // cfg.batch_size
    groups, figures = {}, {"rate_mbit": args.rate, "setting": args.setting, "steps": args.steps, "cells": {}}
    for row in rows:
        torch_row = row["setting"] == "torch-fp32"
        cell_dir = out / "run" / Cell(row["rate_mbit"], row["setting"]).label
        if torch_row:
            steps = [json.loads(line) for line in (cell_dir / "rank0.jsonl").read_text().splitlines()]
        else:
            with open(cell_dir / "train" / "steps.csv") as f:
                steps = list(csv.DictReader(f))
        intervals = _intervals(steps, per_epoch)
        if not intervals:
            continue
        pids = {p for p, r in sampler.roles.items() if r.startswith("torch") == torch_row and r != "other"}
        step_s = sum(b - a for a, b in intervals) / len(intervals)
        groups[row["setting"]] = (pids, intervals)
        figures["cells"][row["setting"]] = {
            "mean_step_s": row["mean_step_s"],
            "cpu_ms_per_step": row.get("cpu_ms_per_step"),
            "steps_counted": len(intervals),
            "by_thread_ms_per_step": by_thread(sampler, pids, intervals, step_s),
        }
    if perf is not None:
        for setting, libraries in by_library(perf, groups, offset).items():
            figures["cells"][setting]["by_library_ms_per_step"] = libraries
    if args.json:
        print(json.dumps(figures))
        return 0
    for setting, cell in figures["cells"].items():
        print(f"== {setting}: {cell['mean_step_s']:.4f} s a step, {cell['cpu_ms_per_step'] or 0:.1f} ms of CPU a step "
              f"(the run's own accounting), {cell['steps_counted']} steps counted")  # fmt: skip
        libraries = cell.get("by_library_ms_per_step", {})
        if libraries:
            print(f"   by library (perf), {sum(libraries.values()):.1f} ms a step:")
            for lib, ms in list(libraries.items())[:12]:
                print(f"      {ms:7.1f}  {lib}")
        print("   by process and thread (/proc):")
        for role, threads in cell["by_thread_ms_per_step"].items():
            parts = ", ".join(f"{n} {v:.1f}" for n, v in threads.items() if n != "total")
            print(f"      {threads['total']:7.1f}  {role}: {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
