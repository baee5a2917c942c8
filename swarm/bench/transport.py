"""`swarm bench transport`: what the wire path moves, against a plain socket, on loopback and shaped links.

Four tables from one run:
1. loopback: a tensor encoded with each codec, framed, streamed over the stage service's `Sink` call and
   checked on the other end, for 64 KiB to 16 MiB tensors; beside it a plain TCP socket moving the same
   wire bytes with `sendall` of 1 MiB buffers. `vs_socket` compares bytes/s on the wire. The receiver of
   both is one separate process, as the next stage of a swarm is, and both keep their connection open.
   `raw_grpc_*` is gRPC alone moving the same bytes as plain bytes items (no protobuf, no checks): the
   ceiling the library's Python API sets.
2. goodput on links shaped to 100 Mbit/s and 1 Gbit/s, as a share of the configured rate.
3. the shaper's accuracy alone (achieved against configured rate at 10, 100, 1000 Mbit/s).
4. whether zstd pays at each rate for each codec's messages, and what the per-link policy decides.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from dataclasses import dataclass, replace

import torch

from swarm.flags import Flags
from swarm.report import emit, median_seconds

SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
CODECS = ["fp32", "fp16", "directq8", "directq4", "directq2"]
RATES_MBIT = [10.0, 100.0, 1000.0]


@dataclass(frozen=True)
class TransportBench:
    """`swarm bench transport`: gRPC stream throughput, goodput on shaped links, zstd's worth."""

    repeats: int = 3
    """timed repeats; the median is reported"""
    shaped_seconds: float = 3.0
    """seconds of traffic per shaped-link row"""
    quick: bool = False
    """small sizes, one repeat, short shaped runs"""
    json: bool = False
    """print all rows as one JSON list"""


_FLAGS = Flags(TransportBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


class _Receiver:
    """The receiving peer, in a process of its own as in a swarm: a stage server with no stage (its `Sink`
    call reads and checks framed tensors) and a plain TCP sink, both on 127.0.0.1."""

    def __init__(self):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # gRPC's threads do not survive a fork
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child,), daemon=True, name="bench-receiver")
        self._process.start()
        deadline = time.monotonic() + 60
        while not self._conn.poll(0.2):
            if not self._process.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the receiver process did not start (exit code {self._process.exitcode})")
        self.address, self.socket_port = self._conn.recv()

    def close(self):
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve(conn) -> None:
    """The receiver process: serves until told to stop (or its parent's end of the pipe closes)."""
    import grpc

    from swarm.peers.allocator import tune_allocator
    from swarm.peers.transport import TransportConfig, make_server
    from swarm.proto import stage_pb2_grpc
    from swarm.runtime.budget import StageBudget
    from swarm.runtime.service import StageServicer

    tune_allocator()
    server, port = make_server(TransportConfig())
    # the benchmark streams up to 16 MiB tensors into Sink; a peer's default budget takes 4 MiB link probes
    sink = StageServicer(None, budget=StageBudget(max_sink_bytes=(max(SIZES) + (1 << 20)) * 2))
    stage_pb2_grpc.add_StageServicer_to_server(sink, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_RAW_SERVICE, {"Sink": _raw_sink()}),))
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_socket_sink, args=(listener,), daemon=True).start()
    conn.send((f"127.0.0.1:{port}", listener.getsockname()[1]))
    try:
        conn.recv()
    except EOFError:
        pass
    server.stop(None)
    listener.close()


_RAW_SERVICE = "bench.Raw"


def _raw_sink():
    """A stream of plain bytes items, counted and dropped: what gRPC itself costs, with no protobuf."""
    import grpc

    def sink(items, context):
        return sum(len(item) for item in items).to_bytes(8, "little")

    return grpc.stream_unary_rpc_method_handler(sink)


