"""A per-group quantized tensor on the wire: packing it into a `Quantized` message, checking and unpacking one."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, torch_dtype, wire_dtype
from swarm.kernels import DEFAULT_GROUP_SIZE, QuantizedTensor, packed_nbytes, quantize
from swarm.kernels.reference import pack
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.codec_config import CodecConfig

SCALE_DTYPES = ("float32", "bfloat16", "auto")
"""How a gradq message's per-group (scale, min) pairs travel: float32 (64 bits a group), bfloat16 (32 bits), or
auto: float16 (32 bits, 3 more mantissa bits) when every pair is a normal float16, bfloat16 otherwise, per
message. The message's `scale_dtype` says which."""
FP16_NORMAL = (2.0**-14, 65504.0)
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


def pack_quantized(q: QuantizedTensor, out: wire_pb2.Quantized, scale_dtype: torch.dtype | None = None) -> None:
    """Writes `q` into `out`; `scale_dtype` (default: q's own) must hold q's scales and mins exactly."""
    dtype = scale_dtype or q.scales.dtype
    out.bits, out.group_size, out.numel = q.bits, q.group_size, q.numel
    out.scale_dtype = wire_dtype(dtype)
    out.scales = tensor_to_bytes(q.scales.to(dtype))
    out.mins = tensor_to_bytes(q.mins.to(dtype))
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
    return QuantizedTensor(packed, scales.float(), mins.float(), msg.bits, msg.group_size, numel)


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


def compact_dtype(choice: str, mins: torch.Tensor, scales: torch.Tensor) -> torch.dtype:
    """The 16-bit dtype `choice` (an entry of SCALE_DTYPES other than float32) picks for these group pairs."""
    if choice == "bfloat16":
        return torch.bfloat16
    pairs = torch.cat((mins.abs(), scales.abs()))
    nonzero = pairs[pairs > 0]
    lo, hi = FP16_NORMAL
    # float16 when every pair (with the rounding slack below) stays a normal float16
    fits = not nonzero.numel() or bool((nonzero.min() >= lo) & (nonzero.max() * 1.01 <= hi))
    return torch.float16 if fits else torch.bfloat16


def _round_down(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r = v.to(dtype)
    return torch.where(r.float() > v, torch.nextafter(r, torch.tensor(-torch.inf, dtype=dtype)), r).float()


def _round_up(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r = v.to(dtype)
    return torch.where(r.float() < v, torch.nextafter(r, torch.tensor(torch.inf, dtype=dtype)), r).float()


def quantize_compact(
    x: torch.Tensor, bits: int, group: int, choice: str, *, stochastic: bool, seed: int | None
) -> tuple[QuantizedTensor, torch.dtype]:
    """Per-group quantization whose (min, scale) pairs are exact in a 16-bit dtype (chosen by `choice`).

    The min is rounded down and the scale up to that dtype, so `min + (2^bits-1) * scale` still covers the
    group; codes then use the rounded pair (stochastic rounding stays unbiased against it). Returns the
    quantized tensor (float32 pairs, exactly representable in the dtype) and the dtype to send them in.
    """
    flat = x.reshape(-1).float()
    numel, levels = flat.numel(), 2**bits - 1
    groups = math.ceil(numel / group)
    padded = torch.nn.functional.pad(flat, (0, groups * group - numel))
    view = padded.view(groups, group)
    lo, hi = view.amin(dim=1), view.amax(dim=1)
    if numel % group:  # the padded zeros of the last group must not widen its range
        tail = flat[(groups - 1) * group :]
        lo[-1], hi[-1] = tail.min(), tail.max()
    dtype = compact_dtype(choice, lo, (hi - lo) / levels)
    mins = _round_down(lo, dtype)
    scales = _round_up((hi - mins) / levels, dtype)
    v = (view - mins[:, None]) / torch.where(scales > 0, scales, 1.0)[:, None]
    if stochastic:
        generator = torch.Generator(device=flat.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(1 << 62, ())))
        v = v + torch.rand(v.shape, generator=generator, device=flat.device)
    else:
        v = v + 0.5
    codes = torch.floor(v).clamp_(0, levels).to(torch.uint8).reshape(-1)[:numel]
    return QuantizedTensor(pack(codes, bits), scales.contiguous(), mins.contiguous(), bits, group, numel), dtype
