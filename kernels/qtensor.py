"""The quantized-tensor container every backend returns, its size arithmetic and its argument checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "BITS",
    "DEFAULT_GROUP_SIZE",
    "all_finite",
    "MAX_MAGNITUDE",
    "SCALE_DTYPE",
    "QuantizedTensor",
    "check_buffer",
    "check_output",
    "check_quantize_args",
    "check_update_args",
    "num_groups",
    "packed_nbytes",
    "raise_bad_group",
]

BITS = (2, 3, 4, 8)
"""Supported code widths: one little-endian bitstream, `bits` bits per element."""

DEFAULT_GROUP_SIZE = 256
"""Elements per (min, scale) pair; why 256 is in `swarm.kernels`' module docstring."""

SCALE_DTYPE = torch.float32
"""Dtype of the stored per-group scales and mins (the wire carries it); why fp32 is in the package docstring."""

MAX_MAGNITUDE = 2.0**126
"""Groups whose largest |x| (or range) reaches this raise: beyond it the fp32 grid of mins would overflow."""

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BUFFER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of `x` is finite, in one reduction: the sum of a float32, float16 or bfloat16 tensor
    (`INPUT_DTYPES`) taken in float64 is finite exactly when every element is (|sum| <= numel x 3.4e38 cannot reach
    float64's 1.8e308; a NaN, or an Inf whether or not another cancels it, leaves the sum NaN or Inf).
    `isfinite(x).all()` makes a boolean tensor first and took 5x longer on a [2, 128, 128] activation (0.078 against
    0.015 ms on this project's CPU). Other dtypes (float64 could overflow the sum) take `isfinite`."""
    if not x.numel():
        return True
    if x.dtype in INPUT_DTYPES:
        return math.isfinite(float(x.sum(dtype=torch.float64)))
    return bool(torch.isfinite(x).all())


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of a bit-packed payload of `numel` codes of `bits` bits: ceil(numel * bits / 8)."""
    return (numel * bits + 7) // 8


def num_groups(numel: int, group_size: int) -> int:
    """Number of (min, scale) groups: the last one may be partial."""
    return math.ceil(numel / group_size)


@dataclass(frozen=True)
class QuantizedTensor:
    """A flattened tensor quantized per group to `bits`-bit codes, as it travels on the wire.

    Element i is `mins[g] + code_i * scales[g]` with g = i // group_size; code_i occupies bits
    [i*bits, (i+1)*bits) of `packed`, read as one little-endian bitstream (byte j holds stream bits
    [8j, 8j+8)). Construction validates every field, so a tensor decoded from the wire cannot make a
    kernel read or write out of bounds.
    """

    packed: torch.Tensor
    """uint8, 1-D, exactly packed_nbytes(numel, bits) bytes; pad bits are zero."""
    scales: torch.Tensor
    """One step size per group (SCALE_DTYPE); 0 for a constant group."""
    mins: torch.Tensor
    """One offset per group (SCALE_DTYPE): the value of code 0."""
    bits: int
    """Bits per code: 2, 3, 4 or 8."""
    group_size: int
    """Elements per group."""
    numel: int
    """Elements of the original tensor (its shape is the caller's business)."""

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.group_size < 1 or self.numel < 0:
            raise ValueError(f"bad group_size {self.group_size} or numel {self.numel}")
        want_bytes = packed_nbytes(self.numel, self.bits)
        if self.packed.dtype != torch.uint8 or self.packed.shape != (want_bytes,):
            raise ValueError(
                f"packed must be uint8 of shape ({want_bytes},), got {self.packed.dtype} {tuple(self.packed.shape)}"
            )
        groups = num_groups(self.numel, self.group_size)
        for name in ("scales", "mins"):
            t = getattr(self, name)
            if t.dtype != SCALE_DTYPE or t.shape != (groups,):
                raise ValueError(f"{name} must be {SCALE_DTYPE} of shape ({groups},), got {t.dtype} {tuple(t.shape)}")
            if t.device != self.packed.device:
                raise ValueError(f"{name} is on {t.device} but packed is on {self.packed.device}")
        if not (self.packed.is_contiguous() and self.scales.is_contiguous() and self.mins.is_contiguous()):
            raise ValueError("packed, scales and mins must be contiguous")

    @property
    def nbytes(self) -> int:
        """Wire bytes of the payload, scales and mins (not counting framing)."""
        return self.packed.numel() + self.scales.numel() * self.scales.element_size() * 2

    @property
    def device(self) -> torch.device:
        return self.packed.device


def check_quantize_args(x: torch.Tensor, bits: int, group_size: int) -> None:
    """Raise ValueError (or TypeError) for arguments no backend accepts."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"input dtype must be one of {INPUT_DTYPES}, got {x.dtype}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


def check_update_args(a: torch.Tensor, m: torch.Tensor, bits: int, group_size: int) -> None:
    """Checks for aqsgd_update: `a` as for quantize, `m` a contiguous buffer of the same size and device."""
    check_quantize_args(a, bits, group_size)
    check_buffer(m, a.numel(), a.device)


def check_buffer(m: torch.Tensor, numel: int, device: torch.device) -> None:
    """The message buffer is updated in place: it must be contiguous, of `numel` elements, on `device`."""
    if m.dtype not in BUFFER_DTYPES:
        raise ValueError(f"buffer dtype must be one of {BUFFER_DTYPES}, got {m.dtype}")
    if m.numel() != numel:
        raise ValueError(f"buffer has {m.numel()} elements, expected {numel}")
    if not m.is_contiguous():
        raise ValueError("buffer must be contiguous (it is updated in place)")
    if m.device != device:
        raise ValueError(f"buffer is on {m.device}, expected {device}")


def check_output(q: QuantizedTensor, dtype: torch.dtype, out: torch.Tensor | None) -> None:
    """`dequantize(..., out=)` writes a contiguous tensor of q.numel elements, of the requested dtype."""
    if out is not None:
        check_buffer(out, q.numel, q.device)
        if out.dtype != dtype:
            raise ValueError(f"out is {out.dtype} but dtype is {dtype}; pass dtype=out.dtype")


def raise_bad_group(x_name: str, group: int, nonfinite: bool) -> None:
    """The one wording of the two input errors every backend reports."""
    if nonfinite:
        raise ValueError(f"{x_name} contains NaN or Inf (first in group {group}); refusing to quantize")
    raise ValueError(f"{x_name} has a value or group range >= 2**126 (group {group}); too large to quantize in float32")
