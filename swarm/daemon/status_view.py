"""What the live status page shows, as one JSON-able dict: the DHT's records, liveness probes of the bootstrap
peers and relays, the plans seen, and the trainer's step curves, each bounded in size however long the run.

Pure apart from `probe_tcp` and `StepCurves.refresh` (a file read): `swarm.daemon.status_page` polls, caches and
serves what `status_snapshot` makes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.peers.records import LinkMeasurement, PeerAnnouncement, PlanRecord, TrainerAnnouncement

__all__ = [
    "STATUS_FORMAT", "Probe", "PlanHistory", "StepCurves", "maddr_endpoint", "probe_tcp", "status_snapshot",
]  # fmt: skip

STATUS_FORMAT = "swarm-status/1"
"""The `format` field of /api/status: a reader checks it before it reads the rest."""

HELD_OUT_COLUMNS = ("held_out_loss", "eval_loss", "val_loss")
"""steps.csv columns read as the held-out loss, the first present in a row."""


@dataclass(frozen=True)
class Probe:
    """One liveness probe: whether a TCP connection to the endpoint opened within the timeout."""

    target: str
    """what was probed, as the user or the DHT named it (a multiaddr, a peer's address)"""
    alive: bool
    rtt_ms: float | None = None
    """how long the connection took to open; None when it did not"""
    error: str | None = None
    """why not, in a few words"""
    checked_at: float = 0.0
    """when, in seconds since the epoch"""

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "alive": self.alive,
            "rtt_ms": _finite(self.rtt_ms),
            "error": self.error,
            "checked_at": self.checked_at,
        }


def maddr_endpoint(maddr: str) -> tuple[str, int] | None:
    """(host, TCP port) of a multiaddr such as `/ip4/10.0.0.1/tcp/4100/p2p/Qm...` (ip4, ip6, dns, dns4, dns6); None
    when it names no TCP endpoint (e.g. a QUIC-only or relayed address)."""
    parts = maddr.strip().split("/")
    host = port = None
    for i in range(1, len(parts) - 1):
        if parts[i] in ("ip4", "ip6", "dns", "dns4", "dns6") and host is None:
            host = parts[i + 1]
        elif parts[i] == "tcp" and port is None:
            port = parts[i + 1]
    if host is None or port is None or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def address_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a peer's announced 'host:port' or '[v6]:port'; None when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        return None
    return host.strip("[]"), int(port)


def probe_tcp(target: str, endpoint: tuple[str, int] | None, timeout_s: float) -> Probe:
    """Opens (and at once closes) a TCP connection to `endpoint`: alive means something listens there, which for a
    bootstrap peer or a relay is what the swarm needs of it. Never raises."""
    now = time.time()
    if endpoint is None:
        return Probe(target, False, error="no TCP address in it", checked_at=now)
    started = time.perf_counter()
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            pass
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        return Probe(target, False, error=why, checked_at=now)
    return Probe(target, True, rtt_ms=(time.perf_counter() - started) * 1e3, checked_at=now)


class PlanHistory:
    """The plan versions this reader saw, newest last, at most `max_plans` (a run re-plans on every churn)."""

    def __init__(self, max_plans: int = 64):
        self._plans: deque[dict[str, Any]] = deque(maxlen=max_plans)

    def see(self, plan: PlanRecord | None, seen_at: float) -> None:
        if plan is None or (self._plans and self._plans[-1]["version"] >= plan.version):
            return
        doc = plan.document
        self._plans.append(
            {
                "version": plan.version,
                "created_at": plan.created_at,
                "seen_at": seen_at,
                "stages": len(doc.stages),
                "replicas": [len(s.peer_ids) for s in doc.stages],
                "layers": [[s.layer_start, s.layer_end] for s in doc.stages],
                "peers": sorted({p for s in doc.stages for p in s.peer_ids}),
                "step_time_s": _finite(doc.step_time_s),
            }
        )

    def to_json(self) -> list[dict[str, Any]]:
        return list(self._plans)


