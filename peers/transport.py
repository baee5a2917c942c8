"""gRPC plumbing: servers and channels with bounded messages, keepalive and deadlines, and chunk streams.

Servers listen on 127.0.0.1 unless told otherwise. Streams are plain synchronous generators: gRPC pulls the
next item only when HTTP/2 flow control lets it, which is the backpressure, and the link's shaper paces
each chunk before it is handed over.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc

from swarm.peers.hotpool import HotPool
from swarm.peers.shaper import Shaper


@dataclass(frozen=True)
class TransportConfig:
    """Bounds and timers of every gRPC server and channel."""

    host: str = "127.0.0.1"
    """address servers listen on (loopback unless a peer is meant to be reachable from elsewhere)"""
    max_message_bytes: int = 8 << 20
    """most bytes of one gRPC message (one chunk plus its envelope)"""
    keepalive_s: float = 20.0
    """HTTP/2 keepalive ping interval"""
    keepalive_timeout_s: float = 10.0
    """a peer that does not answer a keepalive ping within this is considered gone"""
    connect_timeout_s: float = 10.0
    """how long a channel may take to connect"""
    max_workers: int = 32
    """threads serving calls (each in-flight micro-batch holds one while it waits downstream)"""

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        return [
            *self.channel_options(),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.so_reuseport", 0),
        ]


def make_server(config: TransportConfig, port: int = 0) -> tuple[grpc.Server, int]:
    """A started-later gRPC server bound to `config.host:port` (0 picks a free port); returns it and its port."""
    pool = HotPool(config.max_workers, thread_name_prefix="grpc")  # per-thread native caches stay in few threads
    server = grpc.server(pool, options=config.server_options(), maximum_concurrent_rpcs=config.max_workers * 4)
    bound = server.add_insecure_port(f"{config.host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {config.host}:{port}")
    return server, bound


def start_all_threads(pool: futures.ThreadPoolExecutor, n: int) -> None:
    """Starts the pool's `n` threads now instead of one per burst of calls, so a server's (or any long-lived
    pool's) thread count is the same from its first call to its last (a soak or a leak check reads it), and no
    call waits for a thread to start."""
    started = threading.Barrier(n + 1)
    for _ in range(n):
        pool.submit(started.wait, 10.0)
    started.wait(10.0)


class Channels:
    """One channel per destination address, reused by every call to it.

    `dial` maps an announced address to the one actually dialed (`swarm.net.relay.Tunnels.dial`: a local
    tunnel to a peer behind NAT), asked at every `get`: when it changes (the peer turned out unreachable and
    now announces a relay), a new channel dials the new target. The old one is retired, not closed: calls
    already on it finish there (closing it failed them with "Channel closed!", and the nat experiment's first
    step ran again). The `retired_kept` newest retired channels stay open; older ones, and all at `close`, close.
    """

    retired_kept = 8
    """Retired channels kept open at most (a peer flipping its announcement cannot grow them without bound)."""

    def __init__(self, config: TransportConfig, dial=None):
        self.config, self.dial = config, dial
        self._channels: dict[str, tuple[str, grpc.Channel]] = {}
        self._retired: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        target = address if self.dial is None else self.dial(address)
        with self._lock:
            cached = self._channels.get(address)
            if cached is not None and cached[0] == target:
                return cached[1]
            if cached is not None:
                self._retired.append(cached[1])
                while len(self._retired) > self.retired_kept:
                    self._retired.pop(0).close()
            channel = grpc.insecure_channel(target, options=self.config.channel_options())
            self._channels[address] = (target, channel)
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in [*(c for _, c in self._channels.values()), *self._retired]:
                channel.close()
            self._channels.clear()
            self._retired.clear()


def paced(items: Iterable[bytes], shaper: Shaper | None) -> Iterator[bytes]:
    """Yields serialized `items`, each after the link's shaper let its bytes through (and the delay before the
    first)."""
    first = True
    for item in items:
        if shaper is not None:
            if first:
                shaper.delay()
            shaper.consume(len(item))
        first = False
        yield item
