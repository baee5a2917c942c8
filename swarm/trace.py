"""A timeline of where a swarm's time goes: spans of each process's work, written as a Chrome trace.

Off unless the environment names a directory (`SWARM_TRACE_DIR`), which every process a run starts inherits (the
experiments' peers, the trainer). Each process then keeps its spans in memory (at most `MAX_EVENTS`; later ones are
dropped and counted) and writes them at exit as `DIR/trace-<pid>.json` in the Chrome trace event format
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), which Perfetto
(https://ui.perfetto.dev) and chrome://tracing open. `python -m swarm.trace DIR` merges a run's files into one
(`DIR/trace.json`) and prints each span name's time a step, per process.

Times are the system's monotonic clock (`time.monotonic_ns`), the same in every process of one machine (network
namespaces included), so one machine's processes line up on one timeline; a trace across machines would need their
clocks' offsets, which this does not measure. A span costs about 4 us when on and 0.3 us when off (measured here):
the hot paths (each micro-batch's compute, codec and calls, a few dozen spans a step) call it unconditionally.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "ENV", "MAX_EVENTS", "Tracer", "active", "flush", "mark", "merge", "pipeline_figures", "since", "span", "start",
    "summary",
]  # fmt: skip

ENV = "SWARM_TRACE_DIR"
"""The environment variable naming the directory traces are written to; unset: no tracing."""
MAX_EVENTS = 200_000
"""Spans one process keeps; later ones are dropped (and counted in the file's metadata). A span takes about 570 bytes
in memory (measured), so at most about 110 MB; a peer of a 2-stage pipeline of 4 micro-batches records about 55
spans a step (counted in a traced run), so a trace holds its first 3,500 or so steps: enough for a diagnosis, not a
record of a long run."""


class Tracer:
    """One process's spans, written to `directory` at `write` (and at exit).

    Args:
        directory: where `trace-<pid>.json` goes.
        name: the process's name on the timeline ("trainer", "peer 12D3...").
    """

    def __init__(self, directory: str | os.PathLike, name: str):
        self.directory, self.name, self.pid = Path(directory), name, os.getpid()
        self.events: list[dict] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self._threads: dict[int, str] = {}

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
        """One complete span from `start_ns` to `end_ns` (`time.monotonic_ns`) on the calling thread."""
        thread = threading.current_thread()
        event = {"name": name, "cat": cat, "ph": "X", "pid": self.pid, "tid": thread.ident or 0,
                 "ts": start_ns / 1000.0, "dur": max(0, end_ns - start_ns) / 1000.0}  # fmt: skip
        if args:
            event["args"] = args
        with self._lock:
            if len(self.events) >= MAX_EVENTS:
                self.dropped += 1
                return
            self.events.append(event)
            self._threads.setdefault(thread.ident or 0, thread.name)

    def write(self) -> Path:
        """Writes the spans so far (with the process's and its threads' names) as `trace-<pid>.json`."""
        with self._lock:
            events = list(self.events)
            threads = dict(self._threads)
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": self.name}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": t, "args": {"name": n}}
                 for t, n in threads.items()]  # fmt: skip
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace-{self.pid}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + events, "otherData": {"dropped": self.dropped}}))
        os.replace(tmp, path)
        return path


_tracer: Tracer | None = None


def start(name: str) -> Tracer | None:
    """Traces this process as `name` if `SWARM_TRACE_DIR` is set (written at exit); None otherwise. A second call
    renames the process and keeps its spans; one after the variable names another directory (an experiment's next
    cell, whose trainer runs in this process) writes the spans so far to the old one and starts anew."""
    global _tracer
    directory = os.environ.get(ENV)
    if not directory:
        return None
    if _tracer is not None and _tracer.directory != Path(directory):
        _tracer.write()
        atexit.unregister(_tracer.write)
        _tracer = None
    if _tracer is None:
        _tracer = Tracer(directory, name)
        atexit.register(_tracer.write)
        if _gc_span not in gc.callbacks:
            gc.callbacks.append(_gc_span)
    _tracer.name = name
    return _tracer


_gc_start: list[int] = []


def _gc_span(phase: str, info: dict) -> None:
    """The garbage collector's pauses, as spans `gc N` (N: the generation collected)."""
    if phase == "start":
        _gc_start[:] = [time.monotonic_ns()]
    elif _gc_start and _tracer is not None:
        _tracer.add(f"gc {info.get('generation')}", "gc", _gc_start[0], time.monotonic_ns(), None)


def flush() -> Path | None:
    """Writes this process's spans so far (they are written at exit too); None when tracing is off."""
    return None if _tracer is None else _tracer.write()


def active() -> Tracer | None:
    """This process's tracer, None when off."""
    return _tracer


@contextlib.contextmanager
def _span(tracer: Tracer, name: str, cat: str, args: dict) -> Iterator[None]:
    start_ns, cpu_ns = time.monotonic_ns(), time.thread_time_ns()
    try:
        yield
    finally:
        args["cpu_ms"] = round((time.thread_time_ns() - cpu_ns) / 1e6, 3)  # the thread's own CPU in the span
        tracer.add(name, cat, start_ns, time.monotonic_ns(), args)


def span(name: str, cat: str = "swarm", **args):
    """A context manager timing its body as span `name` (`args` shown with it); nothing when tracing is off."""
    tracer = _tracer
    if tracer is None:
        return contextlib.nullcontext()
    return _span(tracer, name, cat, args)


def mark(name: str, cat: str = "swarm", **args) -> None:
    """A span of no length at now (an event: a stream's first item taken); nothing when tracing is off."""
    tracer = _tracer
    if tracer is not None:
        now = time.monotonic_ns()
        tracer.add(name, cat, now, now, args)


def since(name: str, start_ns: int, cat: str = "swarm", **args) -> None:
    """A span from `start_ns` (`time.monotonic_ns`) to now; nothing when tracing is off."""
    tracer = _tracer
    if tracer is not None:
        tracer.add(name, cat, start_ns, time.monotonic_ns(), args)


def merge(directory: str | os.PathLike) -> tuple[Path, list[dict]]:
    """Merges every `trace-*.json` of `directory` into `directory/trace.json`; that path and the events."""
    directory = Path(directory)
    events: list[dict] = []
    for path in sorted(directory.glob("trace-*.json")):
        try:
            events += json.loads(path.read_text())["traceEvents"]
        except (OSError, ValueError, KeyError) as e:
            print(f"skipped {path}: {e}", file=sys.stderr)
    out = directory / "trace.json"
    out.write_text(json.dumps({"traceEvents": events}))
    return out, events


def summary(events: list[dict]) -> list[tuple[str, str, int, float]]:
    """(process, span name, count, total ms) for every span name of every process, largest first."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X":
            t = totals[(names.get(e["pid"], str(e["pid"])), e["name"])]
            t[0] += 1
            t[1] += e["dur"] / 1000.0
    rows = [(p, n, int(c), ms) for (p, n), (c, ms) in totals.items()]
    return sorted(rows, key=lambda r: (r[0], -r[3]))


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def pipeline_figures(events: list[dict], from_step: int = 10) -> dict:
    """Where a traced pipeline's steps from `from_step` on spent their time (milliseconds, medians):

    - `stages`: each stage's forward and backward of one micro-batch, wall and its thread's CPU, and its compute
      wall a step;
    - `hops`: the time from a stage's compute of a micro-batch to its neighbour's compute of it (the forward's
      activation, the backward's gradient), where the neighbour waited for it (`waited`), broken down where its
      spans are found on the sending and the serving thread (`segments`: encode; the call's start to its handler's;
      the handler's read; the decode; the gate); and, where the input was there first, the time from the stage's
      previous compute to this one (`handoff`: the schedule gate's hand-off);
    - `pipeline`: the trainer's pipeline phase a step.
    """
    spans = [e for e in events if e.get("ph") == "X"]
    computes = [
        e for e in spans if e["name"] in ("forward", "backward") and e.get("args", {}).get("step", -1) >= from_step
    ]
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in spans:
        by_thread[(e["pid"], e["tid"])].append(e)
    for line in by_thread.values():
        line.sort(key=lambda e: e["ts"])
    position = {id(e): i for line in by_thread.values() for i, e in enumerate(line)}
    at = {(e["args"]["stage"], e["name"], e["args"]["step"], e["args"]["mb"]): e for e in computes}
    stages = sorted({e["args"]["stage"] for e in computes})
    order = {s: sorted((e for e in computes if e["args"]["stage"] == s), key=lambda e: e["ts"]) for s in stages}
    end = lambda e: e["ts"] + e["dur"]  # noqa: E731

    def near(e: dict, name: str, after: bool) -> dict | None:
        """The span `name` on `e`'s thread just after (or before) it, within a few spans."""
        line, i = by_thread[(e["pid"], e["tid"])], position[id(e)]
        around = line[i + 1 : i + 6] if after else reversed(line[max(0, i - 8) : i])
        return next((x for x in around if x["name"] == name), None)

    waited, handoff = defaultdict(list), defaultdict(list)
    segments: dict[str, list[float]] = defaultdict(list)
    for s in stages:
        for prev, e in zip([None, *order[s]], order[s], strict=False):
            kind, step, mb = e["name"], e["args"]["step"], e["args"]["mb"]
            source = at.get((s - 1, kind, step, mb) if kind == "forward" else (s + 1, kind, step, mb))
            if source is None:
                continue
            free = end(prev) if prev is not None and prev["args"]["step"] == step else None
            if free is not None and free > end(source):
                handoff[kind].append((e["ts"] - free) / 1000)
                continue
            waited[kind].append((e["ts"] - end(source)) / 1000)
            method = "Forward" if kind == "forward" else "Backward"
            encode, call = near(source, "encode", True), near(source, f"call {method}", True)
            serve, read, decode = (near(e, n, False) for n in (f"serve {method}", f"read {method}", "decode"))
            if all((encode, call, serve, read, decode)):
                for name, a, b in (
                    ("encode", end(source), end(encode)),
                    ("call to handler", call["ts"], serve["ts"]),
                    ("handler's read", serve["ts"], end(read)),
                    ("decode", end(read), end(decode)),
                    ("gate", end(decode), e["ts"]),
                ):
                    segments[name].append((b - a) / 1000)
    steps = {e["args"]["step"] for e in computes}
    pipeline = [e["dur"] / 1000 for e in spans if e["name"] == "pipeline" and e.get("cat") == "trainer"]
    return {
        "stages": {
            s: {
                f"{kind} {clock}": _median(
                    [
                        (e["dur"] / 1000 if clock == "wall" else e["args"].get("cpu_ms", 0.0))
                        for e in order[s]
                        if e["name"] == kind
                    ]
                )  # fmt: skip
                for kind in ("forward", "backward")
                for clock in ("wall", "cpu")
            }
            | {"compute a step": round(sum(e["dur"] for e in order[s]) / 1000 / max(1, len(steps)), 3)}
            for s in stages
        },
        "hops": {
            "waited": {k: _median(v) for k, v in waited.items()},
            "segments": {k: _median(v) for k, v in segments.items()},
            "handoff": {k: _median(v) for k, v in handoff.items()},
            "counts": {"waited": sum(map(len, waited.values())), "handoff": sum(map(len, handoff.values()))},
        },
        "pipeline": _median(pipeline[from_step:]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarm.trace", description="merge a run's trace files and print where each process's time went"
    )
    parser.add_argument("directory", help=f"the {ENV} a run wrote its trace-<pid>.json files to")
    parser.add_argument("--steps", type=int, default=None, help="divide the totals by this many steps")
    parser.add_argument(
        "--pipeline", type=int, default=None, metavar="FROM_STEP",
        help="also print the pipeline's figures (compute, hops between stages, gate hand-offs; medians, ms) over "
        "the steps from FROM_STEP on, as JSON",
    )  # fmt: skip
    args = parser.parse_args(argv)
    out, events = merge(args.directory)
    if not any(e.get("ph") == "X" for e in events):
        print(f"no spans in {args.directory}", file=sys.stderr)
        return 1
    per = args.steps or 1
    unit = "ms a step" if args.steps else "ms"
    print(f"{'process':<24} {'span':<28} {'count':>8} {unit:>12}")
    for process, name, count, ms in summary(events):
        print(f"{process[:24]:<24} {name[:28]:<28} {count:>8} {ms / per:>12.2f}")
    if args.pipeline is not None:
        print(json.dumps(pipeline_figures(events, args.pipeline), indent=1))
    print(f"merged: {out} (open in https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
