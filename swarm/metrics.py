"""Every metric of a swarm process, defined once in one table, on a per-process Prometheus registry.

A new metric is one row in `METRICS` plus its use: `Metrics` makes an attribute of each row. Each `Metrics`
has its own `CollectorRegistry` (never the client's global default), so several stage hosts in one process,
as the tests run them, count apart. `snapshot()` flattens every sample into a dict for per-step figures
(`delta`, `total`); `serve_metrics` serves the Prometheus text at `GET /metrics`.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["METRICS", "MetricSpec", "Metrics", "MetricsServer", "delta", "sample_key", "serve_metrics", "total"]

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
        "control_bytes", Counter, "swarm_control_bytes_total",
        "Bytes of the trainer's other calls: token and label batches, Reduce/Grads/Step, pings (serialized)",
    ),
    MetricSpec(
        "phase_seconds", Histogram, "swarm_phase_seconds",
        "Seconds one micro-batch spent in a phase (encode, decode, compute, wait) on a stage", ("stage", "phase"),
        buckets=PHASE_BUCKETS_S,
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
        "frozen_layers", Gauge, "swarm_frozen_layers",
        "Layers [0, N) of the model frozen on this peer's stage (PipeTransformer; what the planner repacks by)",
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
        control_bytes: swarm_control_bytes_total.
        phase_seconds: swarm_phase_seconds{stage, phase} (phase: encode, decode, compute or wait).
        buffer_hits: swarm_aqsgd_buffer_hits_total{link}.
        buffer_misses: swarm_aqsgd_buffer_misses_total{link}.
        step_seconds: swarm_step_seconds.
        steps: swarm_steps_total.
        loss: swarm_loss.
        plan_version: swarm_plan_version.
        frozen_layers: swarm_frozen_layers (swarm.runtime.freeze.apply_frozen).
        compute_bits: swarm_compute_bits (set by the stage's Status from its worker's precision).
        buffered_samples: swarm_buffered_samples{link}.
        relayed_bytes: swarm_relayed_bytes_total{link} (swarm.net.relay; link "<src>-><dst>").
        relayed_connections: swarm_relayed_connections_total{path} (swarm.net.relay; "data-port" or "frames").
    """

    registry: CollectorRegistry
    wire_bytes: Counter
    fp32_bytes: Counter
    sync_bytes: Counter
    control_bytes: Counter
    phase_seconds: Histogram
    buffer_hits: Counter
    buffer_misses: Counter
    step_seconds: Histogram
    steps: Counter
    loss: Gauge
    plan_version: Gauge
    frozen_layers: Gauge
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


class MetricsServer:
    """A running `/metrics` endpoint; `close()` stops it and frees the port."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread):
        self._httpd, self._thread = httpd, thread
        self.host: str = httpd.server_address[0]
        """The address it listens on."""
        self.port: int = httpd.server_address[1]
        """The bound port (the free one picked when asked for port 0)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def serve_metrics(metrics: Metrics, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serves `metrics.text()` at `GET http://host:port/metrics` (404 on any other path) from a daemon
    thread until `close()`. Loopback by default; port 0 picks a free port (see `MetricsServer.port`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = metrics.text()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:  # a scrape every few seconds is no news
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name=f"metrics-{httpd.server_address[1]}", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)
