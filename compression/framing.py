"""Framing: a TensorMessage to bounded chunks (zstd when it shrinks the message) and back, with bounds.

The first chunk carries a header (compression, body sizes, and copies of the codec, shape and dtype) so a
receiver can reject an oversized or wrongly shaped tensor before the body arrives.

A message whose payload is floats (`raw`: the fp32/fp16/bf16 codecs, AQ-SGD's first sights) is compressed by byte
significance instead (`ZSTD_SPLIT`, `split_float_bytes`): the top byte of each element (the sign and the high
exponent bits) is one zstd frame, the other bytes another. One zstd frame over the whole message codes every byte
with one table, which the near-random low bytes decide: on the default model's fp32 activations it saves 7.7%, the
split 15.6% (bf16: 22% against 31%), for 0.21 ms against 0.12 ms to frame a 128 KiB message and 0.10 against 0.11
to unframe it (`scripts/measure_float_split.py`). The same idea as ZipNN's and blosc's byte grouping; lossless, so
the fp32 codec stays exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import zstandard

from swarm.compression.wire import DEFAULT_LIMITS, WireError, WireLimits, check_shape, codec_name
from swarm.proto import wire_pb2

DEFAULT_CHUNK_BYTES = 1 << 20
SPLIT_MIN_BYTES = 4096
"""A float payload below this goes as one zstd frame (`ZSTD`): two frames' headers would eat what the split saves."""
FLOAT_WIDTHS = {wire_pb2.FLOAT32: 4, wire_pb2.FLOAT16: 2, wire_pb2.BFLOAT16: 2}
"""Bytes an element of each float `raw_dtype`."""


_zstd = threading.local()


def zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor at `level`. Making one costs 19 us and compressing a few-KB message 3: the default's
    messages took 22 us each to compress instead of 3, which made the policy take zstd for slow and leave it off
    at 100 Mbit/s. A compressor may not be used by two threads at once, hence one per thread."""
    cache = _zstd.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def zstd_decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (one costs 16 us to make, a few-KB frame 1 to decompress)."""
    if "decompressor" not in _zstd.__dict__:
        _zstd.decompressor = zstandard.ZstdDecompressor()
    return _zstd.decompressor


def decompress_at_most(data: bytes, most: int, field: str) -> bytes:
    """The zstd frame `data` decompressed, if it holds at most `most` bytes; WireError naming `field` otherwise.

    python-zstandard's `max_output_size` bounds only a frame that does not state its size: one that does gets an
    output buffer of the size it states, so 8 KB of frame stating 256 MiB took 256 MiB before any check (the
    framing's ZSTD bodies and token batches did). The stated size is read from the frame's header first."""
    try:
        stated = zstandard.frame_content_size(data)  # -1: not stated, then max_output_size bounds the output
        if stated > most:
            raise WireError(field, f"a zstd frame stating {stated} bytes, more than the {most} it may hold")
        return zstd_decompressor().decompress(data, max_output_size=most)
    except zstandard.ZstdError as e:
        raise WireError(field, f"not a zstd frame of at most {most} bytes: {e}") from None


def split_float_bytes(msg: wire_pb2.TensorMessage, level: int) -> wire_pb2.TensorMessage | None:
    """A copy of `msg` whose `raw` travels as a `ByteSplit`, or None where `msg` has no float payload to split."""
    width = FLOAT_WIDTHS.get(msg.raw_dtype)
    raw = msg.raw
    if width is None or len(raw) < SPLIT_MIN_BYTES or len(raw) % width or msg.HasField("raw_split"):
        return None
    count = len(raw) // width
    # planes: every element's byte 0, then every element's byte 1, ...; the last plane is the top byte
    planes = np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(count, width).T)
    compressor = zstd_compressor(level)  # compresses the planes where they lie (any buffer): no copy to bytes first
    low = planes[:-1]
    packed = compressor.compress(low)  # near-random bytes: zstd stores them in a few us; zeros shrink to nothing
    out = wire_pb2.TensorMessage()
    out.CopyFrom(msg)
    out.ClearField("raw")
    out.raw_split.count = count
    out.raw_split.top = compressor.compress(planes[-1])
    if len(packed) < low.size:
        out.raw_split.low, out.raw_split.low_zstd = packed, True
    else:
        out.raw_split.low = low.tobytes()
    return out


