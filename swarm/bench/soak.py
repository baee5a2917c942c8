"""`swarm bench soak`: a loopback swarm of real processes trains for many steps while every process's RSS,
threads and open fds are sampled; does anything grow with the step count?

The swarm is `swarm demo`'s: a DHT bootstrap node and `--peers` swarm-peer processes (`swarm.testbed.local`),
plus `swarm train` as a process of its own. Each row is one of them summed with all its descendants (its
p2pd: the DHT node is a thread of the process, `swarm.peers.dht_node`), sampled from this process by pid with
psutil. The trainer's step count comes from its /metrics (`swarm_steps_total`). The start figures are taken
once the warm-up (10% of the steps by default) is over; the slope is a least-squares fit of RSS against the step
over every sample after it. Targets (issue 28, tightened from issue 11's 1 MiB): slope under 0.5 MiB per 1000
steps, and threads and fds flat: a count's floor (its least value over the first and over the last tenth of the
samples) does not rise. A thread a step or a call starts and ends is no growth, but whether one sample caught it
running is chance; a thread or fd that is never given back raises the floor. Every sample is kept in the run's
folder (`samples.jsonl`). `SWARM_MEMWATCH_S=S` makes each peer log what grows (`swarm.daemon.memwatch`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from swarm.flags import Flags
from swarm.options import MODEL_FLAGS, ModelFlags
from swarm.report import print_table

__all__ = ["ProcessSample", "SoakConfig", "add_arguments", "floors", "run", "sample_tree", "slope_per_1k", "summed"]

MODEL = ModelFlags(layers=2, hidden=32, heads=2, seq_len=16)
"""The soak's model: every peer's and the trainer's."""
TRAIN_SAMPLES, BATCH_SIZE, MICRO_BATCHES = 64, 4, 2
SLOPE_TARGET_MIB_PER_1K = 0.5
"""Issue 28: a volunteer's run lasts millions of steps (issue 11 allowed 1.0)."""
FLOOR_FRACTION = 0.1
"""Share of the samples at each end whose least thread (and fd) count is the count's floor there."""
COLUMNS = [
    "process", "rss_start_mib", "rss_end_mib", "rss_slope_mib_per_1k_steps", "threads_start", "threads_end",
    "threads_floor_start", "threads_floor_end", "threads_grew", "fds_floor_start", "fds_floor_end", "processes",
    "steps", "verdict",
]  # fmt: skip


@dataclass(frozen=True)
class SoakConfig:
    """`swarm bench soak`: how long the swarm trains and how it is sampled."""

    steps: int = 5000
    """training steps"""
    peers: int = 2
    """swarm-peer processes, one stage each"""
    warmup_fraction: float = 0.1
    """share of the steps before the start figures"""
    sample_every_s: float | None = None
    """seconds between samples (none: 2, 0.5 with --quick)"""
    per_process: bool = False
    """also one row per process of each tree (python, p2pd), named ROLE/NAME PID"""
    quick: bool = False
    """200 steps (for tests)"""
    out: str | None = None
    """folder for logs and the trainer's outputs (none: runs/soak-*)"""
    json: bool = False
    """print one JSON object per row instead of a table"""

    def run_config(self) -> SoakConfig:
        """The run the flags give: --quick is 200 steps, and the sampling period is set."""
        steps = 200 if self.quick else self.steps
        every = self.sample_every_s if self.sample_every_s is not None else 0.5 if self.quick else 2.0
        return replace(self, steps=steps, sample_every_s=every)


