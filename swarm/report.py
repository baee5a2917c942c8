"""How benchmarks and experiments report: timing, a table or JSON on stdout, and a free port for what they start."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None) -> None:
    """Prints rows as an aligned text table of the given columns."""
    if title:
        print(title)
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def emit(rows: Sequence[dict], columns: Sequence[str], as_json: bool, title: str | None = None) -> None:
    if as_json:
        print(json.dumps(list(rows), indent=1))
    else:
        print_table(rows, columns, title)


_HANDED_OUT: set[int] = set()


def _ephemeral_low(default: int = 32768) -> int:
    """The lowest port the kernel hands out for port 0 and outgoing connections (Linux; else `default`)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the caller binds it soon after), picked below the
    kernel's ephemeral range where it can: a port from that range (what binding port 0 gives) can be taken by any
    outgoing connection or port-0 listener before the caller binds it, and was (`swarm experiment nat`: a peer
    failed to bind its --grpc-port between the pick and its start, and the run waited 120 s for a pipeline).
    Never the same port twice in one process."""
    import random
    import socket

    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 10000), low) if low > 2048 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1")