def join_float_bytes(msg: wire_pb2.TensorMessage, most_raw_bytes: int) -> None:
    """Undoes `split_float_bytes` in place: `msg.raw` from `msg.raw_split`, which must hold a whole float payload
    of at most `most_raw_bytes` (the frame header's raw size, itself bounded by the limits). Raises WireError."""
    width = FLOAT_WIDTHS.get(msg.raw_dtype)
    split = msg.raw_split
    if width is None:
        raise WireError("raw_split", f"a byte split needs a float raw_dtype, not enum {msg.raw_dtype}")
    if msg.raw:
        raise WireError("raw", "comes beside raw_split")
    count = split.count
    if count == 0 or count * width > most_raw_bytes:
        raise WireError("raw_split.count", f"{count} elements of {width} bytes for at most {most_raw_bytes} bytes")

    def part(field: str, data: bytes, size: int, packed: bool) -> np.ndarray:
        if packed:
            data = decompress_at_most(data, size, f"raw_split.{field}")
        if len(data) != size:
            raise WireError(f"raw_split.{field}", f"{len(data)} bytes for {count} elements, expected {size}")
        return np.frombuffer(data, np.uint8)

    out = np.empty((count, width), np.uint8)  # each plane written into its column: one pass, no transposed copy
    out[:, -1] = part("top", split.top, count, True)
    low = part("low", split.low, count * (width - 1), split.low_zstd)
    for i in range(width - 1):
        out[:, i] = low[i * count : (i + 1) * count]
    msg.ClearField("raw_split")
    msg.raw = out.tobytes()


@dataclass
class ZstdPolicy:
    """Decides per link whether zstd pays: it does when the time its saved bytes take on the link exceeds `margin`
    times the CPU time compressing and decompressing them takes, i.e. when
    `rate < saved_fraction * zstd_bytes_per_s / margin`.

    Estimates are running means from the messages actually compressed; while zstd is off, every
    `probe_every`-th message is compressed anyway, so a change in the data or the link is noticed.
    """

    level: int = 1
    adaptive: bool = True
    """False: compress every message at `level` whatever the link (the framing keeps the smaller body), as an
    in-process pipeline that stands for a slow link does"""
    probe_every: int = 16
    saved_fraction: float = 0.5
    """running mean of 1 - compressed/raw"""
    zstd_bytes_per_s: float = 200e6
    """running mean of raw bytes per second of compress + decompress (decompress taken as 1/3 of compress), from
    the compressing thread's CPU time"""
    margin: float = 2.0
    """how many times its CPU the link time zstd saves must be: that CPU is taken from the stages' compute on the same
    cores at both ends, the link's time is not. At 1 this policy turned zstd on for fp32 on the namespace testbed's
    1000 Mbit/s links (0.23 ms of link saved a 128 KiB message, against 0.21 ms of CPU), where every step is short of
    CPU, and those cells ran 4% slower in two runs of three"""
    _messages: int = 0

    def level_for(self, rate_bytes_per_s: float | None) -> int:
        """The zstd level to frame the next message with on a link of this rate (None: unshaped)."""
        if self.level == 0 or not self.adaptive:
            return self.level
        self._messages += 1
        if self._messages % self.probe_every == 0:
            return self.level
        if rate_bytes_per_s is None:
            return 0
        return self.level if rate_bytes_per_s * self.margin < self.saved_fraction * self.zstd_bytes_per_s else 0

    def observe(self, raw_bytes: int, compressed_bytes: int, seconds: float) -> None:
        if raw_bytes < 4096 or seconds <= 0:
            return
        saved = max(0.0, 1 - compressed_bytes / raw_bytes)
        speed = raw_bytes / (seconds * 4 / 3)
        self.saved_fraction = 0.8 * self.saved_fraction + 0.2 * saved
        self.zstd_bytes_per_s = 0.8 * self.zstd_bytes_per_s + 0.2 * speed


