"""The symmetric max-abs quantizer of AC-SGD (the `acsgd` codec's), in plain torch: the specification that the
C++ (`cpu`) and Triton (`triton_sym`) paths match bit for bit, codes, scales and buffers.

Per group of `group_size` consecutive elements (the last one may be partial), in float32, `half = 2**(bits-1)`:

1. `scale = float16(min(max |x|, 65504))` (round to nearest even); NaN/Inf anywhere raises ValueError.
2. `step = float32(scale) / half` (exact: a power-of-two division of an fp16 value); the quantizer divides by
   `max(step, 2**-126)` so an all-zero group codes to `half`.
3. `t = x / max(step, 2**-126)`; nearest: `round(t)` (half to even, torch.round); stochastic: `floor(t + u)`,
   `u = (mix32((i mod 2**32) xor key) >> 8) * 2**-24` with `i` the element's index in the flat tensor and
   `key = k0 xor mix32(k1)` from the seed (`mix32` is lowbias32, the keys splitmix64 of the seed: the same
   noise as the asymmetric C++ kernels, computable on any backend, so stochastic codes agree too).
4. `code = clip(t, -half, half - 1) + half` (uint8), packed little-endian `bits` bits each (`reference.pack`).
5. Decoded: `(code - half) * step`, exact in float32 (an 11-bit mantissa times an integer below 2**8).

The AQ-SGD update: `delta = float32(a) - float32(m)`, `q = Q(delta)`, `m <- (float32(m) + deQ(q)).to(m.dtype)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .qtensor import all_finite, num_groups, packed_nbytes
from .reference import pack, unpack

__all__ = ["SymQuantized", "apply_delta", "check_sym_args", "dequantize", "keys", "noise", "quantize", "update"]

FP16_MAX = float(torch.finfo(torch.float16).max)
TINY = torch.finfo(torch.float32).tiny
MAX_NUMEL = 1 << 32  # element indices key the noise in 32 bits


@dataclass(frozen=True)
class SymQuantized:
    """Packed codes (uint8, packed_nbytes(numel, bits)) and fp16 scales (one per group), on one device."""

    packed: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    numel: int

    @property
    def device(self) -> torch.device:
        return self.packed.device


def check_sym_args(numel: int, bits: int, group_size: int) -> None:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 2, 3, 4 or 8, got {bits}")
    if not 1 <= group_size <= 65536:
        raise ValueError(f"group_size must be in 1..65536, got {group_size}")
    if numel >= MAX_NUMEL:
        raise ValueError(f"at most 2**32 - 1 elements, got {numel}")


def keys(seed: int | None) -> tuple[int, int]:
    """Two 32-bit hash keys from the seed (splitmix64), or from the OS's entropy when seed is None."""
    z = int.from_bytes(os.urandom(8), "little") if seed is None else seed & (2**64 - 1)
    z = (z + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    z ^= z >> 31
    return z & 0xFFFFFFFF, z >> 32


def mix32_int(x: int) -> int:
    """lowbias32 (C. Wellons) on a Python int."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x < 2**32, without overflowing int64."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & 0xFFFFFFFF


def noise(numel: int, k0: int, k1: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The stochastic rounding offsets u in [0, 1) of elements 0..numel-1 (float32), step 3 of the spec."""
    x = torch.arange(numel, dtype=torch.int64, device=device) ^ (k0 ^ mix32_int(k1))
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return (x >> 8).float() * 2.0**-24


def quantize(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = None
) -> SymQuantized:
    """Quantize `x` (flattened; fp32/fp16/bf16) per group of `group_size`; see the module docstring."""
    codes, scales = quantize_codes(x, bits, group_size, stochastic=stochastic, seed=seed)
    return SymQuantized(pack(codes, bits), scales, bits, group_size, codes.numel())


def quantize_codes(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unpacked codes (uint8, flattened) and the fp16 scales of `quantize`."""
    v = x.detach().reshape(-1).float()
    check_sym_args(v.numel(), bits, group_size)
    if not all_finite(v):
        raise ValueError("the tensor to quantize has NaN or Inf")
    half = 1 << (bits - 1)
    pad = (-v.numel()) % group_size
    g = torch.cat([v, v.new_zeros(pad)]).view(-1, group_size) if pad else v.view(-1, group_size)
    scales = g.abs().amax(1).clamp(max=FP16_MAX).half() if g.numel() else g.new_empty(0, dtype=torch.float16)
    step = (scales.float() / half).clamp_min(TINY)[:, None]
    t = g / step
    u = noise(g.numel(), *keys(seed), device=v.device).view(g.shape) if stochastic else None
    t = torch.floor(t + u) if stochastic else torch.round(t)
    codes = (t.clamp(-half, half - 1) + half).to(torch.uint8).reshape(-1)[: v.numel()]
    return codes, scales


def dequantize(q: SymQuantized) -> torch.Tensor:
    """`(code - half) * scale / half` per element, float32, exact."""
    check_packed(q)
    return dequantize_codes(unpack(q.packed, q.bits, q.numel), q.scales, q.bits, q.group_size)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    half = 1 << (bits - 1)
    step = (scales.float() / half).repeat_interleave(group_size)[: codes.numel()]
    return (codes.float() - half) * step


def apply_delta(m: torch.Tensor, q: SymQuantized) -> torch.Tensor:
    """The receiver's update `m <- (float32(m) + deQ(q)).to(m.dtype)`, in place (m contiguous); returns m."""
    _check_buffer(m, q.numel)
    flat = m.view(-1)
    flat.copy_((flat.float() + dequantize(q).to(m.device)).to(m.dtype))
    return m


def update(
    a: torch.Tensor, m: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = None
) -> SymQuantized:
    """The sender's AQ-SGD step: `q = Q(float32(a) - float32(m))`, then `apply_delta(m, q)`; returns q."""
    _check_buffer(m, a.numel())
    q = quantize(a.reshape(-1).float() - m.view(-1).float(), bits, group_size, stochastic=stochastic, seed=seed)
    apply_delta(m, q)
    return q


def _check_buffer(m: torch.Tensor, numel: int) -> None:
    if m.numel() != numel or not m.is_contiguous():
        raise ValueError(f"the buffer must be contiguous with {numel} elements, got {tuple(m.shape)}")
    if m.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the buffer must be fp32, fp16 or bf16, got {m.dtype}")


def check_packed(q: SymQuantized) -> None:
    """The lengths of a SymQuantized agree with its numel, bits and group size."""
    check_sym_args(q.numel, q.bits, q.group_size)
    if q.packed.dtype != torch.uint8 or q.packed.numel() != packed_nbytes(q.numel, q.bits):
        raise ValueError(f"packed must be {packed_nbytes(q.numel, q.bits)} uint8 bytes")
    if q.scales.dtype != torch.float16 or q.scales.numel() != num_groups(q.numel, q.group_size):
        raise ValueError(f"scales must be {num_groups(q.numel, q.group_size)} float16 values")