class StepCurves:
    """The trainer's steps, read as they are written: `steps.jsonl` while `swarm train` runs (one JSON row a line,
    flushed per step), `steps.csv` once it ended. Reads only what is new since the last `refresh` (at most
    `max_read_bytes` a call), and keeps at most `max_points` points a curve by halving them (every other point)
    when full, so a run of millions of steps costs the same memory as one of a thousand.

    Args:
        path: the trainer's --out directory, or a steps.jsonl / steps.csv file.
        max_points: points kept per curve (loss, held-out loss, throughput).
        max_read_bytes: bytes read per refresh, at most; the rest is read by the next.
    """

    def __init__(self, path: str | os.PathLike, max_points: int = 2000, max_read_bytes: int = 8 << 20):
        path = Path(path)
        self.directory = path if path.is_dir() or not path.suffix else path.parent
        self.max_points, self.max_read_bytes = max_points, max_read_bytes
        self._reset()
        self.error: str | None = None
        """why the last refresh read nothing (no file yet, unreadable); None when it read"""

    def _reset(self) -> None:
        self._file: tuple[str, int] | None = None  # (name, inode) being read
        self._offset = 0
        self._csv_seen: tuple[int, float] | None = None  # (size, mtime) of the steps.csv read whole
        self.rows = 0
        self._stride = 1
        self.loss: list[tuple[int, float]] = []
        self.held_out: list[tuple[int, float]] = []
        self.throughput: list[tuple[int, float]] = []
        self.last: dict[str, Any] = {}
        self.plan_steps: dict[int, int] = {}  # plan version -> first step trained on it

    def refresh(self) -> None:
        """Reads the rows written since the last call. Never raises: a problem is kept in `error`."""
        lines, csv_path = self.directory / "steps.jsonl", self.directory / "steps.csv"
        try:
            if lines.exists():
                self._read_lines(lines)
            elif csv_path.exists():
                self._read_csv(csv_path)
            else:
                self.error = f"no steps.jsonl or steps.csv in {self.directory.name or '.'}/ yet"
                return
            self.error = None
        except OSError as e:
            self.error = f"cannot read the steps in {self.directory.name or '.'}/: {e.strerror or type(e).__name__}"

    def _read_lines(self, path: Path) -> None:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            if self._file != ("jsonl", stat.st_ino) or stat.st_size < self._offset:  # a new run's file
                self._reset()
                self._file = ("jsonl", stat.st_ino)
            f.seek(self._offset)
            chunk = f.read(self.max_read_bytes)
        end = chunk.rfind(b"\n") + 1  # a line the trainer is still writing waits for the next refresh
        for line in chunk[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn or foreign line: skipped, the curve goes on
            if isinstance(row, dict):
                self._add(row)
        self._offset += end

    def _read_csv(self, path: Path) -> None:
        stat = path.stat()
        if self._csv_seen == (stat.st_size, stat.st_mtime):
            return
        self._reset()
        self._csv_seen = (stat.st_size, stat.st_mtime)
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                self._add(row)

    def _add(self, row: Mapping[str, Any]) -> None:
        step, loss = _int(row.get("step")), _float(row.get("train_loss"))
        if step is None:
            return
        self.rows += 1
        held_out = next((v for c in HELD_OUT_COLUMNS if (v := _float(row.get(c))) is not None), None)
        step_s = _float(row.get("step_s"))
        ids = row.get("sample_ids")
        samples = len(ids.split()) if isinstance(ids, str) and ids.strip() else None
        rate = None
        if step_s and step_s > 0:
            rate = (samples if samples is not None else 1) / step_s
        version = _int(row.get("plan_version"))
        if version is not None and version not in self.plan_steps and len(self.plan_steps) < 4096:
            self.plan_steps[version] = step
        self.last = {
            "step": step,
            "train_loss": loss,
            "held_out_loss": held_out if held_out is not None else self.last.get("held_out_loss"),
            "step_s": step_s,
            "samples_per_s": rate if samples is not None else self.last.get("samples_per_s"),
            "steps_per_s": 1 / step_s if step_s else None,
            "plan_version": version,
            "time": _float(row.get("time")),
        }
        if held_out is not None:  # rare (every N steps): kept apart from the stride
            self._keep(self.held_out, (step, held_out))
        if (self.rows - 1) % self._stride:
            return
        if loss is not None:
            self._keep(self.loss, (step, loss))
        if rate is not None:
            self._keep(self.throughput, (step, rate))

    def _keep(self, curve: list[tuple[int, float]], point: tuple[int, float]) -> None:
        curve.append(point)
        if len(curve) > self.max_points:
            del curve[1::2]
            if curve is self.loss:
                self._stride *= 2

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": self.directory.name,  # not the whole path: the page may face strangers
            "error": self.error,
            "rows": self.rows,
            "loss": [list(p) for p in self.loss],
            "held_out": [list(p) for p in self.held_out],
            "throughput": [list(p) for p in self.throughput],
            "throughput_unit": "samples/s" if self.last.get("samples_per_s") is not None else "steps/s",
            "last": {k: _finite(v) if isinstance(v, float) else v for k, v in self.last.items()},
            "plan_steps": {str(v): s for v, s in sorted(self.plan_steps.items())[-256:]},
        }


