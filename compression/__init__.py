"""Codecs, AQ-SGD message buffers and zstd framing: tensors to wire messages and back."""

from swarm.compression.buffers import BufferStore, MemoryBufferStore, MmapBufferStore
from swarm.compression.codecs import (
    REGISTRY,
    BufferMissError,
    Codec,
    decoder_for,
    make_codec,
    quantized_nbytes,
)
from swarm.compression.config import CODEC_NAMES, CodecConfig
from swarm.compression.framing import Unframer, ZstdPolicy, frame, unframe
from swarm.compression.state import LinkState
from swarm.compression.wire import DEFAULT_LIMITS, WireError, WireLimits

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_LIMITS",
    "REGISTRY",
    "BufferMissError",
    "BufferStore",
    "Codec",
    "CodecConfig",
    "LinkState",
    "MemoryBufferStore",
    "MmapBufferStore",
    "Unframer",
    "WireError",
    "WireLimits",
    "ZstdPolicy",
    "decoder_for",
    "frame",
    "make_codec",
    "quantized_nbytes",
    "unframe",
]
