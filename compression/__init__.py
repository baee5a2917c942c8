"""Codecs, AQ-SGD message buffers and zstd framing: tensors to wire messages and back."""

from swarm.compression.buffers import BufferStore, MemoryBufferStore, MmapBufferStore
from swarm.compression.codec_aqsgd import BufferDriftError, BufferMissError, buffer_digest
from swarm.compression.codec_base import Codec
from swarm.compression.codec_config import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.compression.codecs import CODEC_NAMES, REGISTRY, codec_class, codec_labels, decoder_for, make_codec
from swarm.compression.framing import Unframer, ZstdPolicy, frame, unframe
from swarm.compression.quantized import quantized_nbytes
from swarm.compression.state import LinkState
from swarm.compression.wire import DEFAULT_LIMITS, WireError, WireLimits

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_BACKWARD_CODEC",
    "DEFAULT_FORWARD_CODEC",
    "DEFAULT_LIMITS",
    "REGISTRY",
    "BufferDriftError",
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
    "buffer_digest",
    "codec_class",
    "codec_labels",
    "decoder_for",
    "frame",
    "make_codec",
    "quantized_nbytes",
    "unframe",
]
