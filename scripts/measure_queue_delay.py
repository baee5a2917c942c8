"""How long a small message waits behind a saturating flow on a testbed link (root: network namespaces).

Two namespaces joined like a testbed link (`swarm.testbed.netns.shaped_pair`: tbf on a's egress, the testbed's burst
and queue), an idle round of 100-byte pings a -> b -> a every 0.5 s, then the same while a bulk TCP flow a -> b fills
the link: what a DHT RPC, a heartbeat or a lease renewal out of a peer whose link the step saturates waits for.
Prints one line per rate (`--json`: a row per rate).

Usage: python scripts/measure_queue_delay.py [--rates 0.5,1,10] [--seconds 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

A_IP, B_IP, SINK, ECHO = "10.77.254.1", "10.77.254.2", 5001, 5002


def _role(argv: list[str]) -> None:
    """The namespaces' side: sink, echo, send SECONDS, ping SECONDS (prints the round trips as JSON)."""
    mode = argv[0]
    if mode in ("sink", "echo"):
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((B_IP, SINK if mode == "sink" else ECHO))
        server.listen(1)
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(1 << 16):
            if mode == "echo":
                conn.sendall(data)
        return
    end = time.monotonic() + float(argv[1])
    conn = socket.create_connection((B_IP, SINK if mode == "send" else ECHO), timeout=30)
    if mode == "send":
        chunk = b"x" * (1 << 16)
        while time.monotonic() < end:
            conn.sendall(chunk)
        return
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    while time.monotonic() < end:
        start, got = time.monotonic(), 0
        conn.sendall(b"p" * 100)
        while got < 100:
            got += len(conn.recv(100))
        rtts.append(time.monotonic() - start)
        time.sleep(0.5)
    print(json.dumps(rtts))


def _in(ns: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, __file__, "--role", *args], **kw)


def _pings(a: str, b: str, seconds: float) -> list[float]:
    echo = _in(b, "echo")
    time.sleep(0.5)
    try:
        out = _in(a, "ping", str(seconds), stdout=subprocess.PIPE, text=True).communicate(timeout=seconds + 60)[0]
    finally:
        echo.kill()
        echo.wait(5)
    return json.loads(out)


def measure(rate_mbit: float, seconds: float) -> dict:
    from swarm.testbed.netns import shaped_pair

    with shaped_pair(rate_mbit, prefix="sqd-") as (a, b):
        idle = _pings(a, b, 5.0)
        sink = _in(b, "sink")
        time.sleep(0.5)
        flow = _in(a, "send", str(seconds + 10))
        time.sleep(3.0)  # the queue fills
        try:
            busy = _pings(a, b, seconds)
        finally:
            for p in (flow, sink):
                p.kill()
                p.wait(5)
    q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))] if xs else None  # noqa: E731
    return {
        "rate_mbit": rate_mbit, "idle_median_s": statistics.median(idle) if idle else None, "pings": len(busy),
        "busy_median_s": statistics.median(busy) if busy else None, "busy_p90_s": q(busy, 0.9),
        "busy_max_s": max(busy) if busy else None,
    }  # fmt: skip


def main() -> int:
    if sys.argv[1:2] == ["--role"]:
        _role(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,10", help="comma-separated link rates, Mbit/s")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds of pings under the flow")
    parser.add_argument("--json", action="store_true", help="one JSON row per rate")
    args = parser.parse_args()
    for rate in (float(r) for r in args.rates.split(",")):
        row = measure(rate, args.seconds)
        if args.json:
            print(json.dumps(row))
        else:
            busy = f"median {row['busy_median_s']:.3f} s, p90 {row['busy_p90_s']:.3f} s, max {row['busy_max_s']:.3f} s"
            idle = f"idle {row['idle_median_s'] * 1e3:.2f} ms"
            print(f"{rate:g} Mbit/s: {idle}; with a bulk flow, {row['pings']} pings: {busy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