def frame(
    msg: wire_pb2.TensorMessage,
    *,
    zstd_level: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    policy: ZstdPolicy | None = None,
) -> Iterator[wire_pb2.Chunk]:
    """Yields the chunks of one message; zstd is skipped when it does not make the body smaller.

    With a `policy`, what compression achieved (size and time) is reported to it.
    """
    for header, data in frame_parts(msg, zstd_level=zstd_level, chunk_bytes=chunk_bytes, policy=policy):
        yield wire_pb2.Chunk(header=header, data=data) if header is not None else wire_pb2.Chunk(data=data)


def frame_parts(
    msg: wire_pb2.TensorMessage,
    *,
    zstd_level: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    policy: ZstdPolicy | None = None,
) -> Iterator[tuple[wire_pb2.FrameHeader | None, bytes]]:
    """What `frame` puts in each chunk, (header or None, data), for callers that build their own envelope
    around the data (a stream item) and would otherwise copy every chunk once more."""
    body = msg.SerializeToString()
    raw_bytes = len(body)  # not msg.ByteSize(): upb serializes the whole message again to count it
    compression = wire_pb2.COMPRESSION_NONE
    if zstd_level > 0 and body:
        # the thread's own CPU time, not the wall clock: zstd lets the GIL go, and on a busy process the wait to
        # take it back (up to the 5 ms switch interval) dwarfed a small message's compression, so the policy took
        # zstd for slow and turned it off wherever messages were a few KB (the default's, at 100 Mbit/s)
        start = time.thread_time()
        split = split_float_bytes(msg, zstd_level)
        if split is not None:
            packed, packed_as = split.SerializeToString(), wire_pb2.ZSTD_SPLIT
        else:
            packed, packed_as = zstd_compressor(zstd_level).compress(body), wire_pb2.ZSTD
        if policy is not None:
            policy.observe(len(body), len(packed), time.thread_time() - start)
        # a body that shrinks past what receivers accept (DEFAULT_LIMITS) goes uncompressed: it is all zeros
        # or alike, and a receiver would take it for a decompression bomb
        if len(packed) < len(body) <= DEFAULT_LIMITS.max_raw_bytes(len(packed)):
            body, compression = packed, packed_as
    header = wire_pb2.FrameHeader(
        compression=compression,
        body_bytes=len(body),
        raw_body_bytes=raw_bytes,
        codec=msg.codec,
        shape=msg.shape,
        dtype=msg.dtype,
    )
    if len(body) <= chunk_bytes:
        yield header, body
        return
    view = memoryview(body)
    yield header, bytes(view[:chunk_bytes])
    for start in range(chunk_bytes, len(body), chunk_bytes):
        yield None, bytes(view[start : start + chunk_bytes])


