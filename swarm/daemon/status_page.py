"""The live status page: `swarm status --serve PORT` (and the trainer's --metrics-port) serves one self-contained
HTML page and the JSON it polls (/api/status), read-only and bounded, on the metrics server's one event loop.

The page's port may face the internet, so: every request is answered from a body cached by a background poller
(no request makes a DHT query or a probe), each client is held to a request rate (429 past it), the metrics
server bounds connections, request size and deadlines (`MetricsServerLimits`), nothing secret is in the view
(records, probes and step curves only: no key, no token, no path but the steps directory's name), and the page
puts every peer-supplied string into the document as text (`textContent`), under a Content-Security-Policy that
runs only its own inline script (by hash) and fetches only from its own origin.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from swarm.daemon.status_view import (
    PlanHistory,
    StepCurves,
    address_endpoint,
    maddr_endpoint,
    probe_tcp,
    status_snapshot,
)
from swarm.metrics import HttpReply, Route

__all__ = ["DhtReader", "PageLimits", "StatusPage", "StatusPoller", "page_html", "status_json", "status_routes"]

log = logging.getLogger(__name__)

MAX_PROBED = 32
"""Bootstrap addresses, and relays, probed per read at most (an address file may list many); peers asked for
their metrics per read: 4x this."""

PAGE_FILE = Path(__file__).with_name("status_page.html")
"""The page: one file, its CSS and JS inline, nothing fetched from elsewhere."""


@dataclass(frozen=True)
class PageLimits:
    """How much of the page one client may ask for: each answer is cached bytes, so this bounds the bytes sent."""

    requests_per_s: float = 5.0
    """requests a second one client host may make, on average (the page polls every 2 s)"""
    burst: int = 20
    """requests one client host may make at once, above the rate"""
    max_clients: int = 1024
    """client hosts whose rate is tracked; past it the one seen least recently is forgotten"""

    def __post_init__(self) -> None:
        if not self.requests_per_s > 0 or self.burst < 1 or self.max_clients < 1:
            raise ValueError(f"PageLimits: expected a rate > 0, a burst >= 1 and max_clients >= 1, got {self}")


class ClientRate:
    """A token bucket per client host, for at most `max_clients` hosts (least recently seen forgotten first).
    Called on the server's event loop only: no lock."""

    def __init__(self, limits: PageLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # host -> (tokens, when)

    def allow(self, host: str) -> bool:
        now = self.clock()
        tokens, when = self._buckets.pop(host, (float(self.limits.burst), now))
        tokens = min(float(self.limits.burst), tokens + (now - when) * self.limits.requests_per_s)
        allowed = tokens >= 1.0
        self._buckets[host] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.limits.max_clients:
            self._buckets.popitem(last=False)
        return allowed


def status_json(snapshot: dict[str, Any]) -> bytes:
    """The snapshot as JSON that is safe in any context: `<`, `>` and `&` escaped as \\u003c..., no NaN."""
    text = json.dumps(snapshot, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


@cache
def page_html() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy (the hashes of its one inline script and style)."""
    text = PAGE_FILE.read_text()
    hashes = {}
    for tag in ("script", "style"):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
        if len(blocks) != 1:
            raise RuntimeError(f"{PAGE_FILE} must hold exactly one inline <{tag}>, found {len(blocks)}")
        hashes[tag] = "'sha256-" + base64.b64encode(hashlib.sha256(blocks[0].encode()).digest()).decode() + "'"
    csp = (
        f"default-src 'none'; script-src {hashes['script']}; style-src {hashes['style']}; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return text.encode(), csp


_COMMON_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
)


class StatusPoller:
    """Reads the status every `refresh_s` on its own thread and keeps the last answer as JSON bytes: requests
    read the cache, so a flood of them costs no DHT query. A failed read keeps the previous view, with the error.

    Args:
        read: makes one snapshot (`status_snapshot`'s dict); may raise.
        refresh_s: seconds between reads (the first is at once).
        idle_s: None: read all the time; else read only while the page was asked for (`touch`) within the last
            `idle_s` seconds (the trainer's port: no DHT reads while nobody looks).
    """

    def __init__(self, read: Callable[[], dict[str, Any]], refresh_s: float = 5.0, idle_s: float | None = None):
        self.read, self.refresh_s, self.idle_s = read, refresh_s, idle_s
        self._body = status_json({"format": "swarm-status/1", "error": "not read yet", "loading": True})
        self._last: dict[str, Any] | None = None
        self.reads = 0
        """reads finished (ok or not)"""
        self.ready = threading.Event()
        """set when the first read finished"""
        self._stop = threading.Event()
        self._wanted = threading.Event()
        self._touched = -math.inf
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)
        self._thread.start()

    @property
    def body(self) -> bytes:
        return self._body

    def touch(self) -> None:
        """The page was asked for: a lazy poller reads (again) for the next `idle_s`."""
        self._touched = time.monotonic()
        if not self._wanted.is_set():
            self._wanted.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.idle_s is not None and time.monotonic() - self._touched > self.idle_s:
                self._wanted.clear()
                if time.monotonic() - self._touched > self.idle_s:  # not touched between the check and the clear
                    self._wanted.wait()
                continue
            self.refresh()
            self._stop.wait(self.refresh_s)

    def refresh(self) -> None:
        try:
            snap = self.read()
            body = status_json(snap)
            self._last = snap
        except Exception as e:  # the page shows the error over the last view; the poller goes on
            log.warning("status read failed: %s", e)
            snap = dict(self._last or {"format": "swarm-status/1"}, error=f"{type(e).__name__}: {e}"[:500])
            body = status_json(snap)
        self._body = body
        self.reads += 1
        self.ready.set()

    def close(self) -> None:
        self._stop.set()
        self._wanted.set()
        self._thread.join(30)


def status_routes(poller: StatusPoller, limits: PageLimits | None = None) -> dict[str, Route]:
    """The page's routes for `swarm.metrics.serve_metrics`: `/` (and `/status`) the page, `/api/status` the JSON,
    each client held to `limits`."""
    rate = ClientRate(limits or PageLimits())
    html, csp = page_html()
    too_many = HttpReply(
        "429 Too Many Requests", b"too many requests: slow down\n", "text/plain", (("Retry-After", "1"),)
    )

    def page(client: str) -> HttpReply:
        if not rate.allow(client):
            return too_many
        headers = (*_COMMON_HEADERS, ("Content-Security-Policy", csp))
        return HttpReply("200 OK", html, "text/html; charset=utf-8", headers)

    def api(client: str) -> HttpReply:
        if not rate.allow(client):
            return too_many
        poller.touch()
        return HttpReply("200 OK", poller.body, "application/json", _COMMON_HEADERS)

    return {"/": page, "/status": page, "/api/status": api}


class DhtReader:
    """Makes one snapshot per call from a joined `SwarmDHT`: its records, each serving peer's metrics
    (`metrics_of`), TCP probes of the `bootstrap` multiaddrs and of every relay named in an announcement, the plans
    seen across calls, and the trainer's steps under `steps` (its --out directory). Probes run in parallel, each
    bounded by `probe_timeout_s`; `close()` ends the probes' threads.

    Args:
        dht: a joined `swarm.peers.dht.SwarmDHT` (its calls are thread-safe: the trainer shares its own).
        run_name: the run's name, shown as the page's title.
        bootstrap: the multiaddrs joined through, probed each read.
        steps: the trainer's --out directory or steps file; None: no curves.
        metrics_of: each serving peer's metrics snapshot by peer id (`swarm.daemon.status.peer_metrics`); None:
            none asked.
    """

    def __init__(
        self,
        dht,
        run_name: str,
        bootstrap: Sequence[str] = (),
        steps: str | None = None,
        metrics_of: Callable[[list], dict[str, dict[str, float]]] | None = None,
        probe_timeout_s: float = 2.0,
    ):
        self.dht, self.run_name, self.bootstrap = dht, run_name, tuple(bootstrap)[:MAX_PROBED]
        self.metrics_of, self.probe_timeout_s = metrics_of, probe_timeout_s
        self.history = PlanHistory()
        self.curves = StepCurves(steps) if steps else None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="status-probe")

    def __call__(self) -> dict[str, Any]:
        from hivemind.utils import get_dht_time

        probe = lambda target, endpoint: self._pool.submit(probe_tcp, target, endpoint, self.probe_timeout_s)
        boot = [probe(m, maddr_endpoint(m)) for m in self.bootstrap]
        peers, links, plan, trainers = self.dht.peers(), self.dht.links(), self.dht.get_plan(), self.dht.trainers()
        by_id = {p.peer_id: p for p in peers}
        relay_ids = sorted({p.relay for p in peers if p.relay is not None and p.relay in by_id})[:MAX_PROBED]
        relays = {r: probe(by_id[r].address, address_endpoint(by_id[r].address)) for r in relay_ids}
        metrics: dict[str, dict[str, float]] = {}
        if self.metrics_of is not None:  # each peer's Status, 8 peers a call, the calls in parallel
            serving = [p for p in peers if p.stage is not None][: MAX_PROBED * 4]
            for part in [self._pool.submit(self.metrics_of, serving[i : i + 8]) for i in range(0, len(serving), 8)]:
                metrics.update(part.result())
        now = get_dht_time()
        self.history.see(plan, now)
        if self.curves is not None:
            self.curves.refresh()
        return status_snapshot(
            self.run_name,
            now,
            peers,
            links,
            plan,
            trainers,
            metrics,
            bootstrap=[f.result() for f in boot],
            relay_probes={r: f.result() for r, f in relays.items()},
            plan_history=self.history.to_json(),
            steps=self.curves.to_json() if self.curves is not None else None,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class StatusPage:
    """The page of one process: a `DhtReader`, its poller and the routes to serve (`serve_metrics(routes=...)`);
    `close()` stops the poller and the probes.

    Args:
        reader: makes the snapshots.
        refresh_s: seconds between reads.
        idle_s: read only while the page was asked for within this many seconds (None: always).
        limits: each client's request rate.
    """

    def __init__(
        self, reader: DhtReader, refresh_s: float = 5.0, idle_s: float | None = None, limits: PageLimits | None = None
    ):
        self.reader = reader
        self.poller = StatusPoller(reader, refresh_s, idle_s)
        self.routes = status_routes(self.poller, limits)

    def close(self) -> None:
        self.poller.close()
        self.reader.close()
