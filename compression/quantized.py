"""A per-group quantized tensor on the wire: packing it into a `Quantized` message, checking and unpacking one."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, torch_dtype, wire_dtype
from swarm.kernels import DEFAULT_GROUP_SIZE, QuantizedTensor, packed_nbytes, quantize
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.config import CodecConfig

SUPPORTED_BITS = (2, 3, 4, 8)
"""Bit widths the kernels pack (and the only ones a receiver accepts)."""
FP32_MAX = torch.finfo(torch.float32).max


def group_size(config: CodecConfig) -> int:
    """The quantization group a config asks for (None: the kernels' measured default)."""
    return config.group_size or DEFAULT_GROUP_SIZE


@functools.cache
def _scale_itemsize() -> int:
    return quantize(torch.zeros(1), 8, 1, stochastic=False).scales.element_size()


def quantized_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Wire bytes of a quantized tensor: the packed payload plus a scale and a minimum per group."""
    return packed_nbytes(numel, bits) + 2 * math.ceil(numel / group_size) * _scale_itemsize()


def pack_quantized(q: QuantizedTensor, out: wire_pb2.Quantized) -> None:
    out.bits, out.group_size, out.numel = q.bits, q.group_size, q.numel
    out.scale_dtype = wire_dtype(q.scales.dtype)
    out.scales = tensor_to_bytes(q.scales)
    out.mins = tensor_to_bytes(q.mins)
    out.payload = q.packed.numpy().tobytes()


def unpack_quantized(msg: wire_pb2.Quantized, numel: int, field: str, bound: float = FP32_MAX) -> QuantizedTensor:
    """The quantized tensor of `msg`, every length and bound checked against `numel` first.

    Args:
        msg: the message from the network.
        numel: elements the shape implies.
        field: the message field, named in errors.
        bound: largest magnitude a decoded value may reach (what the tensor it lands in holds): a finite but
            huge scale would otherwise decode to Inf after a cast, or poison a buffer for good.
    """
    if msg.bits not in SUPPORTED_BITS:
        raise WireError(f"{field}.bits", f"unsupported bit width {msg.bits}")
    if not 1 <= msg.group_size <= 65536:
        raise WireError(f"{field}.group_size", f"{msg.group_size} is outside 1..65536")
    if msg.numel != numel:
        raise WireError(f"{field}.numel", f"{msg.numel} does not match the {numel} elements the shape implies")
    if len(msg.payload) != packed_nbytes(numel, msg.bits):
        raise WireError(
            f"{field}.payload",
            f"{len(msg.payload)} bytes, expected {packed_nbytes(numel, msg.bits)} for {numel} x {msg.bits} bits",
        )
    groups = math.ceil(numel / msg.group_size)
    scale_dtype = torch_dtype(msg.scale_dtype, f"{field}.scale_dtype")
    scales = bytes_to_tensor(msg.scales, scale_dtype, groups, f"{field}.scales")
    mins = bytes_to_tensor(msg.mins, scale_dtype, groups, f"{field}.mins")
    if groups:
        check_group_bounds(scales, mins, msg.bits, field, bound)
    packed = bytes_to_tensor(msg.payload, torch.uint8, len(msg.payload), f"{field}.payload")
    return QuantizedTensor(packed, scales, mins, msg.bits, msg.group_size, numel)


def check_group_bounds(scales: torch.Tensor, mins: torch.Tensor, bits: int, field: str, bound: float) -> None:
    """Refuses groups whose values `min + code * scale` (code in 0..2^bits-1) could leave [-bound, bound].

    The extremes of a group are its endpoints, `min` and `min + (2^bits-1) * scale`, computed in float64 so
    that the check itself cannot overflow; NaN fails every comparison and is refused too.
    """
    lo = mins.double()
    hi = lo + scales.double() * (2**bits - 1)
    if not bool(torch.isfinite(scales).all()):
        raise WireError(f"{field}.scales", "contains NaN or Inf")
    if not bool(torch.isfinite(mins).all()):
        raise WireError(f"{field}.mins", "contains NaN or Inf")
    if not bool((lo.abs() <= bound).all()):
        raise WireError(f"{field}.mins", f"a group's minimum exceeds {bound:.6g} in magnitude")
    if not bool((hi.abs() <= bound).all()):
        raise WireError(f"{field}.scales", f"a group's values would exceed {bound:.6g} in magnitude")
