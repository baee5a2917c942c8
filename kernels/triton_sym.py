"""Triton kernels of the symmetric max-abs quantizer (`symmetric` is the spec): quantize, decode (dequantize and
the receiver's apply_delta) and the sender's fused AQ-SGD update, one pass over memory each.

Tiles, packing and element conversions are `triton_kernels`'. Codes, scales and buffers equal the spec's bit for
bit, stochastic rounding included: the noise is the spec's lowbias32 hash of the element index, in uint32
arithmetic, and nearest rounding is half-to-even by the 1.5 * 2**23 addition trick on the clipped quotient (exact
below 2**22; the clip to [-half, half - 1] commutes with rounding to integers). A group with NaN/Inf stores a
NaN scale, which the host checks once per call; the update leaves such groups' buffer untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import symmetric
from .qtensor import num_groups
from .symmetric import SymQuantized, check_sym_args
from .triton_kernels import (
    _grid,
    _load_unpack,
    _narrow,
    _pack_store,
    _pack_store_words,
    _packed,
    _quantize_launch,
    _tile,
    _tile_shape,
    _widen,
    supports,
)

__all__ = ["supports", "sym_apply_delta", "sym_dequantize", "sym_quantize", "sym_quantize_launcher", "sym_update"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sym_codes(x, mask, index, key, BITS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Per row: the fp16 scale (NaN if the row has NaN/Inf), the fp32 step, and the codes (0 where masked)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    nonfinite = tl.max(tl.where(mask & ((x - x) != 0), 1, 0), axis=1) > 0
    amax = tl.max(tl.where(mask & ~nonfinite[:, None], tl.abs(x), 0.0), axis=1)
    scale = tl.minimum(amax, 65504.0).to(tl.float16)
    step = scale.to(tl.float32) * (1.0 / HALF)
    divisor = tl.maximum(step, 2.0**-126)
    t = tl.div_rn(x, divisor[:, None])
    if STOCHASTIC:
        h = _mix32(((index ^ key) & 0xFFFFFFFF).to(tl.uint32))
        u = (h >> 8).to(tl.float32) * (2.0**-24)
        t = tl.floor(t + u)
        t = tl.minimum(tl.maximum(t, -HALF * 1.0), HALF - 1.0)
    else:
        t = tl.minimum(tl.maximum(t, -HALF * 1.0), HALF - 1.0)
        t = (t + 12582912.0) - 12582912.0
    codes = tl.where(mask, (t + HALF).to(tl.int32), 0)
    scale = tl.where(nonfinite, float("nan"), scale.to(tl.float32)).to(tl.float16)
    return scale, step, codes


@triton.jit
def _sym_quantize_kernel(x_ptr, m_ptr, packed_ptr, scales_ptr, numel, nbytes, key,
                         BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                         STOCHASTIC: tl.constexpr, UPDATE: tl.constexpr, WORDS: tl.constexpr):  # fmt: skip
    groups, index, mask, live = _tile(numel, GROUP, ROWS, COLUMNS)
    x = _widen(tl.load(x_ptr + index, mask=mask, other=0.0))
    if UPDATE:
        m = _widen(tl.load(m_ptr + index, mask=mask, other=0.0))
        x = x - m
    scale, step, codes = _sym_codes(x, mask, index, key, BITS, STOCHASTIC)
    if WORDS:
        _pack_store_words(packed_ptr, codes, nbytes, BITS, ROWS, COLUMNS)
    else:
        _pack_store(packed_ptr, codes, groups, nbytes, BITS, GROUP, ROWS, COLUMNS)
    tl.store(scales_ptr + groups, scale, mask=live)
    if UPDATE:
        # the receiver's apply_delta on the same values; groups that failed keep their buffer
        updated = m + (codes.to(tl.float32) - (1 << (BITS - 1))) * step[:, None]
        ok = scale == scale
        tl.store(m_ptr + index, _narrow(updated, m_ptr.dtype.element_ty), mask=mask & ok[:, None])


@triton.jit
def _sym_decode_kernel(packed_ptr, scales_ptr, out_ptr, numel, nbytes,
                       BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                       ADD: tl.constexpr):  # fmt: skip
    groups, index, mask, live = _tile(numel, GROUP, ROWS, COLUMNS)
    codes = _load_unpack(packed_ptr, groups, nbytes, BITS, GROUP, ROWS, COLUMNS)
    step = tl.load(scales_ptr + groups, mask=live, other=0.0).to(tl.float32) * (1.0 / (1 << (BITS - 1)))
    values = (codes - (1 << (BITS - 1))) * step[:, None]
    if ADD:
        values = _widen(tl.load(out_ptr + index, mask=mask, other=0.0)) + values
    tl.store(out_ptr + index, _narrow(values, out_ptr.dtype.element_ty), mask=mask)


def sym_quantize(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = None
) -> SymQuantized:
    """Same contract as `symmetric.quantize`, bit for bit."""
    return _run(x, None, bits, group_size, stochastic, seed)


def sym_update(
    a: torch.Tensor, m: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = None
) -> SymQuantized:
    """Same contract as `symmetric.update`, in one pass over a and m (m may be partly updated on ValueError)."""
    if m.numel() != a.numel() or not m.is_contiguous() or m.dtype not in _OUT_DTYPES or m.device != a.device:
        raise ValueError(f"the buffer must be a contiguous fp32/fp16/bf16 tensor of {a.numel()} on {a.device}")
    return _run(a, m, bits, group_size, stochastic, seed)


def sym_quantize_launcher(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = 0
) -> tuple[Callable[[], None], SymQuantized]:
    """`sym_quantize`'s kernel launch on outputs allocated once, and those outputs, unchecked: for a benchmark to
    time the kernel alone, without the NaN check's device-to-host sync."""
    return _launcher(x, None, bits, group_size, stochastic, seed)


