"""Every metric of a swarm process, defined once in one table, on a per-process Prometheus registry.

A new metric is one row in `METRICS` plus its use: `Metrics` makes an attribute of each row. Each `Metrics`
has its own `CollectorRegistry` (never the client's global default), so several stage hosts in one process,
as the tests run them, count apart. `snapshot()` flattens every sample into a dict for per-step figures
(`delta`, `total`); `serve_metrics` serves the Prometheus text at `GET /metrics`, on one thread and within
stated bounds (`MetricsServerLimits`).
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = [
    "METRICS", "STATE_SENT_LOG", "HttpReply", "MetricSpec", "Metrics", "MetricsServer", "MetricsServerLimits", "Route",
    "delta", "logged_state_bytes", "sample_key", "serve_metrics", "total",
]  # fmt: skip

PHASE_BUCKETS_S = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
"""Bucket bounds of one phase of one micro-batch, seconds: encodes take well under a millisecond."""
STEP_BUCKETS_S = (0.03, 0.1, 0.3, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Bucket bounds of one optimizer step, seconds: from an unshaped tiny model to a slow shaped link."""


@dataclass(frozen=True)
class MetricSpec:
    """One metric: the attribute of `Metrics` it becomes, and its Prometheus name, type, help and labels."""

    attr: str
    """Attribute name on `Metrics`."""
    kind: type
    """prometheus_client's Counter, Gauge or Histogram."""
    name: str
    """Exposed name; counters end in `_total` (the sample's name; the client strips it for the family)."""
    help: str
    """One line of HELP text, with the unit."""
    labels: tuple[str, ...] = ()
    """Label names, in the order `.labels(...)` takes them positionally."""
    buckets: tuple[float, ...] | None = None
    """Histogram bucket upper bounds (histograms only)."""

    def __post_init__(self) -> None:
        if self.kind not in (Counter, Gauge, Histogram):
            raise ValueError(f"MetricSpec {self.name}: kind must be Counter, Gauge or Histogram")
        if (self.kind is Counter) != self.name.endswith("_total"):
            raise ValueError(f"MetricSpec {self.name}: counters, and only counters, end in _total")
        if (self.kind is Histogram) != (self.buckets is not None):
            raise ValueError(f"MetricSpec {self.name}: histograms, and only histograms, have buckets")


RELAYED_BYTES = "swarm_relayed_bytes_total"
"""The relays' byte counter's name (read back by `swarm.daemon.nat` and `swarm experiment nat`)."""

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "wire_bytes", Counter, "swarm_wire_bytes_total",
        "Bytes this process put on the wire, per pipeline link (k joins stage k and k+1) and direction",
        ("link", "direction"),
    ),
    MetricSpec(
        "fp32_bytes", Counter, "swarm_fp32_bytes_total",
        "Bytes the same tensors would have cost in fp32, per link and direction", ("link", "direction"),
    ),
    MetricSpec("sync_bytes", Counter, "swarm_sync_bytes_total", "Bytes of the tied-embedding gradient sync"),
    MetricSpec(
        "state_bytes", Counter, "swarm_state_bytes_total",
        "Bytes of stage state this peer sent over GetState: held copies, takeovers' and joiners' state, exports",
    ),
    MetricSpec(
        "control_bytes", Counter, "swarm_control_bytes_total",
        "Bytes of the trainer's other calls: token and label batches, Reduce/Grads/Step, pings (serialized)",
    ),
    MetricSpec(
        "control_call_bytes", Counter, "swarm_control_call_bytes_total",
        "The trainer's control bytes by call method (Audit, Recompute, Status, Ping, Step, ...): request and reply "
        "serialized, every attempt's", ("method",),
    ),
    MetricSpec(
        "phase_seconds", Histogram, "swarm_phase_seconds",
        "Seconds one micro-batch spent in a phase (encode, decode, compute, wait) on a stage", ("stage", "phase"),
        buckets=PHASE_BUCKETS_S,
    ),
    MetricSpec(
        "trainer_phase_seconds", Counter, "swarm_trainer_phase_seconds_total",
        "Seconds the trainer spent in each phase of its steps (labels, pipeline, reduce, grads, commit, step), "
        "failed attempts included", ("phase",),
    ),
    MetricSpec(
        "buffer_hits", Counter, "swarm_aqsgd_buffer_hits_total",
        "AQ-SGD samples sent or received as deltas against the buffered activation", ("link",),
    ),
    MetricSpec(
        "buffer_misses", Counter, "swarm_aqsgd_buffer_misses_total",
        "AQ-SGD samples sent or received in full (first sight of the sample, or a buffer miss)", ("link",),
    ),
    MetricSpec(
        "step_seconds", Histogram, "swarm_step_seconds", "Wall-clock seconds of one optimizer step",
        buckets=STEP_BUCKETS_S,
    ),
    MetricSpec("steps", Counter, "swarm_steps_total", "Optimizer steps taken"),
    MetricSpec("loss", Gauge, "swarm_loss", "Training loss of the last step"),
    MetricSpec("plan_version", Gauge, "swarm_plan_version", "Version of the plan followed (0: no plan)"),
    MetricSpec(
        "held_out_loss", Gauge, "swarm_held_out_loss",
        "Mean loss per token on the held-out windows at the last evaluation (swarm train --eval-every)",
    ),
    MetricSpec(
        "frozen_layers", Gauge, "swarm_frozen_layers",
        "Layers [0, N) of the model frozen on this peer's stage (PipeTransformer; what the planner repacks by)",
    ),
    MetricSpec(
        "cache_hits", Counter, "swarm_frozen_cache_hits_total",
        "Samples a frozen stage answered from its activation cache without computing (PipeTransformer's AutoCache)",
    ),
    MetricSpec(
        "compute_bits", Gauge, "swarm_compute_bits",
        "Bits of this peer's stage compute precision: 32 fp32, 16 bf16 or fp16 (a plan's precisions; QSync)",
    ),
    MetricSpec(
        "buffered_samples", Gauge, "swarm_buffered_samples", "Samples held in the AQ-SGD buffer of a link", ("link",)
    ),
    MetricSpec(
        "relayed_bytes", Counter, RELAYED_BYTES,
        "Bytes this peer forwarded as a relay for peers behind NAT, per link '<src peer>-><dst peer>'", ("link",),
    ),
    MetricSpec(
        "relayed_connections", Counter, "swarm_relayed_connections_total",
        "Connections this peer relayed, by how the peer behind NAT took them: 'data-port' (plain TCP) or "
        "'frames' (an Accept stream)", ("path",),
    ),
)  # fmt: skip