def status_snapshot(
    run_name: str,
    now: float,
    peers: Sequence[PeerAnnouncement],
    links: Sequence[LinkMeasurement],
    plan: PlanRecord | None,
    trainers: Sequence[TrainerAnnouncement] = (),
    metrics: Mapping[str, Mapping[str, float]] | None = None,
    bootstrap: Sequence[Probe] = (),
    relay_probes: Mapping[str, Probe] | None = None,
    plan_history: Sequence[dict[str, Any]] = (),
    steps: dict[str, Any] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """The status page's whole content (/api/status): what a reader of the DHT sees at `now` (DHT time), the
    probes of the bootstrap peers and relays, the plans seen and the trainer's curves. Every string in it may be
    a peer's (the page escapes them); every float is finite or None."""
    from swarm.metrics import total

    metrics, relay_probes = metrics or {}, relay_probes or {}
    by_id = {p.peer_id: p for p in peers}
    doc = plan.document if plan is not None else None
    planned = {pid: [s, r] for s, st in enumerate(doc.stages) for r, pid in enumerate(st.peer_ids)} if doc else {}
    peer_rows = []
    for p in peers:
        snap = metrics.get(p.peer_id)
        peer_rows.append(
            {
                "peer_id": p.peer_id,
                "address": p.address,
                "device": p.device,
                "stage": p.stage,
                "layers": None if p.layers is None else [p.layer_start, p.layer_end],
                "planned": planned.get(p.peer_id),
                "plan_version": p.plan_version,
                "layers_per_s": _finite(p.compute_layers_per_s),
                "load": _finite(p.load),
                "age_s": _finite(now - p.started_at),
                "reach": p.reach,
                "relay": p.relay,
                "leaving": p.leaving,
                "planner": p.planner_until > now,
                # a peer behind NAT is not dialled directly: its silence says nothing (None: not known)
                "answered": None if p.stage is None or (snap is None and p.reach == "relay") else snap is not None,
                "steps": _finite(total(snap, "swarm_steps_total")) if snap else None,
                "sent_bytes": _finite(total(snap, "swarm_wire_bytes_total")) if snap else None,
                "relayed_bytes": _finite(total(snap, "swarm_relayed_bytes_total")) if snap else None,
            }
        )
    relays = []
    for relay_id in sorted({p.relay for p in peers if p.relay is not None}):
        announced = by_id.get(relay_id)
        probe = relay_probes.get(relay_id)
        relays.append(
            {
                "peer_id": relay_id,
                "address": announced.address if announced else None,
                "announced": announced is not None and not announced.leaving,
                "probe": probe.to_json() if probe else None,
                "alive": announced is not None and not announced.leaving and (probe is None or probe.alive),
                "serves": sorted(p.peer_id for p in peers if p.relay == relay_id),
            }
        )
    link_rows = []
    for m in links:
        via = [by_id[x].relay for x in (m.src, m.dst) if x in by_id and by_id[x].reach == "relay"]
        link_rows.append(
            {
                "src": m.src,
                "dst": m.dst,
                "rtt_ms": _finite(m.rtt_s * 1e3),
                "mbit_s": _finite(m.bytes_per_s * 8 / 1e6),
                "age_s": _finite(now - m.measured_at),
                "via": via,
                "reachable": m.src in by_id and m.dst in by_id,
            }
        )
    stages = []
    if doc is not None:
        for s, st in enumerate(doc.stages):
            codecs = doc.codecs[s].to_wire() if doc.codecs and s < len(doc.codecs) else None
            stages.append(
                {
                    "stage": s,
                    "layers": [st.layer_start, st.layer_end],
                    "replicas": [
                        {
                            "peer_id": pid,
                            "announced": pid in by_id,
                            "address": by_id[pid].address if pid in by_id else None,
                            "reach": by_id[pid].reach if pid in by_id else None,
                        }
                        for pid in st.peer_ids
                    ],
                    "precision": doc.precisions[s] if doc.precisions and s < len(doc.precisions) else None,
                    "codecs_out": codecs,
                    "announced_only": False,
                }
            )
    if doc is None:  # no plan published (peers assigned by --assign): the stages the peers announce
        for stage in sorted({p.stage for p in peers if p.stage is not None}):
            serving = [p for p in peers if p.stage == stage]
            stages.append(
                {
                    "stage": stage,
                    "layers": [min(p.layer_start for p in serving), max(p.layer_end for p in serving)],
                    "replicas": [
                        {"peer_id": p.peer_id, "announced": True, "address": p.address, "reach": p.reach}
                        for p in serving
                    ],
                    "precision": None,
                    "codecs_out": None,
                    "announced_only": True,
                }
            )
    return {
        "format": STATUS_FORMAT,
        "run": run_name,
        "time": now,
        "error": error,
        "bootstrap": [b.to_json() for b in bootstrap],
        "peers": peer_rows,
        "trainers": [
            {"peer_id": t.peer_id, "age_s": _finite(now - t.started_at), "banned": list(t.banned)} for t in trainers
        ],
        "relays": relays,
        "links": link_rows,
        "plan": None
        if plan is None
        else {
            "version": plan.version,
            "age_s": _finite(now - plan.created_at),
            "step_time_s": _finite(doc.step_time_s),
            "frozen_layers": doc.frozen_layers,
            "standby": list(doc.unused_peer_ids),
            "cost_model": doc.cost_model,
        },
        "stages": stages,
        "plan_history": list(plan_history),
        "steps": steps,
    }


def _finite(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _float(x: Any) -> float | None:
    try:
        return _finite(x) if x not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _int(x: Any) -> int | None:
    try:
        return int(x) if x not in (None, "") and not isinstance(x, bool) else None
    except (TypeError, ValueError):
        return None