def sym_dequantize(q: SymQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as `symmetric.dequantize` (then cast to dtype), bit for bit."""
    symmetric.check_packed(q)
    if dtype not in _OUT_DTYPES:
        return sym_dequantize(q).to(dtype)
    out = torch.empty(q.numel, dtype=dtype, device=q.device)
    _decode(q, out, add=False)
    return out


def sym_apply_delta(m: torch.Tensor, q: SymQuantized) -> torch.Tensor:
    """Same contract as `symmetric.apply_delta`, bit for bit."""
    symmetric.check_packed(q)
    if m.numel() != q.numel or not m.is_contiguous() or m.dtype not in _OUT_DTYPES or m.device != q.device:
        raise ValueError(f"the buffer must be a contiguous fp32/fp16/bf16 tensor of {q.numel} on {q.device}")
    _decode(q, m, add=True)
    return m


def _run(x, m, bits, group_size, stochastic, seed) -> SymQuantized:
    launch, q = _launcher(x, m, bits, group_size, stochastic, seed)
    if q.numel:
        launch()
        bad = torch.isnan(q.scales)  # one device-to-host sync per call
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise ValueError(f"{'input' if m is None else 'a - m'} contains NaN or Inf (first in group {first})")
    return q


def _launcher(x, m, bits, group_size, stochastic, seed) -> tuple[Callable[[], None], SymQuantized]:
    """The quantize (m None) or fused update kernel's launch on outputs allocated once, and those outputs."""
    flat = x.reshape(-1).contiguous()
    numel = flat.numel()
    check_sym_args(numel, bits, group_size)
    if flat.dtype not in _OUT_DTYPES or group_size % 8:
        raise ValueError(f"fp32/fp16/bf16 input and a group size that is a multiple of 8 ({flat.dtype}, {group_size})")
    packed, packed_words = _packed(numel, bits, flat.device)
    scales = torch.empty(num_groups(numel, group_size), dtype=torch.float16, device=flat.device)
    k0, k1 = symmetric.keys(seed)
    t = _quantize_launch(bits, group_size, update=m is not None)
    grid = _grid(numel, group_size, t.rows)

    def launch() -> None:
        _sym_quantize_kernel[grid](
            flat, flat if m is None else m, packed_words if t.words else packed, scales, numel, packed.numel(),
            k0 ^ symmetric.mix32_int(k1), BITS=bits, GROUP=group_size, ROWS=t.rows, COLUMNS=t.columns,
            STOCHASTIC=stochastic, UPDATE=m is not None, WORDS=t.words, num_warps=t.num_warps,
        )  # fmt: skip

    return launch, SymQuantized(packed, scales, bits, group_size, numel)


def _decode(q: SymQuantized, out: torch.Tensor, add: bool) -> None:
    if q.group_size % 8:
        raise ValueError(f"this backend needs a group size that is a multiple of 8, got {q.group_size}")
    if q.numel == 0:
        return
    rows, columns = _tile_shape(q.group_size)
    _sym_decode_kernel[_grid(q.numel, q.group_size, rows)](
        q.packed, q.scales, out, q.numel, q.packed.numel(),
        BITS=q.bits, GROUP=q.group_size, ROWS=rows, COLUMNS=columns, ADD=add,
    )  # fmt: skip