class Metrics:
    """One process's (or one in-process stage host's) metrics, each an attribute named by `METRICS`.

    Attributes:
        registry: the registry every metric of this object is on, and only those.
        wire_bytes: swarm_wire_bytes_total{link, direction} (direction: forward or backward).
        fp32_bytes: swarm_fp32_bytes_total{link, direction}.
        sync_bytes: swarm_sync_bytes_total.
        state_bytes: swarm_state_bytes_total (swarm.runtime.service's GetState).
        control_bytes: swarm_control_bytes_total.
        control_call_bytes: swarm_control_call_bytes_total{method} (the same bytes by call method).
        phase_seconds: swarm_phase_seconds{stage, phase} (phase: encode, decode, compute or wait).
        trainer_phase_seconds: swarm_trainer_phase_seconds_total{phase} (swarm.runtime.driver).
        buffer_hits: swarm_aqsgd_buffer_hits_total{link}.
        buffer_misses: swarm_aqsgd_buffer_misses_total{link}.
        step_seconds: swarm_step_seconds.
        steps: swarm_steps_total.
        loss: swarm_loss.
        plan_version: swarm_plan_version.
        held_out_loss: swarm_held_out_loss (swarm.train.heldout).
        frozen_layers: swarm_frozen_layers (swarm.runtime.freeze.apply_frozen).
        cache_hits: swarm_frozen_cache_hits_total (swarm.runtime.freeze.cached_forward).
        compute_bits: swarm_compute_bits (set by the stage's Status from its worker's precision).
        buffered_samples: swarm_buffered_samples{link}.
        relayed_bytes: swarm_relayed_bytes_total{link} (swarm.net.relay; link "<src>-><dst>").
        relayed_connections: swarm_relayed_connections_total{path} (swarm.net.relay; "data-port" or "frames").
    """

    registry: CollectorRegistry
    wire_bytes: Counter
    fp32_bytes: Counter
    sync_bytes: Counter
    state_bytes: Counter
    control_bytes: Counter
    control_call_bytes: Counter
    phase_seconds: Histogram
    trainer_phase_seconds: Counter
    buffer_hits: Counter
    buffer_misses: Counter
    step_seconds: Histogram
    steps: Counter
    loss: Gauge
    plan_version: Gauge
    held_out_loss: Gauge
    frozen_layers: Gauge
    cache_hits: Counter
    compute_bits: Gauge
    buffered_samples: Gauge
    relayed_bytes: Counter
    relayed_connections: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for spec in METRICS:
            extra = {"buckets": spec.buckets} if spec.buckets is not None else {}
            metric = spec.kind(spec.name, spec.help, spec.labels, registry=self.registry, **extra)
            setattr(self, spec.attr, metric)

    def snapshot(self) -> dict[str, float]:
        """Every sample, flattened: `name{label="value",...}` (labels sorted; bare `name` without labels) ->
        value. Histograms give their `_bucket`, `_count` and `_sum` samples; `_created` timestamps are left
        out, being no figure of the run."""
        return {
            sample_key(s.name, s.labels): float(s.value)
            for family in self.registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        }

    def text(self) -> bytes:
        """The Prometheus text exposition of this registry, as `GET /metrics` serves it."""
        return generate_latest(self.registry)