_FLAGS = Flags(SoakConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A loopback swarm as real processes (a DHT bootstrap node, --peers swarm-peer, swarm train) trains for "
        "--steps steps while this process samples every process's RSS, threads and open fds (each summed with "
        "its child processes: p2pd). Reports start (after the warm-up) and end "
        "figures and the RSS slope per 1000 steps, PASS/FAIL against issue 28's targets (slope < "
        f"{SLOPE_TARGET_MIB_PER_1K} MiB per 1000 steps; threads and fds flat: their least count over the last "
        f"{FLOOR_FRACTION:.0%} of the samples not above that over the first). Every sample goes to "
        "OUT/samples.jsonl. Default run: 5000 "
        f"steps of a 2-layer, hidden-32, seq-16 model on 2 peers, batches of {BATCH_SIZE} samples in "
        f"{MICRO_BATCHES} micro-batches drawn from {TRAIN_SAMPLES} samples, aqsgd2 activations and gradq4 "
        "gradients on unshaped links: a few minutes on 2 cores. SIGINT or SIGTERM stops it early and reports the "
        "samples taken so far (each row then says stopped_early_at_step)."
    )
    _FLAGS.add_to(parser)


@dataclass(frozen=True)
class ProcessSample:
    """One process (or a tree of them, summed) at one moment."""

    rss_mib: float
    threads: int
    fds: int
    processes: int
    pss_mib: float | None = None
    """proportional set size: each shared page split among the processes sharing it (`sample_tree(full=True)`)"""
    uss_mib: float | None = None
    """unique set size: the pages only this process maps (`sample_tree(full=True)`)"""
    thread_names: tuple[tuple[str, int], ...] = ()
    """How many of its threads carry each name (the kernel's, /proc/PID/task/TID/comm: gRPC's C threads name
    themselves, Python's all read as the interpreter's), so a risen count says which kind of thread it was."""


def thread_names(pid: int) -> tuple[tuple[str, int], ...]:
    """(name, count) of `pid`'s threads, by their kernel names, sorted; () where /proc cannot be read."""
    counts: Counter[str] = Counter()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ()
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                counts[f.read().strip()] += 1
        except OSError:
            continue  # a thread that ended while being read
    return tuple(sorted(counts.items()))


def sample_tree(pid: int, full: bool = False) -> dict[str, ProcessSample]:
    """RSS, threads and open fds of `pid` and each of its descendants, keyed "NAME PID" (the root first);
    empty if `pid` is gone. A child that ends while being read is left out.

    Args:
        pid: the tree's root.
        full: also PSS and USS, from /proc/PID/smaps_rollup (psutil's `memory_full_info`: slower, so not
            for a soak's every sample; `swarm bench footprint` reads them once).
    """
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for proc in tree:
        try:
            with proc.oneshot():
                mem = proc.memory_full_info() if full else proc.memory_info()
                pss, uss = (getattr(mem, "pss", mem.rss) / 2**20, mem.uss / 2**20) if full else (None, None)
                sample = ProcessSample(
                    mem.rss / 2**20, proc.num_threads(), proc.num_fds(), 1, pss, uss, thread_names(proc.pid)
                )
                out[f"{proc.name()} {proc.pid}"] = sample
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # a child that ended between listing and reading
    return out


def summed(samples: dict[str, ProcessSample]) -> ProcessSample | None:
    if not samples:
        return None
    values = samples.values()
    names = sum((Counter(dict(s.thread_names)) for s in values), Counter())
    return ProcessSample(
        sum(s.rss_mib for s in values),
        sum(s.threads for s in values),
        sum(s.fds for s in values),
        len(samples),
        thread_names=tuple(sorted(names.items())),
    )


def slope_per_1k(steps: list[float], values: list[float]) -> float | None:
    """Least-squares slope of `values` against `steps`, per 1000 steps; None with fewer than two distinct steps."""
    if len(set(steps)) < 2:
        return None
    n = len(steps)
    mean_s, mean_v = sum(steps) / n, sum(values) / n
    cov = sum((s - mean_s) * (v - mean_v) for s, v in zip(steps, values, strict=True))
    var = sum((s - mean_s) ** 2 for s in steps)
    return 1000.0 * cov / var


