"""Tensors to and from protobuf bytes, and the bounds every message from the network is checked against.

Nothing from the network is ever unpickled: a tensor is its shape, an explicit dtype enum and raw
little-endian bytes, and every length is checked against the shape before a byte is interpreted.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from swarm.proto import wire_pb2

if sys.byteorder != "little":  # the wire is little-endian and tensors are sent as their memory
    raise ImportError("swarm's wire format needs a little-endian machine")

TORCH_TO_WIRE = {torch.float32: wire_pb2.FLOAT32, torch.float16: wire_pb2.FLOAT16, torch.bfloat16: wire_pb2.BFLOAT16}
WIRE_TO_TORCH = {v: k for k, v in TORCH_TO_WIRE.items()}
ITEMSIZE = {wire_pb2.FLOAT32: 4, wire_pb2.FLOAT16: 2, wire_pb2.BFLOAT16: 2}


class WireError(ValueError):
    """A message from the network that breaks the format or its bounds; names the offending field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class WireLimits:
    """Bounds a receiver enforces on every message before decoding it."""

    max_dims: int = 8
    """most dimensions a tensor may have"""
    max_numel: int = 1 << 30
    """most elements a tensor may have"""
    max_message_bytes: int = 512 << 20
    """most bytes of one framed message, compressed or not"""
    max_chunk_bytes: int = 4 << 20
    """most bytes of one chunk's data"""
    max_zstd_ratio: int = 64
    """most raw bytes a zstd body may expand to per compressed byte (real messages reach about 1.1-1.6; a
    decompression bomb reaches thousands): checked from the header, before any body byte is read"""
    zstd_slack_bytes: int = 64 << 10
    """raw bytes any zstd body may expand to beyond the ratio, so tiny (highly compressible) messages pass"""

    def max_raw_bytes(self, body_bytes: int) -> int:
        """Most raw bytes a zstd body of `body_bytes` may expand to."""
        return self.max_zstd_ratio * body_bytes + self.zstd_slack_bytes


DEFAULT_LIMITS = WireLimits()


def wire_dtype(dtype: torch.dtype) -> int:
    if dtype not in TORCH_TO_WIRE:
        raise TypeError(f"dtype {dtype} cannot travel on the wire; use float32, float16 or bfloat16")
    return TORCH_TO_WIRE[dtype]


def torch_dtype(value: int, field: str = "dtype") -> torch.dtype:
    if value not in WIRE_TO_TORCH:
        raise WireError(field, f"unknown dtype enum {value}")
    return WIRE_TO_TORCH[value]


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements, row-major, little-endian."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()  # a device tensor: copied


def bytes_to_tensor(data: bytes, dtype: torch.dtype, numel: int, field: str) -> torch.Tensor:
    """A fresh writable 1-D tensor from `data`, whose length must match `numel` elements of `dtype`."""
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise WireError(field, f"has {len(data)} bytes, expected {expected} for {numel} x {dtype}")
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)


def check_shape(shape: list[int] | tuple[int, ...], limits: WireLimits, field: str = "shape") -> int:
    """Checks dims and total size; returns the number of elements."""
    if len(shape) > limits.max_dims:
        raise WireError(field, f"{len(shape)} dims exceed the limit of {limits.max_dims}")
    if any(d > limits.max_numel for d in shape):  # also when another dim is 0: torch cannot size such a tensor
        raise WireError(field, f"a dimension exceeds the limit of {limits.max_numel} elements")
    numel = math.prod(shape)
    if numel > limits.max_numel:
        raise WireError(field, f"{numel} elements exceed the limit of {limits.max_numel}")
    return numel


def codec_name(value: int) -> str:
    try:
        return wire_pb2.Codec.Name(value)
    except ValueError:
        return f"<unknown {value}>"
