"""Framing: a TensorMessage to bounded chunks (zstd when it shrinks the message) and back, with bounds.

The first chunk carries a header (compression, body sizes, and copies of the codec, shape and dtype) so a
receiver can reject an oversized or wrongly shaped tensor before the body arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import zstandard

from swarm.compression.wire import DEFAULT_LIMITS, WireError, WireLimits, check_shape, codec_name
from swarm.proto import wire_pb2

DEFAULT_CHUNK_BYTES = 1 << 20


def frame(
    msg: wire_pb2.TensorMessage, *, zstd_level: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[wire_pb2.Chunk]:
    """Yields the chunks of one message; zstd is skipped when it does not make the body smaller."""
    body = msg.SerializeToString()
    compression = wire_pb2.COMPRESSION_NONE
    if zstd_level > 0 and body:
        packed = zstandard.ZstdCompressor(level=zstd_level).compress(body)
        if len(packed) < len(body):
            body, compression = packed, wire_pb2.ZSTD
    header = wire_pb2.FrameHeader(
        compression=compression,
        body_bytes=len(body),
        raw_body_bytes=msg.ByteSize(),
        codec=msg.codec,
        shape=msg.shape,
        dtype=msg.dtype,
    )
    view = memoryview(body)
    yield wire_pb2.Chunk(header=header, data=bytes(view[:chunk_bytes]))
    for start in range(chunk_bytes, len(body), chunk_bytes):
        yield wire_pb2.Chunk(data=bytes(view[start : start + chunk_bytes]))


class Unframer:
    """Reassembles one message from its chunks, checking every bound as the chunks arrive."""

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS):
        self.limits = limits
        self.header: wire_pb2.FrameHeader | None = None
        self._parts: list[bytes] = []
        self._received = 0

    @property
    def complete(self) -> bool:
        return self.header is not None and self._received == self.header.body_bytes

    def feed(self, chunk: wire_pb2.Chunk) -> wire_pb2.TensorMessage | None:
        """Takes one chunk; returns the message once its last chunk is in."""
        limits = self.limits
        if len(chunk.data) > limits.max_chunk_bytes:
            raise WireError("chunk.data", f"{len(chunk.data)} bytes exceed the chunk limit {limits.max_chunk_bytes}")
        if self.header is None:
            if not chunk.HasField("header"):
                raise WireError("chunk.header", "the first chunk of a message must carry the header")
            self.header = self._check_header(chunk.header)
        elif chunk.HasField("header"):
            raise WireError("chunk.header", "a header arrived in the middle of a message")
        self._received += len(chunk.data)
        if self._received > self.header.body_bytes:
            raise WireError("chunk.data", f"more bytes than the header's body_bytes={self.header.body_bytes}")
        self._parts.append(chunk.data)
        return self._finish() if self.complete else None

    def _check_header(self, header: wire_pb2.FrameHeader) -> wire_pb2.FrameHeader:
        limits = self.limits
        for field in ("body_bytes", "raw_body_bytes"):
            if getattr(header, field) > limits.max_message_bytes:
                raise WireError(
                    f"header.{field}", f"{getattr(header, field)} exceeds the limit {limits.max_message_bytes}"
                )
        if header.compression not in (wire_pb2.COMPRESSION_NONE, wire_pb2.ZSTD):
            raise WireError("header.compression", f"unknown compression enum {header.compression}")
        if header.codec not in wire_pb2.Codec.values() or header.codec == wire_pb2.CODEC_UNSPECIFIED:
            raise WireError("header.codec", f"unknown codec enum {header.codec}")
        check_shape(list(header.shape), limits, "header.shape")
        return header

    def _finish(self) -> wire_pb2.TensorMessage:
        header, body = self.header, b"".join(self._parts)
        if header.compression == wire_pb2.ZSTD:
            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=header.raw_body_bytes)
            except zstandard.ZstdError as e:
                raise WireError("body", f"zstd frame is corrupt: {e}") from e
        if len(body) != header.raw_body_bytes:
            raise WireError("header.raw_body_bytes", f"body has {len(body)} bytes, header says {header.raw_body_bytes}")
        msg = wire_pb2.TensorMessage()
        try:
            msg.ParseFromString(body)
        except Exception as e:  # protobuf raises DecodeError, or RuntimeError on some malformed inputs
            raise WireError("body", f"not a TensorMessage: {e}") from e
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


def wire_nbytes(msg: wire_pb2.TensorMessage, zstd_level: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Bytes the message costs on the wire once framed (chunk envelopes included)."""
    return sum(c.ByteSize() for c in frame(msg, zstd_level=zstd_level, chunk_bytes=chunk_bytes))