class Unframer:
    """Reassembles one message from its chunks, checking every bound as the chunks arrive."""

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS):
        self.limits = limits
        self.header: wire_pb2.FrameHeader | None = None
        self._parts: list[bytes] = []
        self._received = 0

    @property
    def received_bytes(self) -> int:
        """Body bytes taken so far."""
        return self._received

    @property
    def complete(self) -> bool:
        return self.header is not None and self._received == self.header.body_bytes

    def feed(self, chunk: wire_pb2.Chunk) -> wire_pb2.TensorMessage | None:
        """Takes one chunk; returns the message once its last chunk is in."""
        limits = self.limits
        data = chunk.data  # each read of a bytes field copies it out of protobuf: read it once
        if len(data) > limits.max_chunk_bytes:
            raise WireError("chunk.data", f"{len(data)} bytes exceed the chunk limit {limits.max_chunk_bytes}")
        if self.header is None:
            if not chunk.HasField("header"):
                raise WireError("chunk.header", "the first chunk of a message must carry the header")
            self.header = self._check_header(chunk.header)
        elif chunk.HasField("header"):
            raise WireError("chunk.header", "a header arrived in the middle of a message")
        self._received += len(data)
        if self._received > self.header.body_bytes:
            raise WireError("chunk.data", f"more bytes than the header's body_bytes={self.header.body_bytes}")
        self._parts.append(data)
        return self._finish() if self.complete else None

    def check_header(self, header: wire_pb2.FrameHeader) -> wire_pb2.FrameHeader:
        """Checks a frame header against the limits without taking it (raises WireError); returns it."""
        return self._check_header(header)

    def _check_header(self, header: wire_pb2.FrameHeader) -> wire_pb2.FrameHeader:
        limits = self.limits
        for field in ("body_bytes", "raw_body_bytes"):
            if getattr(header, field) > limits.max_message_bytes:
                raise WireError(
                    f"header.{field}", f"{getattr(header, field)} exceeds the limit {limits.max_message_bytes}"
                )
        if header.compression not in (wire_pb2.COMPRESSION_NONE, wire_pb2.ZSTD, wire_pb2.ZSTD_SPLIT):
            raise WireError("header.compression", f"unknown compression enum {header.compression}")
        packed = header.compression != wire_pb2.COMPRESSION_NONE
        if packed and header.raw_body_bytes > limits.max_raw_bytes(header.body_bytes):
            raise WireError(
                "header.raw_body_bytes",
                f"{header.raw_body_bytes} bytes from a {header.body_bytes}-byte zstd body exceed the ratio limit "
                f"{limits.max_zstd_ratio} (a decompression bomb?)",
            )
        if header.compression == wire_pb2.COMPRESSION_NONE and header.raw_body_bytes != header.body_bytes:
            raise WireError("header.raw_body_bytes", f"{header.raw_body_bytes} for an uncompressed {header.body_bytes}")
        if header.codec not in wire_pb2.Codec.values() or header.codec == wire_pb2.CODEC_UNSPECIFIED:
            raise WireError("header.codec", f"unknown codec enum {header.codec}")
        check_shape(list(header.shape), limits, "header.shape")
        return header

    def _finish(self) -> wire_pb2.TensorMessage:
        header, body = self.header, b"".join(self._parts)
        if header.compression == wire_pb2.ZSTD:
            body = decompress_at_most(body, header.raw_body_bytes, "body")
        if header.compression != wire_pb2.ZSTD_SPLIT and len(body) != header.raw_body_bytes:
            raise WireError("header.raw_body_bytes", f"body has {len(body)} bytes, header says {header.raw_body_bytes}")
        msg = wire_pb2.TensorMessage()
        try:
            msg.ParseFromString(body)
        except Exception as e:  # protobuf raises DecodeError, or RuntimeError on some malformed inputs
            raise WireError("body", f"not a TensorMessage: {e}") from e
        if header.compression == wire_pb2.ZSTD_SPLIT:
            if not msg.HasField("raw_split"):
                raise WireError("raw_split", "missing from a ZSTD_SPLIT frame")
            join_float_bytes(msg, header.raw_body_bytes)
        elif msg.HasField("raw_split"):
            raise WireError("raw_split", f"in a frame of compression enum {header.compression}, not ZSTD_SPLIT")
        if msg.codec != header.codec or list(msg.shape) != list(header.shape) or msg.dtype != header.dtype:
            raise WireError(
                "header",
                f"says {codec_name(header.codec)} {list(header.shape)}, body is {codec_name(msg.codec)} "
                f"{list(msg.shape)}",
            )
        return msg


def unframe(chunks: Iterable[wire_pb2.Chunk], limits: WireLimits = DEFAULT_LIMITS) -> wire_pb2.TensorMessage:
    """The one message carried by `chunks` (all of them)."""
    unframer = Unframer(limits)
    msg = None
    for chunk in chunks:
        if msg is not None:
            raise WireError("chunk", "data after the end of the message")
        msg = unframer.feed(chunk)
    if msg is None:
        raise WireError("chunk", "the stream ended before the message was complete")
    return msg
