"""`swarm status`: joins the DHT briefly and lists the run's peers, link measurements and current plan; with
`--serve PORT` it stays joined and serves them as a live web page (`swarm.daemon.status_page`).

A peer's announcement outlives it by up to its TTL (30 s by default), so each announced peer's stage port is
tried: a peer that does not accept a connection is listed apart, as left (or unreachable from here)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from hivemind.utils import get_dht_time

from swarm.daemon.bootstrap import LOG_FORMAT, reader_dht_config
from swarm.flags import Flags, flag
from swarm.options import DHT_FLAGS
from swarm.peers.dht import SwarmDHT, quiet_hivemind
from swarm.peers.dht_config import DHTConfig
from swarm.peers.records import LinkMeasurement, PeerAnnouncement, PlanRecord

__all__ = [
    "StatusConfig", "add_arguments", "peer_metrics", "render", "run", "serve_status", "status_argv", "status_flags",
    "to_json",
]  # fmt: skip

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatusConfig:
    """Everything `swarm status` is told: its fields are its flags (`status_flags`)."""

    address_file: str | None = field(default=None, metadata=flag(metavar="PATH", group="DHT"))
    """read multiaddrs to join through from PATH (as `swarm bootstrap --address-file` writes them), in addition to
    any --initial-peers"""
    dht: DHTConfig = field(default_factory=DHTConfig, metadata={"flag": DHT_FLAGS})
    """How it joins the DHT (`dht_config` adds the address file's peers, client mode and the timeout)."""
    json: bool = False
    """print one JSON object instead of tables"""
    timeout_s: float = 20.0
    """bound, in seconds, on joining the DHT and on each query"""
    serve: int | None = field(default=None, metadata=flag(metavar="PORT", group="status page"))
    """stay joined and serve a live status page at http://SERVE_HOST:PORT/ (its JSON at /api/status) until
    interrupted; 0 picks a free port"""
    serve_host: str = field(default="127.0.0.1", metadata=flag(group="status page"))
    """address the page listens on (0.0.0.0 to show it to others: it is read-only and holds no secret)"""
    steps: str | None = field(default=None, metadata=flag(metavar="DIR", group="status page"))
    """the trainer's --out directory (or its steps.csv): the page draws its loss, held-out loss and throughput"""
    refresh_s: float = field(default=5.0, metadata=flag(group="status page"))
    """seconds between the page's reads of the DHT, the probes and the steps"""

    def __post_init__(self) -> None:
        if self.serve is not None and not 0 <= self.serve <= 65535:
            raise ValueError(f"StatusConfig.serve: expected a port 0-65535, got {self.serve}")
        if not self.refresh_s >= 0.5:
            raise ValueError(f"StatusConfig.refresh_s: expected >= 0.5 s, got {self.refresh_s}")

    def dht_config(self) -> DHTConfig:
        """The DHT config to join with: --initial-peers and the address file's peers, in client mode (a
        short-lived reader should not become a home for others' records), bounded by --timeout-s.

        Raises:
            OSError: the address file cannot be read.
            ValueError: nothing to join (no initial peers, no address file).
        """
        return reader_dht_config(self.dht, self.address_file, self.timeout_s)


@cache
def status_flags() -> Flags[StatusConfig]:
    """`swarm status`'s flags: `status_flags().to_argv(config)` is the command line of that query."""
    return Flags(StatusConfig)


def status_argv(address_file: str, host: str, timeout_s: float) -> list[str]:
    """The flags of a `swarm status --json` query joining from `host` through `address_file` (the testbed's
    check that every stage is announced)."""
    cfg = StatusConfig(address_file, DHTConfig(host=host), json=True, timeout_s=timeout_s)
    return status_flags().to_argv(cfg)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    status_flags().add_to(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log our and hivemind's info messages")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=LOG_FORMAT,
    )
    quiet_hivemind(logging.INFO if args.verbose else logging.WARNING)
    try:
        cfg = status_flags().from_args(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    try:
        config = cfg.dht_config()
    except OSError as e:
        logger.error("can't read the address file: %s", e)
        return 2
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if cfg.serve is not None:
        return serve_status(cfg, config)
    try:
        with SwarmDHT(config) as dht:
            peers, links, plan = dht.peers(), dht.links(), dht.get_plan()
    except (TimeoutError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    up = answering(peers, timeout_s=min(cfg.timeout_s, 2.0))
    metrics = peer_metrics([p for p in peers if p.peer_id in up], timeout_s=min(cfg.timeout_s, 5.0))
    now = get_dht_time()
    if cfg.json:
        json.dump(to_json(config.run_name, peers, links, plan, now, metrics, up), sys.stdout, indent=2)
        print()
    else:
        print(render(config.run_name, peers, links, plan, now, metrics, up))
    return 0


def serve_status(cfg: StatusConfig, config: DHTConfig) -> int:
    """`swarm status --serve PORT`: stays joined and serves the live page until SIGINT or SIGTERM. Returns the exit
    code (2: the port cannot be bound; 1: the DHT cannot be joined)."""
    import signal
    import threading

    from swarm.daemon.status_page import DhtReader, StatusPage
    from swarm.metrics import serve_metrics

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    metrics_of = lambda peers: peer_metrics(peers, timeout_s=min(cfg.timeout_s, 3.0))  # noqa: E731
    try:
        with SwarmDHT(config) as dht:
            reader = DhtReader(dht, config.run_name, config.initial_peers, cfg.steps, metrics_of)
            page = StatusPage(reader, cfg.refresh_s)
            try:
                # after the DHT's process is forked, so that it holds no copy of the listening socket
                with serve_metrics(None, cfg.serve, cfg.serve_host, routes=page.routes) as server:
                    host = f"[{server.host}]" if ":" in server.host else server.host
                    print(f"status page at http://{host}:{server.port}/ (JSON at /api/status)", file=sys.stderr)
                    sys.stderr.flush()
                    while not stop.wait(1.0):  # a timed wait: the signal handler runs between waits
                        pass
            except OSError as e:
                logger.error("cannot serve the status page on %s:%s: %s", cfg.serve_host, cfg.serve, e)
                return 2
            finally:
                page.close()
    except (TimeoutError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    return 0


def listening(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at `address` (HOST:PORT): a stopped peer's port refuses."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def answering(peers: Sequence[PeerAnnouncement], timeout_s: float) -> frozenset[str]:
    """The ids of the announced peers whose stage port accepts a connection (tried in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    if not peers:
        return frozenset()
    with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
        up = list(pool.map(lambda p: listening(p.address, timeout_s), peers))
    return frozenset(p.peer_id for p, ok in zip(peers, up, strict=True) if ok)


def peer_metrics(peers: Sequence[PeerAnnouncement], timeout_s: float) -> dict[str, dict[str, float]]:
    """Each serving peer's metrics (`Status`), by peer id; a peer that does not answer in time is left out."""
    import grpc

    from swarm.net.auth import CallSigner, Identity
    from swarm.net.connect import GrpcConnector
    from swarm.proto import stage_pb2

    # Status answers any authenticated caller: a throwaway key is enough (a private run's secret is not here)
    connector, out = GrpcConnector(signer=CallSigner(Identity.generate())), {}
    try:
        for p in peers:
            if p.stage is None:
                continue
            try:
                reply = connector.stage(p.address, p.peer_id).Status(stage_pb2.Empty(), timeout=timeout_s)
                out[p.peer_id] = dict(reply.metrics)
            except grpc.RpcError as e:
                logger.warning("peer %s at %s did not answer Status: %s", p.peer_id[:8], p.address, e.code())
    finally:
        connector.close()
    return out


def to_json(
    run_name: str,
    peers: Sequence[PeerAnnouncement],
    links: Sequence[LinkMeasurement],
    plan: PlanRecord | None,
    now: float,
    metrics: dict[str, dict[str, float]] | None = None,
    up: frozenset[str] | None = None,
) -> dict[str, Any]:
    """The machine-readable status: records in their wire form (plan parsed), plus ages in seconds, each
    serving peer's metrics and whether it answered (`up`: the ids that did; None: not tried, all count)."""
    metrics = metrics or {}
    return {
        "run": run_name,
        "time": now,
        "peers": [
            {
                **p.to_wire(),
                "age_s": now - p.started_at,
                "metrics": metrics.get(p.peer_id),
                "answering": up is None or p.peer_id in up,
            }
            for p in peers
        ],
        "links": [{**m.to_wire(), "age_s": now - m.measured_at} for m in links],
        "plan": None if plan is None else {**plan.to_wire(), "plan": plan.document.to_wire()},
    }


def render(
    run_name: str,
    peers: Sequence[PeerAnnouncement],
    links: Sequence[LinkMeasurement],
    plan: PlanRecord | None,
    now: float,
    metrics: dict[str, dict[str, float]] | None = None,
    up: frozenset[str] | None = None,
) -> str:
    """The human-readable status: a peers table (layers as start:end, end excluded; age since the peer
    started; steps, bytes sent and AQ-SGD buffer hit rate from its metrics) of the peers that answered (`up`;
    None: all), a line naming those that did not, a links table and the plan's version."""
    metrics = metrics or {}
    gone = [p for p in peers if up is not None and p.peer_id not in up]
    peers = [p for p in peers if p not in gone]
    plan_line = "no plan" if plan is None else f"plan version {plan.version}, made {_age(now - plan.created_at)} ago"
    lines = [f"run {run_name!r}: {len(peers)} peers, {len(links)} link measurements, {plan_line}", ""]
    peer_rows = [
        [
            p.peer_id[:8],
            p.address,
            p.device,
            "-" if p.stage is None else str(p.stage),
            "-" if p.layers is None else f"{p.layer_start}:{p.layer_end}",
            f"{p.compute_layers_per_s:.1f}",
            f"{p.load:.0%}",
            _age(now - p.started_at),
            *_metric_cells(metrics.get(p.peer_id)),
        ]
        for p in peers
    ]
    headers = ["peer", "address", "device", "stage", "layers", "layers/s", "load", "age", "steps", "sent MB", "hits"]
    lines.append(_table(headers, peer_rows))
    if gone:
        named = ", ".join(f"{p.peer_id[:8]} at {p.address}" for p in gone)
        lines += ["", f"left (still announced, not answering; or unreachable from here): {named}"]
    if links:
        link_rows = [
            [m.src[:8], m.dst[:8], f"{m.rtt_s * 1e3:.1f}", f"{m.bytes_per_s * 8 / 1e6:.1f}", _age(now - m.measured_at)]
            for m in links
        ]
        lines += ["", _table(["src", "dst", "rtt ms", "Mbit/s", "age"], link_rows)]
    return "\n".join(lines)


def _metric_cells(snapshot: dict[str, float] | None) -> list[str]:
    """Steps, megabytes sent on stage links and the AQ-SGD buffer hit rate, from a metrics snapshot."""
    from swarm.metrics import total

    if not snapshot:
        return ["-", "-", "-"]
    hits, misses = total(snapshot, "swarm_aqsgd_buffer_hits_total"), total(snapshot, "swarm_aqsgd_buffer_misses_total")
    return [
        f"{total(snapshot, 'swarm_steps_total'):.0f}",
        f"{total(snapshot, 'swarm_wire_bytes_total') / 1e6:.1f}",
        f"{hits / (hits + misses):.0%}" if hits + misses else "-",
    ]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *rows]
    )


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