def sample_key(name: str, labels: dict[str, str] | None = None) -> str:
    """The snapshot key of one sample: `name{a="1",b="x"}` with labels sorted, quoted as in the text format."""
    if not labels:
        return name
    quoted = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    pairs = sorted(zip(labels, quoted, strict=True))
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"


_KEY_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _parse_key(key: str) -> tuple[str, dict[str, str]]:
    match = _KEY_RE.match(key)
    if match is None:
        raise ValueError(f"not a snapshot key: {key!r}")
    unquote = lambda v: re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)
    return match.group(1), {k: unquote(v) for k, v in _LABEL_RE.findall(match.group(2) or "")}


def delta(before: dict[str, float], after: dict[str, float], prefix: str = "") -> dict[str, float]:
    """What changed between two snapshots, for the keys starting with `prefix`: after - before, a key
    missing from `before` counting as 0 (a labelled metric's first sample appears when first used).
    Meaningful for counters and histograms; a gauge's difference is only a difference."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix)}


def total(snapshot: dict[str, float], name: str, **labels: object) -> float:
    """The sum of the samples of `name` whose labels include `labels`, e.g.
    `total(d, "swarm_wire_bytes_total", direction="forward")` sums every link's forward bytes."""
    want = {k: str(v) for k, v in labels.items()}
    summed = 0.0
    for key, value in snapshot.items():
        sample, have = _parse_key(key)
        if sample == name and all(have.get(k) == v for k, v in want.items()):
            summed += value
    return summed


STATE_SENT_LOG = "GetState sent"
"""The start of the INFO line a peer logs for every GetState stream it sent (`swarm.runtime.service`: a held copy,
a takeover's state, an export), then its bytes: what `swarm_state_bytes_total` counted, kept where a killed
peer's metrics are not (`logged_state_bytes`)."""


def logged_state_bytes(log_dir: Path) -> int | None:
    """The bytes of every GetState stream the peers of a run sent, from their logs (`logs/*.log`, the lines
    `STATE_SENT_LOG` starts): a peer's metrics die with it, its log does not. A stream cut short by its sender's
    kill is not in it. None where the run left no logs."""
    logs = sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []
    if not logs:
        return None
    pattern = re.compile(re.escape(STATE_SENT_LOG) + r" (\d+) bytes")
    return sum(int(m.group(1)) for path in logs for m in pattern.finditer(path.read_text(errors="replace")))


@dataclass(frozen=True)
class MetricsServerLimits:
    """What the `/metrics` endpoint serves at most: its port is as open as the stage's, so an idle or slow
    connection must not hold a thread or a slot for long (issue 27: 400 idle connections held 400 threads)."""

    max_connections: int = 32
    """connections open at once; one more closes the oldest that has not sent its whole request yet"""
    read_timeout_s: float = 5.0
    """how long a connection may take to send its request (idle or slow: closed)"""
    write_timeout_s: float = 10.0
    """how long the reply may take to leave"""
    max_request_bytes: int = 8192
    """request line and headers; a longer request is closed"""


@dataclass(frozen=True)
class HttpReply:
    """What a route of `MetricsServer` answers (the server adds Content-Length and Connection: close)."""

    status: str
    """the status line's code and reason, e.g. "200 OK" """
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...] = ()
    """further headers, (name, value): fixed text of the route's, never a request's"""


Route = Callable[[str], HttpReply]
"""A page served beside /metrics: called on the server's event loop with the client's host, so it must answer at
once (from a cached body, never by a network call); an exception is answered 500."""


