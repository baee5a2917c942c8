"""Application-level link shaping: a token bucket in bytes per second plus a one-way delay, per link.

This is what the default demo and the throttled experiment use: it needs no privileges and works in any
process. The bucket is a virtual clock (each send reserves its transmit time after the previous one), so
the long-run rate is exact and a burst of at most `LinkShape.burst` passes at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


def parse_rate_mbit(text: str) -> float | None:
    """A rate in Mbit/s as flags and link specs write it: `none`, `0` or `inf` for an unshaped link."""
    return None if text.strip().lower() in ("none", "0", "inf") else float(text)


MIN_BURST_BYTES = 10 * 1514
"""The smallest bucket: ten Ethernet frames."""
BURST_S = 0.004
"""The bucket holds this long at the rate where that is more than `MIN_BURST_BYTES`."""


def default_burst_bytes(rate_bytes_per_s: float) -> int:
    """A link's token bucket, in both testbeds (this shaper and the namespaces' tbf): 4 ms at the rate (a timer
    tick or two, so that high rates are reachable; at high rates those ms of credit let the sender's own work on
    one chunk overlap the link's transmission of the previous one, as on a real NIC), at least ten frames. Until
    s54 this shaper's floor was 64 KiB: at 1 Mbit/s half a second of the link, so a link idle for that long let a
    whole compressed step through at once, which no real link does (the throttled experiment's 1 Mbit/s steps
    after an idle link ran at 0.4x the steady step)."""
    return max(MIN_BURST_BYTES, int(rate_bytes_per_s * BURST_S))


@dataclass(frozen=True)
class LinkShape:
    """How one outgoing link is shaped."""

    rate_bytes_per_s: float | None = None
    """bandwidth of the link; None leaves it unshaped"""
    delay_s: float = 0.0
    """one-way delay added to every message"""
    burst_bytes: int | None = None
    """bytes that may pass at once before the rate applies (None: see `burst`)"""

    def __post_init__(self) -> None:
        if self.rate_bytes_per_s is not None and self.rate_bytes_per_s <= 0:
            raise ValueError(f"rate_bytes_per_s must be positive, got {self.rate_bytes_per_s}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")

    @property
    def burst(self) -> int:
        """The bucket: `burst_bytes`, else `default_burst_bytes` at the rate (the kernel testbed's tbf rule)."""
        if self.burst_bytes is not None:
            return self.burst_bytes
        return default_burst_bytes(self.rate_bytes_per_s or 0.0)

    @classmethod
    def from_mbit(cls, rate_mbit: float | None, delay_ms: float = 0.0) -> LinkShape:
        return cls(None if rate_mbit is None else rate_mbit * 1e6 / 8, delay_ms / 1000)

    @classmethod
    def parse(cls, text: str) -> LinkShape:
        """`RATE_MBIT[:DELAY_MS]`, with `none` or `0` for an unshaped rate, e.g. `100`, `10:25`, `none:40`."""
        rate, _, delay = text.partition(":")
        rate_mbit = None if not rate.strip() else parse_rate_mbit(rate)
        return cls.from_mbit(rate_mbit, float(delay) if delay else 0.0)

    def describe(self) -> str:
        rate = "unshaped" if self.rate_bytes_per_s is None else f"{self.rate_bytes_per_s * 8 / 1e6:g} Mbit/s"
        return rate + (f" + {self.delay_s * 1000:g} ms" if self.delay_s else "")


class Shaper:
    """Paces the bytes of one link; thread-safe, shared by every stream on that link."""

    def __init__(self, shape: LinkShape, clock=time.monotonic, sleep=time.sleep):
        self.shape = shape
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._next_free = 0.0
        self.bytes_sent = 0
        self.measured_bytes_per_s: float | None = None
        """The link's goodput as this peer last measured it (`swarm.daemon.probe.LinkProber`), None until then."""

    def known_rate(self) -> float | None:
        """What this link carries, bytes/s, as far as this peer knows: the slower of its shape's rate and its last
        measured goodput (None: neither). The kernel or the ISP shapes a real link, not this class, so without
        the measurement a slow link would look unshaped to whoever decides whether compressing pays on it."""
        known = [r for r in (self.shape.rate_bytes_per_s, self.measured_bytes_per_s) if r is not None]
        return min(known) if known else None

    def delay(self) -> None:
        """The link's one-way delay, once per message."""
        if self.shape.delay_s:
            self._sleep(self.shape.delay_s)

    def consume(self, nbytes: int) -> None:
        """Blocks until `nbytes` may leave at the link's rate."""
        self.bytes_sent += nbytes
        rate = self.shape.rate_bytes_per_s
        if rate is None:
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / rate
            wait = self._next_free - self.shape.burst / rate - now
        if wait > 0:
            self._sleep(wait)


STATE_MIN_BYTES_PER_S = 16 * 1024
"""The slowest a paced state stream goes (a GetState's `max_bytes_per_s` below it is raised to it): a copy asked
for at a crawl would hold the holder's transfer slot for hours."""


def paced(items, bytes_per_s: float, size=lambda item: item.ByteSize(), clock=time.monotonic, sleep=time.sleep):
    """`items`, each let out once the ones before it left at `bytes_per_s` (at least `STATE_MIN_BYTES_PER_S`):
    a bucket of one item's size, so the stream never bursts more than an item ahead of the rate. Closing it (a
    cancelled call) closes `items` too, so whatever they hold (a server's slots) is let go at once."""
    bucket = None
    try:
        for item in items:
            n = size(item)
            if bucket is None:
                rate = max(float(bytes_per_s), STATE_MIN_BYTES_PER_S)
                bucket = Shaper(LinkShape(rate, burst_bytes=max(n, 1)), clock=clock, sleep=sleep)
            bucket.consume(n)
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


PACED_CHUNK_S = 0.02
"""Seconds of a paced stream's rate in one chunk. Each chunk leaves at the link's own rate and every message behind it
in the link's queue waits for it: a background copy paced at a quarter of a link, in chunks of a quarter second of its
pace, held each of the run's messages up to 62 ms of that link, and a 10 Mbit/s namespace run's steps were 58% slower
while it ran (docs/reports/throttled.md); at 20 ms of the pace a chunk holds a quarter-shared link 5 ms."""
PACED_CHUNK_MIN_BYTES = 1024


def paced_chunk_bytes(bytes_per_s: float, largest: int) -> int:
    """Chunk size for a stream paced at `bytes_per_s`: `PACED_CHUNK_S` of it (1 KiB to `largest`), so that each
    chunk handed to the connection holds the link's queue only briefly for the run's own messages."""
    pace = max(float(bytes_per_s), STATE_MIN_BYTES_PER_S)
    return int(min(largest, max(PACED_CHUNK_MIN_BYTES, pace * PACED_CHUNK_S)))


class LinkShaping:
    """Shapes per destination: a default shape and per-address overrides, one Shaper per destination."""

    def __init__(self, default: LinkShape | None = None, per_link: dict[str, LinkShape] | None = None):
        self.default = default or LinkShape()
        self.per_link = dict(per_link or {})
        self._shapers: dict[str, Shaper] = {}
        self._lock = threading.Lock()

    def for_destination(self, address: str) -> Shaper:
        with self._lock:
            if address not in self._shapers:
                self._shapers[address] = Shaper(self.per_link.get(address, self.default))
            return self._shapers[address]
