"""What handing a step's calls to threads costs the thread that hands them out: nine `Thread.start`s (a thread per
call, as the trainer's `spawn` did before s65) against nine hand-offs to idle threads (`CallThreads`), in an
otherwise idle process and beside one thread that runs Python without a pause (as the trainer's DHT thread or a call
thread's own Python may).

    python scripts/measure_thread_start.py [--rounds 100] [--json]

`Thread.start` returns only once the new thread runs, which beside a busy thread takes a switch interval or two
(CPython's 5 ms); a hand-off only sets an event.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from swarm.runtime.routing import CallThreads

CALLS = 9
"""a step's calls at its start: four Forwards, four Backward starts and the labels (2 stages, 4 micro-batches)"""


def _noop() -> None:
    pass


def measure(rounds: int, busy: bool) -> dict[str, float]:
    stop = threading.Event()
    if busy:

        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        threading.Thread(target=spin, daemon=True).start()
    try:
        started, handed = [], []
        pool = CallThreads()
        for _ in range(rounds):
            a = time.perf_counter()
            for _ in range(CALLS):
                threading.Thread(target=_noop, daemon=True).start()
            started.append(time.perf_counter() - a)
            done = []
            a = time.perf_counter()
            for _ in range(CALLS):
                done.append(pool.spawn(_noop, "measure"))
            handed.append(time.perf_counter() - a)
            for f in done:
                f.result(timeout=30)  # every thread idle again before the next round
        return {"thread_start_ms": 1e3 * statistics.median(started), "hand_off_ms": 1e3 * statistics.median(handed)}
    finally:
        stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help=f"rounds of {CALLS} calls")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    rows = {kind: measure(args.rounds, kind == "busy") for kind in ("idle", "busy")}
    if args.json:
        print(json.dumps(rows))
        return 0
    for kind, row in rows.items():
        starts, hands = row["thread_start_ms"], row["hand_off_ms"]
        print(f"{kind:5s}: {CALLS} Thread.start {starts:8.3f} ms, {CALLS} hand-offs to idle threads {hands:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