class MetricsServer:
    """A running `/metrics` endpoint (one thread, every connection on one event loop: an idle connection costs a
    socket, never a thread); `close()` stops it and frees the port.

    Args:
        metrics: whose text `GET /metrics` serves; None: no /metrics (404).
        host: the address to listen on.
        port: 0 picks a free one.
        limits: connections at once, read and write deadlines, request size.
        routes: further GET paths (query string ignored) and what answers them (`swarm.daemon.status_page`).
    """

    def __init__(
        self,
        metrics: Metrics | None,
        host: str,
        port: int,
        limits: MetricsServerLimits | None = None,
        routes: Mapping[str, Route] | None = None,
    ):
        self.metrics, self.limits = metrics, limits or MetricsServerLimits()
        self.routes = {path.encode(): route for path, route in (routes or {}).items()}
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.create_server((host.strip("[]"), port), family=family, backlog=128)
        self._sock.setblocking(False)
        self.host: str = host
        """The address it listens on."""
        self.port: int = self._sock.getsockname()[1]
        """The bound port (the free one picked when asked for port 0)."""
        self._reading: dict[asyncio.Task, float] = {}
        """connections still reading their request -> when they came (the oldest is closed for a new one)"""
        self._tasks: set[asyncio.Task] = set()
        self.served = 0
        """requests answered (200 or 404)"""
        self.dropped = 0
        """connections closed unanswered: idle past the read deadline, evicted, malformed or too long"""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"metrics-{self.port}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            self._thread.join()
            raise OSError(f"cannot serve metrics on {host}:{self.port}: {self._failed}") from self._failed

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def open_connections(self) -> int:
        """Connections being served now (reading, or writing their reply)."""
        return len(self._tasks)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, sock=self._sock, limit=self.limits.max_request_bytes)
            )
        except (OSError, RuntimeError) as e:
            self._failed = e
            self._sock.close()
            self._loop.close()
            return
        finally:
            self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            self._loop.run_until_complete(self._server.wait_closed())
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        if len(self._tasks) > self.limits.max_connections:  # full: the oldest still reading makes room
            oldest = min(self._reading, key=self._reading.get, default=None)
            if oldest is None:  # every connection is writing its reply: this one waits no turn
                self._tasks.discard(task)
                self.dropped += 1
                writer.close()
                return
            del self._reading[oldest]
            self._tasks.discard(oldest)  # counted out now: its cancellation closes it on the loop's next turn
            oldest.cancel()
        self._reading[task] = time.monotonic()
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.limits.read_timeout_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                self.dropped += 1
                return
            finally:
                self._reading.pop(task, None)
            peer = writer.get_extra_info("peername")
            reply = self._answer(head, str(peer[0]) if peer else "")
            extra = "".join(f"{name}: {value}\r\n" for name, value in reply.headers)
            writer.write(
                f"HTTP/1.1 {reply.status}\r\nContent-Type: {reply.content_type}\r\n{extra}"
                f"Content-Length: {len(reply.body)}\r\nConnection: close\r\n\r\n".encode()
                + reply.body
            )
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
            self.served += 1
        except asyncio.CancelledError:
            self.dropped += 1
        except (asyncio.TimeoutError, ConnectionError):
            self.dropped += 1
        finally:
            self._tasks.discard(task)
            self._reading.pop(task, None)
            writer.close()

    def _answer(self, head: bytes, client: str) -> HttpReply:
        """The reply to a request's head from `client` (its host)."""
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return HttpReply("400 Bad Request", b"a request line: GET /metrics HTTP/1.1\n", "text/plain")
        if parts[0] != b"GET":
            return HttpReply("405 Method Not Allowed", b"only GET is served here\n", "text/plain")
        path = parts[1].split(b"?", 1)[0]
        if path == b"/metrics" and self.metrics is not None:
            return HttpReply("200 OK", self.metrics.text(), CONTENT_TYPE_LATEST)
        if path in self.routes:
            try:
                return self.routes[path](client)
            except Exception:  # a page's bug answers 500 and leaves the server serving
                return HttpReply("500 Internal Server Error", b"this page failed; see the server's log\n", "text/plain")
        served = ", ".join(p.decode() for p in ([b"/metrics"] if self.metrics is not None else []) + list(self.routes))
        return HttpReply("404 Not Found", f"not found; served here: {served or 'nothing'}\n".encode(), "text/plain")

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def serve_metrics(
    metrics: Metrics | None,
    port: int,
    host: str = "127.0.0.1",
    limits: MetricsServerLimits | None = None,
    routes: Mapping[str, Route] | None = None,
) -> MetricsServer:
    """Serves `metrics.text()` at `GET http://host:port/metrics` (and `routes` at theirs; 404 on any other path)
    from one daemon thread until `close()`, within `limits` (connections at once, read and write deadlines).
    Loopback by default; port 0 picks a free port (see `MetricsServer.port`). Raises OSError when the port cannot
    be bound."""
    return MetricsServer(metrics, host, port, limits, routes)