def _raw_grpc_bytes_per_s(channel, nbytes: int, repeats: int, chunk_bytes: int = 1 << 20) -> float:
    """gRPC alone, no protobuf: the same bytes as a stream of 1 MiB bytes items to the receiver process."""
    call = channel.stream_unary(f"/{_RAW_SERVICE}/Sink")
    buf = bytes(chunk_bytes)

    def once() -> None:
        sizes = [chunk_bytes] * (nbytes // chunk_bytes) + ([nbytes % chunk_bytes] if nbytes % chunk_bytes else [])
        call((buf if n == chunk_bytes else buf[:n] for n in sizes), timeout=600)

    return nbytes / median_seconds(once, repeats=repeats)


def _socket_sink(listener: socket.socket) -> None:
    """Per connection: repeatedly an 8-byte length, that many bytes read in full, a one-byte ack."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_socket_session, args=(conn,), daemon=True).start()


def _socket_session(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the one-byte ack must not wait for Nagle
    with conn:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            left = int.from_bytes(head, "little")
            while left > 0:
                got = conn.recv(min(left, 1 << 20))
                if not got:
                    return
                left -= len(got)
            conn.sendall(b"k")


def _sink_seconds(stub, msg, shaper=None, zstd_level: int = 0) -> tuple[float, int]:
    from swarm.net.stream import tensor_items
    from swarm.proto import stage_pb2

    start = time.perf_counter()
    reply = stub.Sink(tensor_items(stage_pb2.CallInfo(), msg, zstd_level, shaper), timeout=600)
    return time.perf_counter() - start, reply.wire_bytes


def _socket_bytes_per_s(port: int, nbytes: int, repeats: int) -> float:
    """A plain TCP socket on loopback moving `nbytes` with sendall of 1 MiB buffers to the receiver process,
    over one connection kept open (as gRPC keeps its channel), timed until the receiver acknowledges."""
    buf = bytes(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gRPC sets it

        def once() -> None:
            client.sendall(nbytes.to_bytes(8, "little"))
            sent = 0
            while sent < nbytes:
                n = min(len(buf), nbytes - sent)
                client.sendall(buf[:n] if n < len(buf) else buf)
                sent += n
            if client.recv(1, socket.MSG_WAITALL) != b"k":
                raise RuntimeError("the socket receiver closed the connection")

        once()  # warm-up, as the gRPC rows have
        return nbytes / median_seconds(once, repeats=repeats)


def loopback_rows(bench: TransportBench) -> list[dict]:
    from swarm.compression import CodecConfig, make_codec
    from swarm.net.stream import TensorStreams
    from swarm.peers.transport import Channels, TransportConfig

    server = _Receiver()
    channels = Channels(TransportConfig())
    stub = TensorStreams(channels.get(server.address))
    rows = []
    try:
        for size in SIZES if not bench.quick else SIZES[:2]:
            x = torch.randn(size // 4)
            for label in CODECS:
                codec = make_codec(CodecConfig.parse(label))
                msg = codec.encode(x)
                _sink_seconds(stub, msg)  # warm-up
                times = [_sink_seconds(stub, msg) for _ in range(bench.repeats)]
                seconds = sorted(t for t, _ in times)[len(times) // 2]
                wire = times[0][1]
                socket_bps = _socket_bytes_per_s(server.socket_port, wire, bench.repeats)
                raw_bps = _raw_grpc_bytes_per_s(channels.get(server.address), wire, bench.repeats)
                rows.append(
                    {
                        "table": "loopback",
                        "codec": label,
                        "tensor_bytes": size,
                        "wire_bytes": wire,
                        "grpc_wire_mb_s": wire / seconds / 1e6,
                        "tensor_mb_s": size / seconds / 1e6,
                        "socket_mb_s": socket_bps / 1e6,
                        "vs_socket": wire / seconds / socket_bps,
                        # the ceiling gRPC's Python API sets on its own (bytes items, no protobuf)
                        "raw_grpc_mb_s": raw_bps / 1e6,
                        "raw_grpc_vs_socket": raw_bps / socket_bps,
                    }
                )
    finally:
        channels.close()
        server.close()
    return rows


def shaped_rows(bench: TransportBench) -> list[dict]:
    from swarm.compression import CodecConfig, make_codec
    from swarm.net.stream import TensorStreams
    from swarm.peers.shaper import LinkShape, Shaper
    from swarm.peers.transport import Channels, TransportConfig

    server = _Receiver()
    channels = Channels(TransportConfig())
    stub = TensorStreams(channels.get(server.address))
    msg = make_codec(CodecConfig("fp32")).encode(torch.randn(1 << 20))  # 4 MiB messages
    rows = []
    try:
        for rate in (100.0, 1000.0):
            shaper = Shaper(LinkShape.from_mbit(rate))
            seconds = bench.shaped_seconds if not bench.quick else 1.0
            start, moved = time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                moved += _sink_seconds(stub, msg, shaper)[1]
            elapsed = time.perf_counter() - start
            rows.append(
                {
                    "table": "shaped",
                    "rate_mbit": rate,
                    "goodput_mbit": moved * 8 / elapsed / 1e6,
                    "share_of_rate": moved * 8 / elapsed / (rate * 1e6),
                }
            )
    finally:
        channels.close()
        server.close()
    return rows


def shaper_rows(bench: TransportBench) -> list[dict]:
    from swarm.peers.shaper import LinkShape, Shaper

    rows = []
    for rate in RATES_MBIT:
        shape = LinkShape.from_mbit(rate)
        shaper = Shaper(shape)
        shaper.consume(shape.burst)  # the bucket starts full: measure the sustained rate after it
        seconds = 2.0 if not bench.quick else 0.5
        nbytes = int(rate * 1e6 / 8 * seconds)
        start = time.perf_counter()
        for _ in range(nbytes // (64 << 10)):
            shaper.consume(64 << 10)
        elapsed = time.perf_counter() - start
        achieved = (nbytes // (64 << 10)) * (64 << 10) * 8 / elapsed / 1e6
        rows.append({"table": "shaper", "rate_mbit": rate, "achieved_mbit": achieved, "error": achieved / rate - 1})
    return rows


def zstd_rows(bench: TransportBench) -> list[dict]:
    from swarm.compression import CodecConfig, LinkState, ZstdPolicy, codec_class, frame, make_codec, unframe

    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(8, 128, 128, generator=gen)
    rows = []
    for label in ["fp32", "fp16", "directq4", "aqsgd2"]:
        cfg = CodecConfig.parse(label)
        codec, state = make_codec(cfg), LinkState(cfg)
        ids = list(range(acts.shape[0]))
        if codec_class(cfg.name).uses_buffers:
            codec.encode(acts, sample_ids=ids, state=state)  # first sight; measure the steady-state delta
        body = codec.encode(acts + 0.05 * torch.randn(acts.shape, generator=gen), sample_ids=ids, state=state)
        raw = body.SerializeToString()
        # what the framing sends at level 1 (floats split by byte significance, `ZSTD_SPLIT`; anything else one
        # frame), and what compressing and decompressing it adds to framing and unframing it plain
        packed = sum(len(c.data) for c in frame(body, zstd_level=1))
        packed_s = median_seconds(lambda b=body: unframe(frame(b, zstd_level=1)), repeats=bench.repeats)
        plain_s = median_seconds(lambda b=body: unframe(frame(b, zstd_level=0)), repeats=bench.repeats)
        zstd_s = max(packed_s - plain_s, 1e-6)
        policy = ZstdPolicy(level=1, probe_every=1 << 30)
        for _ in range(30):
            policy.observe(len(raw), packed, zstd_s * 3 / 4)
        for rate in RATES_MBIT:
            saved_s = (len(raw) - packed) * 8 / (rate * 1e6)
            rows.append(
                {
                    "table": "zstd",
                    "codec": label,
                    "rate_mbit": rate,
                    "compressed_ratio": packed / len(raw),
                    "saved_ms": saved_s * 1e3,
                    "zstd_ms": zstd_s * 1e3,
                    # the policy's rule: the link time saved must be `margin` times the CPU zstd takes
                    "pays": saved_s > policy.margin * zstd_s,
                    "policy_uses_zstd": policy.level_for(rate * 1e6 / 8) > 0,
                }
            )
    return rows


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    if bench.quick:
        bench = replace(bench, repeats=1)
    tables = [
        ("loopback: gRPC stream vs plain socket", loopback_rows, ["codec", "tensor_bytes", "wire_bytes",
         "grpc_wire_mb_s", "tensor_mb_s", "socket_mb_s", "vs_socket", "raw_grpc_mb_s", "raw_grpc_vs_socket"]),
        ("goodput on shaped links (fp32, 4 MiB messages)", shaped_rows, ["rate_mbit", "goodput_mbit", "share_of_rate"]),
        ("the shaper alone", shaper_rows, ["rate_mbit", "achieved_mbit", "error"]),
        ("does zstd pay? (activations 8x128x128)", zstd_rows, ["codec", "rate_mbit", "compressed_ratio", "saved_ms",
         "zstd_ms", "pays", "policy_uses_zstd"]),
    ]  # fmt: skip
    everything = []
    for title, fn, columns in tables:
        rows = fn(bench)
        everything += rows
        if not bench.json:
            emit(rows, columns, False, title)
            print()
    if bench.json:
        emit(everything, [], True)
    return 0