def floors(values: list[int], fraction: float = FLOOR_FRACTION) -> tuple[int, int]:
    """The least of `values` (a count over a run's samples, in order) over its first and over its last `fraction`
    (at least one sample each): what the count returns to between the threads or fds that come and go."""
    if not values:
        raise ValueError("floors: no values")
    k = max(1, int(len(values) * fraction))
    return min(values[:k]), min(values[-k:])


@dataclass
class _Series:
    """The samples of one process after the warm-up."""

    steps: list[float] = field(default_factory=list)
    samples: list[ProcessSample] = field(default_factory=list)

    def row(self, name: str) -> dict:
        if not self.samples:
            return {"process": name, "verdict": "FAIL", "steps": 0, "note": "no sample after the warm-up"}
        first, last = self.samples[0], self.samples[-1]
        slope = slope_per_1k(self.steps, [s.rss_mib for s in self.samples])
        threads = floors([s.threads for s in self.samples])
        fds = floors([s.fds for s in self.samples])
        ok = slope is not None and slope < SLOPE_TARGET_MIB_PER_1K
        ok = ok and threads[1] <= threads[0] and fds[1] <= fds[0]
        by_name = [dict(s.thread_names) for s in self.samples]
        grew = {}  # the thread names whose own floor rose: which kind of thread the risen count is
        for kind in sorted({n for names in by_name for n in names}):
            floor = floors([names.get(kind, 0) for names in by_name])
            if floor[1] > floor[0]:
                grew[kind] = list(floor)
        return {
            "process": name,
            "rss_start_mib": round(first.rss_mib, 2),
            "rss_end_mib": round(last.rss_mib, 2),
            "rss_slope_mib_per_1k_steps": None if slope is None else round(slope, 3),
            "threads_start": first.threads,
            "threads_end": last.threads,
            "threads_floor_start": threads[0],
            "threads_floor_end": threads[1],
            "threads_max": max(s.threads for s in self.samples),
            "threads_grew": grew,
            "fds_start": first.fds,
            "fds_end": last.fds,
            "fds_floor_start": fds[0],
            "fds_floor_end": fds[1],
            "processes": last.processes,
            "steps": int(self.steps[-1] - self.steps[0]),
            "step_start": int(self.steps[0]),
            "step_end": int(self.steps[-1]),
            "samples": len(self.samples),
            "verdict": "PASS" if ok else "FAIL",
        }


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM: stop like Ctrl-C, and report what was sampled


def _sample(procs, names: list[str], per_process: bool, step: int, series: dict[str, _Series], record) -> None:
    """One sample of every process tree (and, with `per_process`, of each of its processes) at `step`, each also
    written to `record` (a text file) as a JSON line."""
    for name in names:
        tree = sample_tree(procs.procs[name].pid)
        parts = {f"{name}/{key}": part for key, part in tree.items()} if per_process else {}
        for key, sample in ((name, summed(tree)), *parts.items()):
            if sample is not None:
                series.setdefault(key, _Series()).steps.append(step)
                series[key].samples.append(sample)
                line = {"process": key, "step": step, "rss_mib": round(sample.rss_mib, 3)}
                line.update(threads=sample.threads, fds=sample.fds, thread_names=dict(sample.thread_names))
                record.write(json.dumps(line) + "\n")


