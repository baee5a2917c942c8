"""The specification of the quantizer in plain torch: readable, runs on any device; fast paths must match it.

Per group of `group_size` consecutive elements (the last one may be partial), in float32:

1. `lo, hi` = the group's min and max; NaN/Inf anywhere raises ValueError.
2. The grid. `magnitude = max(|lo|, |hi|, hi - lo)`, `e = max(floor(log2(magnitude)) - 22, -126)`,
   `quantum = 2**e`. The stored min and scale are integer multiples of `quantum`:
   `k_lo = floor(lo / quantum)`, `k_hi = ceil(hi / quantum)`, `levels = 2**bits - 1`,
   `steps = ceil((k_hi - k_lo) / levels)` (integer arithmetic), `min = k_lo * quantum`,
   `scale = steps * quantum`. Then `min + levels * scale >= hi`, so the codes cover the group.
   A constant group (`hi == lo`) stores `min = lo`, `scale = 0` and reconstructs exactly.
3. Codes: `v = (x - min) / (scale if scale > 0 else 1)`, `code = floor(v + 0.5)` (nearest) or
   `floor(v + u)` with `u ~ U[0, 1)` (stochastic, unbiased), clamped to `[0, levels]`.
4. Dequantization: `min + code * scale`, in float32.

Why the grid: every number involved is `k * 2**e` with |k| < 2**24, so `code * scale` and `min + code * scale`
are exact in float32. Dequantization therefore has no rounding at all, and gives the same bits on any device,
with or without fused multiply-add, in any evaluation order. The two copies of an AQ-SGD buffer stay
bit-identical even when the sender runs the Triton kernel on a GPU and the receiver runs the CPU path.
The grid costs at most two float32 ulps of the group's largest magnitude on the min, and a relative 2**-22 on
the scale, both far below one quantization step.

Error bounds (step = the stored scale): |x - deQ(Q(x))| <= step/2 for nearest and < step for stochastic
rounding, up to float32 rounding of `v` (relative 2**-24).

The buffer update of AQ-SGD is `m <- (float32(m) + deQ(q)).to(m.dtype)`: one float32 addition and one
round-to-nearest-even cast, both exactly specified by IEEE 754, so sender and receiver agree bit for bit.
"""

from __future__ import annotations

import os

import torch

from .qtensor import (
    MAX_MAGNITUDE,
    SCALE_DTYPE,
    QuantizedTensor,
    check_buffer,
    check_output,
    check_quantize_args,
    check_update_args,
    num_groups,
    packed_nbytes,
    raise_bad_group,
)

__all__ = ["apply_delta", "aqsgd_update", "dequantize", "group_params", "pack", "quantize", "unpack"]

_MANTISSA_BITS = 23
_GRID_BITS = 22  # the quantum is 2**-22 of the group's magnitude (rounded down to a power of two)
_MIN_EXPONENT = -126  # keeps every grid value a normal float32 or zero


def quantize(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True, seed: int | None = None
) -> QuantizedTensor:
    """Quantize `x` (flattened, row-major) per group to `bits`-bit codes; see the module docstring."""
    check_quantize_args(x, bits, group_size)
    flat = x.reshape(-1).float()
    mins, scales = group_params(*_group_min_max(flat, group_size), bits, what="input")
    per_element_min = _per_element(mins, group_size, flat.numel())
    per_element_scale = _per_element(scales, group_size, flat.numel())
    v = (flat - per_element_min) / torch.where(per_element_scale > 0, per_element_scale, 1.0)
    if stochastic:
        generator = torch.Generator(device=flat.device)
        if seed is None:
            generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        else:
            generator.manual_seed(seed)
        u = torch.rand(flat.numel(), generator=generator, device=flat.device, dtype=torch.float32)
    else:
        u = 0.5
    codes = torch.floor(v + u).clamp_(0, 2**bits - 1).to(torch.uint8)
    return QuantizedTensor(pack(codes, bits), scales, mins, bits, group_size, flat.numel())


def dequantize(
    q: QuantizedTensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The 1-D tensor of `q.numel` values `min + code * scale`, computed in float32 then cast to `dtype`.

    With `out` (contiguous, q.numel elements, of `dtype`), the values are written there and `out` is returned.
    """
    check_output(q, dtype, out)
    codes = unpack(q.packed, q.bits, q.numel).float()
    per_element_min = _per_element(q.mins, q.group_size, q.numel)
    per_element_scale = _per_element(q.scales, q.group_size, q.numel)
    values = (per_element_min + codes * per_element_scale).to(dtype)
    if out is None:
        return values
    out.view(-1).copy_(values)
    return out


def apply_delta(m: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """The receiver's AQ-SGD update `m <- (float32(m) + deQ(q)).to(m.dtype)`, in place; returns m."""
    check_buffer(m, q.numel, q.device)
    flat = m.view(-1)
    flat.copy_((flat.float() + dequantize(q)).to(m.dtype))
    return m


def aqsgd_update(
    a: torch.Tensor,
    m: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    stochastic: bool = True,
    seed: int | None = None,
) -> QuantizedTensor:
    """The sender's AQ-SGD step: `q = Q(a - m)`, then `apply_delta(m, q)`; returns q.

    The difference is taken in float32 (`float32(a) - float32(m)`). On ValueError, m is left unchanged here,
    but accelerated backends may have updated part of it: treat the buffer as lost (send the full activation).
    """
    check_update_args(a, m, bits, group_size)
    q = quantize(a.reshape(-1).float() - m.view(-1).float(), bits, group_size, stochastic=stochastic, seed=seed)
    apply_delta(m, q)
    return q


def group_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group stored (min, scale) on the exact grid, from the groups' float32 min and max."""
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    if not bool(finite.all()):
        raise_bad_group(what, int((~finite).nonzero()[0]), nonfinite=True)
    span = hi - lo
    magnitude = torch.maximum(torch.maximum(lo.abs(), hi.abs()), span)
    too_large = magnitude >= MAX_MAGNITUDE
    if bool(too_large.any()):
        raise_bad_group(what, int(too_large.nonzero()[0]), nonfinite=False)
    exponent = ((magnitude.view(torch.int32) >> _MANTISSA_BITS) & 0xFF) - 127  # floor(log2(magnitude))
    e = (exponent - _GRID_BITS).clamp(min=_MIN_EXPONENT)
    quantum = ((e + 127) << _MANTISSA_BITS).view(torch.float32)  # 2**e, exactly
    inverse_quantum = ((127 - e) << _MANTISSA_BITS).view(torch.float32)  # 2**-e, exactly
    k_lo = torch.floor(lo * inverse_quantum)
    k_hi = torch.ceil(hi * inverse_quantum)
    levels = 2**bits - 1
    steps = ((k_hi - k_lo).to(torch.int32) + (levels - 1)) // levels
    constant = span == 0
    mins = torch.where(constant, lo, k_lo * quantum)
    scales = torch.where(constant, 0.0, steps.float() * quantum)
    return mins.to(SCALE_DTYPE), scales.to(SCALE_DTYPE)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, each < 2**bits) to one little-endian bitstream of packed_nbytes(len, bits) bytes."""
    if 8 % bits == 0:  # whole codes per byte: the same bytes as the bitstream below, in 8 / bits shifts
        return _pack_whole(codes, bits)
    return _pack_bits(codes, bits)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack` bit by bit: element-major, least significant bit first (any width)."""
    numel = codes.numel()
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes.reshape(-1, 1) >> shifts) & 1).reshape(-1)  # element-major, least significant bit first
    stream = torch.nn.functional.pad(stream, (0, packed_nbytes(numel, bits) * 8 - stream.numel()))
    byte_shifts = torch.arange(8, device=codes.device, dtype=torch.uint8)
    return (stream.reshape(-1, 8) << byte_shifts).sum(dim=1, dtype=torch.uint8)


def _pack_whole(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack` where a byte holds 8 / bits whole codes: code j of a byte at bits j * bits and up (2-bit codes of a
    [2, 128, 128] message: 0.07 against 0.21 ms bit by bit here, and unpacking 0.08 against 0.27)."""
    per = 8 // bits
    flat = codes.reshape(-1)
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    rows = flat.view(-1, per)
    out = rows[:, 0].clone()
    for j in range(1, per):
        out |= rows[:, j] << (j * bits)
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The inverse of `pack`: `numel` uint8 codes."""
    if 8 % bits == 0:
        mask = (1 << bits) - 1
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        return ((packed.reshape(-1, 1) >> shifts) & mask).reshape(-1)[:numel]
    return _unpack_bits(packed, bits, numel)


def _unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """`unpack` bit by bit (any width)."""
    byte_shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.reshape(-1, 1) >> byte_shifts) & 1).reshape(-1)[: numel * bits]
    shifts = torch.arange(bits, device=packed.device, dtype=torch.uint8)
    return (stream.reshape(numel, bits) << shifts).sum(dim=1, dtype=torch.uint8)


def _group_min_max(flat: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max; the partial last group is padded with copies of its own first element."""
    numel = flat.numel()
    groups = num_groups(numel, group_size)
    if groups == 0:
        empty = flat.new_empty(0)
        return empty, empty
    padding = groups * group_size - numel
    padded = torch.cat([flat, flat[(groups - 1) * group_size].expand(padding)])
    grouped = padded.view(groups, group_size)
    return grouped.amin(dim=1), grouped.amax(dim=1)


def _per_element(per_group: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    return per_group.repeat_interleave(group_size)[:numel]