class _StepReader:
    """The trainer's step count, read from its /metrics once its log says where that is."""

    def __init__(self, log: Path):
        self.log, self.url = log, None

    def step(self) -> int | None:
        if self.url is None:
            found = (
                re.search(r"metrics at (http://\S+)", self.log.read_text(errors="replace"))
                if self.log.exists()
                else None
            )
            if found is None:
                return None
            self.url = found.group(1)
        try:
            with urllib.request.urlopen(self.url, timeout=2) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        found = re.search(r"^swarm_steps_total (\S+)$", text, re.MULTILINE)
        return int(float(found.group(1))) if found else None


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from swarm.daemon.peer_config import PeerConfig, PlanningConfig, peer_flags
    from swarm.options import CodecFlags
    from swarm.runtime.worker import OptimConfig
    from swarm.testbed.local import local_swarm
    from swarm.testbed.procs import swarm_command
    from swarm.train.trainer import train_flags

    cfg = _FLAGS.from_args(args).run_config()
    if cfg.steps < 10 or not 0 <= cfg.warmup_fraction < 1 or cfg.peers < 1:
        print("error: need --steps >= 10, 0 <= --warmup-fraction < 1 and --peers >= 1", file=sys.stderr)
        return 2
    out = Path(cfg.out or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say = lambda line: print(f"[soak] {line}", file=sys.stderr)
    warmup = int(cfg.steps * cfg.warmup_fraction)
    peer = PeerConfig(
        threads=1,
        planning=PlanningConfig(codec_policy="fixed"),  # these codecs on every link, run after run
        optim=OptimConfig(total_steps=cfg.steps, warmup_steps=max(1, warmup)),
        **CodecFlags("aqsgd2", "gradq4").build(),
    )
    peer_argv = [*peer_flags().to_argv(peer), *MODEL_FLAGS.to_argv(MODEL)]
    say(f"starting a bootstrap node and {cfg.peers} peers")
    with local_swarm(out, cfg.peers, peer_argv, say) as swarm:
        procs = swarm.procs
        flags = train_flags()
        train = replace(
            flags.base, model=MODEL.build(), address_file=str(swarm.address_file), num_stages=cfg.peers,
            train_samples=TRAIN_SAMPLES, batch_size=BATCH_SIZE, micro_batches=MICRO_BATCHES, steps=cfg.steps,
            metrics_port=0, out=str(out / "train"),
        )  # fmt: skip
        trainer = procs.start("trainer", swarm_command("train", *flags.to_argv(train)))
        names = list(procs.procs)
        series = {name: _Series() for name in names}
        reader = _StepReader(procs.log_dir / "trainer.log")
        stopped_at = None  # the step at which a SIGINT or SIGTERM stopped the soak early
        previous = signal.signal(signal.SIGTERM, _interrupt)
        record = (out / "samples.jsonl").open("w", buffering=1)
        try:
            with tqdm(total=cfg.steps, desc="soak", unit="step", file=sys.stderr) as bar:
                while trainer.poll() is None:
                    for name, proc in procs.procs.items():
                        if name != "trainer" and proc.poll() is not None:
                            procs.check_alive()  # raises, naming the process and its log's last lines
                    step = reader.step()
                    if step is not None:
                        bar.update(step - bar.n)
                        if warmup <= step < cfg.steps:  # after the last step the trainer is shutting down
                            _sample(procs, names, cfg.per_process, step, series, record)
                    time.sleep(cfg.sample_every_s)  # the sampling period, not a synchronisation
        except KeyboardInterrupt:
            stopped_at = bar.n
            say(f"stopped at step {stopped_at} of {cfg.steps}: reporting the samples taken so far")
        finally:
            signal.signal(signal.SIGTERM, previous)
            record.close()
        if stopped_at is None and trainer.returncode != 0:
            print(f"error: the trainer exited with {trainer.returncode}:\n{procs.tail('trainer')}", file=sys.stderr)
            return 1
    rows = [series[name].row(name) for name in sorted(series, key=lambda k: (names.index(k.split("/")[0]), k))]
    if stopped_at is not None:
        rows = [{**row, "stopped_early_at_step": stopped_at} for row in rows]
    if cfg.json:
        for row in rows:
            print(json.dumps(row))
    else:
        title = (
            f"soak: {cfg.steps} steps, {cfg.peers} peers; start after {warmup} steps; each process with its "
            f"children (p2pd) summed; target slope < {SLOPE_TARGET_MIB_PER_1K} MiB/1k steps, "
            "threads' and fds' floors not rising"
        )
        print_table(rows, COLUMNS, title)
    return 0  # FAIL rows are figures to read, not a failure of the benchmark
