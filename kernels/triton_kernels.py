"""Triton kernels for CUDA tensors: quantize, dequantize, apply_delta and the fused AQ-SGD update, one pass each.

Each program owns a tile of whole groups, [groups_per_program, group_size rounded up to a power of two]:
it loads the tile once, reduces it to per-group min/max, computes the grid of `swarm.kernels.reference`,
codes, and packs eight codes at a time into a `bits`-byte little-endian word, so the byte layout is the
reference's bitstream. Where a tile is contiguous in that stream (power-of-two groups) and its bits fill whole
32-bit words (2, 4 and 8 bits), the quantize kernels store the same bytes as whole little-endian words instead
(4-66% quicker on an H200, median 16%: docs/GPU.md); the packed buffer is then the first bytes of a word-rounded one.
Round-to-nearest codes equal the reference's bit for bit (IEEE division via `div_rn`); stochastic rounding
uses Triton's Philox stream keyed by (seed, element index).

Errors are reported through the scales: a group with NaN/Inf stores a NaN scale, a group too large an Inf
one; the host checks `isfinite(scales)` once per call. The kernels are tested on the CPU with
TRITON_INTERPRET=1, which Triton reads when `@triton.jit` runs, that is, when this module is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .qtensor import (
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

__all__ = ["apply_delta", "aqsgd_update", "dequantize", "quantize", "quantize_launcher", "supports"]

_TILE_ELEMENTS = 2048  # elements per program of the decode kernels: whole groups, a few KiB of registers
# The quantize kernels' launch (`_quantize_launch`), as scripts/kernel_sweep.py measured it on an H200 (512 MiB,
# group 256; docs/GPU.md): 1024 elements on 2 warps was the quickest of 512-8192 elements on 2-8 warps at 2 and 8
# bits, both roundings (2-9% over 2048 on 4), and whole-word stores beat byte stores by 4-66% (median 16%).
_QUANTIZE_TILE_ELEMENTS = 1024
_NUM_WARPS = 2
_WORD_STORES = True
_MAX_GROUP_SIZE = 8192
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supports(device: torch.device, group_size: int) -> bool:
    """CUDA tensors, groups starting on a byte boundary for every bit width, groups that fit one tile row."""
    return device.type == "cuda" and group_size % 8 == 0 and group_size <= _MAX_GROUP_SIZE


@triton.jit
def _widen(x):
    """To float32 exactly; bfloat16 by its bits, as the interpreter's own conversion is not exact."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _narrow(x, dtype: tl.constexpr):
    """From float32, rounding to nearest even like torch's .to(dtype); bfloat16 by integer arithmetic."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _grid_params(x, mask, LEVELS: tl.constexpr):
    """Per-row stored (min, scale) of reference.group_params; NaN scale = NaN/Inf in the row, Inf = too large."""
    lo = tl.min(tl.where(mask, x, float("inf")), axis=1)
    hi = tl.max(tl.where(mask, x, float("-inf")), axis=1)
    nonfinite = tl.max(tl.where(mask & ((x - x) != 0), 1, 0), axis=1) > 0
    usable = (tl.max(mask.to(tl.int32), axis=1) > 0) & ~nonfinite  # rows past the end have no elements
    lo = tl.where(usable, lo, 0.0)
    hi = tl.where(usable, hi, 0.0)
    span = hi - lo
    magnitude = tl.maximum(tl.maximum(tl.abs(lo), tl.abs(hi)), span)
    too_large = magnitude >= 2.0**126
    magnitude = tl.where(too_large, 1.0, magnitude)
    e = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 22, -126)
    quantum = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inverse_quantum = ((127 - e) << 23).to(tl.float32, bitcast=True)
    k_lo = tl.floor(tl.where(too_large, 0.0, lo) * inverse_quantum)
    k_hi = tl.ceil(tl.where(too_large, 0.0, hi) * inverse_quantum)
    steps = ((k_hi - k_lo).to(tl.int32) + (LEVELS - 1)) // LEVELS
    constant = span == 0
    mins = tl.where(constant, lo, k_lo * quantum)
    scales = tl.where(constant, 0.0, steps.to(tl.float32) * quantum)
    scales = tl.where(nonfinite, float("nan"), tl.where(too_large, float("inf"), scales))
    return mins, scales


@triton.jit
def _encode(x, mask, index, mins, scales, seed, LEVELS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Codes floor((x - min) / scale + u), clamped; zero where masked so pad bits stay zero."""
    denominator = tl.where(scales > 0, scales, 1.0)
    v = tl.div_rn(x - mins[:, None], denominator[:, None])
    v = v + tl.rand(seed, index) if STOCHASTIC else v + 0.5
    codes = tl.minimum(tl.maximum(tl.floor(v), 0.0), LEVELS * 1.0).to(tl.int32)
    return tl.where(mask, codes, 0)


@triton.jit
def _byte_offsets(groups, nbytes, BITS: tl.constexpr, GROUP: tl.constexpr, UNITS: tl.constexpr):
    """Offsets [groups, units, 8] of each unit's bytes (a unit = 8 codes = BITS bytes), and their mask."""
    unit = tl.arange(0, UNITS)
    k = tl.arange(0, 8)
    offsets = (groups * (GROUP * BITS // 8))[:, None, None] + (unit * BITS)[None, :, None] + k[None, None, :]
    mask = (k < BITS)[None, None, :] & (unit * 8 < GROUP)[None, :, None] & (offsets < nbytes)
    return offsets, mask


@triton.jit
def _pack_store(packed_ptr, codes, groups, nbytes, BITS: tl.constexpr, GROUP: tl.constexpr,
                ROWS: tl.constexpr, COLUMNS: tl.constexpr):  # fmt: skip
    k = tl.arange(0, 8)
    units = tl.reshape(codes.to(tl.int64), (ROWS, COLUMNS // 8, 8))
    words = tl.sum(units << (k * BITS)[None, None, :], axis=2)
    data = (words[:, :, None] >> (k * 8)[None, None, :]) & 0xFF
    offsets, mask = _byte_offsets(groups, nbytes, BITS, GROUP, COLUMNS // 8)
    tl.store(packed_ptr + offsets, data.to(tl.uint8), mask=mask)


@triton.jit
def _pack_store_words(words_ptr, codes, nbytes, BITS: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """The tile's codes as whole little-endian 32-bit words of the bitstream (`_quantize_launch` says when: the
    tile is ROWS * COLUMNS contiguous elements and starts on a word); the same bytes as `_pack_store`."""
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = ROWS * COLUMNS // PER
    units = tl.reshape(codes.to(tl.uint32), (WORDS, PER))
    words = tl.sum(units << (tl.arange(0, PER) * BITS).to(tl.uint32)[None, :], axis=1)  # disjoint bits: an OR
    w = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
    tl.store(words_ptr + w, words, mask=w < (nbytes + 3) // 4)


@triton.jit
def _load_unpack(packed_ptr, groups, nbytes, BITS: tl.constexpr, GROUP: tl.constexpr,
                 ROWS: tl.constexpr, COLUMNS: tl.constexpr):  # fmt: skip
    k = tl.arange(0, 8)
    offsets, mask = _byte_offsets(groups, nbytes, BITS, GROUP, COLUMNS // 8)
    data = tl.load(packed_ptr + offsets, mask=mask, other=0).to(tl.int64)
    words = tl.sum(data << (k * 8)[None, None, :], axis=2)
    codes = (words[:, :, None] >> (k * BITS)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (ROWS, COLUMNS)).to(tl.float32)


@triton.jit
def _tile(numel, GROUP: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    columns = tl.arange(0, COLUMNS)
    index = groups[:, None] * GROUP + columns[None, :]
    mask = (columns[None, :] < GROUP) & (index < numel)
    return groups, index, mask, groups * GROUP < numel


@triton.jit
def _quantize_kernel(x_ptr, packed_ptr, scales_ptr, mins_ptr, numel, nbytes, seed,
                     BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                     STOCHASTIC: tl.constexpr, WORDS: tl.constexpr):  # fmt: skip
    groups, index, mask, live = _tile(numel, GROUP, ROWS, COLUMNS)
    x = _widen(tl.load(x_ptr + index, mask=mask, other=0.0))
    mins, scales = _grid_params(x, mask, (1 << BITS) - 1)
    codes = _encode(x, mask, index, mins, scales, seed, (1 << BITS) - 1, STOCHASTIC)
    if WORDS:
        _pack_store_words(packed_ptr, codes, nbytes, BITS, ROWS, COLUMNS)
    else:
        _pack_store(packed_ptr, codes, groups, nbytes, BITS, GROUP, ROWS, COLUMNS)
    tl.store(scales_ptr + groups, scales, mask=live)
    tl.store(mins_ptr + groups, mins, mask=live)


@triton.jit
def _aqsgd_kernel(a_ptr, m_ptr, packed_ptr, scales_ptr, mins_ptr, numel, nbytes, seed,
                  BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                  STOCHASTIC: tl.constexpr, WORDS: tl.constexpr):  # fmt: skip
    groups, index, mask, live = _tile(numel, GROUP, ROWS, COLUMNS)
    m = _widen(tl.load(m_ptr + index, mask=mask, other=0.0))
    delta = _widen(tl.load(a_ptr + index, mask=mask, other=0.0)) - m
    mins, scales = _grid_params(delta, mask, (1 << BITS) - 1)
    codes = _encode(delta, mask, index, mins, scales, seed, (1 << BITS) - 1, STOCHASTIC)
    if WORDS:
        _pack_store_words(packed_ptr, codes, nbytes, BITS, ROWS, COLUMNS)
    else:
        _pack_store(packed_ptr, codes, groups, nbytes, BITS, GROUP, ROWS, COLUMNS)
    tl.store(scales_ptr + groups, scales, mask=live)
    tl.store(mins_ptr + groups, mins, mask=live)
    # the receiver's apply_delta on the same values; groups that failed keep their buffer
    updated = m + (mins[:, None] + codes.to(tl.float32) * scales[:, None])
    ok = (scales == scales) & (scales < float("inf"))
    tl.store(m_ptr + index, _narrow(updated, m_ptr.dtype.element_ty), mask=mask & ok[:, None])


@triton.jit
def _decode_kernel(packed_ptr, scales_ptr, mins_ptr, out_ptr, numel, nbytes,
                   BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
                   ADD: tl.constexpr):  # fmt: skip
    groups, index, mask, live = _tile(numel, GROUP, ROWS, COLUMNS)
    codes = _load_unpack(packed_ptr, groups, nbytes, BITS, GROUP, ROWS, COLUMNS)
    mins = tl.load(mins_ptr + groups, mask=live, other=0.0)
    scales = tl.load(scales_ptr + groups, mask=live, other=0.0)
    values = mins[:, None] + codes * scales[:, None]
    if ADD:
        values = _widen(tl.load(out_ptr + index, mask=mask, other=0.0)) + values
    tl.store(out_ptr + index, _narrow(values, out_ptr.dtype.element_ty), mask=mask)


def quantize(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True, seed: int | None = None
) -> QuantizedTensor:
    """Same contract as `reference.quantize`; nearest rounding matches it bit for bit."""
    launch, q = quantize_launcher(x, bits, group_size, stochastic=stochastic, seed=seed)
    if q.numel:
        launch()
        _check(q.scales, "input")
    return q


def quantize_launcher(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True, seed: int | None = 0
) -> tuple[Callable[[], None], QuantizedTensor]:
    """`quantize`'s kernel launch on outputs allocated once, and those outputs, unchecked: `quantize` launches it
    once and checks the scales; a benchmark times it alone, without the NaN check's device-to-host sync. `seed`
    None: one drawn from the OS's entropy."""
    check_quantize_args(x, bits, group_size)
    _check_group_size(group_size)
    flat = x.reshape(-1).contiguous()
    packed, packed_words, scales, mins = _outputs(flat.numel(), bits, group_size, flat.device)
    t, key = _quantize_launch(bits, group_size), _seed(seed)
    grid = _grid(flat.numel(), group_size, t.rows)

    def launch() -> None:
        _quantize_kernel[grid](
            flat, packed_words if t.words else packed, scales, mins, flat.numel(), packed.numel(), key,
            BITS=bits, GROUP=group_size, ROWS=t.rows, COLUMNS=t.columns, STOCHASTIC=stochastic, WORDS=t.words,
            num_warps=t.num_warps,
        )  # fmt: skip

    return launch, QuantizedTensor(packed, scales, mins, bits, group_size, flat.numel())


def dequantize(
    q: QuantizedTensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as `reference.dequantize`, bit for bit."""
    _check_group_size(q.group_size)
    check_output(q, dtype, out)
    if dtype not in _OUT_DTYPES:
        return dequantize(q).to(dtype)
    if out is None:
        out = torch.empty(q.numel, dtype=dtype, device=q.device)
    _decode(q, out, add=False)
    return out


def apply_delta(m: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Same contract as `reference.apply_delta`, bit for bit."""
    check_buffer(m, q.numel, q.device)
    _check_group_size(q.group_size)
    _decode(q, m, add=True)
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
    """Same contract as `reference.aqsgd_update`, in one pass over a and m."""
    check_update_args(a, m, bits, group_size)
    _check_group_size(group_size)
    flat = a.reshape(-1).contiguous()
    packed, packed_words, scales, mins = _outputs(flat.numel(), bits, group_size, flat.device)
    if flat.numel():
        t = _quantize_launch(bits, group_size, update=True)
        _aqsgd_kernel[_grid(flat.numel(), group_size, t.rows)](
            flat, m, packed_words if t.words else packed, scales, mins, flat.numel(), packed.numel(), _seed(seed),
            BITS=bits, GROUP=group_size, ROWS=t.rows, COLUMNS=t.columns, STOCHASTIC=stochastic, WORDS=t.words,
            num_warps=t.num_warps,
        )  # fmt: skip
        _check(scales, "a - m")
    return QuantizedTensor(packed, scales, mins, bits, group_size, flat.numel())


def _decode(q: QuantizedTensor, out: torch.Tensor, add: bool) -> None:
    if q.numel == 0:
        return
    rows, columns = _tile_shape(q.group_size)
    _decode_kernel[_grid(q.numel, q.group_size, rows)](
        q.packed, q.scales, q.mins, out, q.numel, q.packed.numel(),
        BITS=q.bits, GROUP=q.group_size, ROWS=rows, COLUMNS=columns, ADD=add,
    )  # fmt: skip


def _tile_shape(group_size: int, elements: int | None = None) -> tuple[int, int]:
    """[rows, columns] of a program's tile: whole groups, `elements` (the decode kernels' by default) or one group."""
    columns = triton.next_power_of_2(group_size)
    return max(1, (elements or _TILE_ELEMENTS) // columns), columns


class _Launch(NamedTuple):
    """A quantize kernel's tile ([rows, columns]: whole groups), whether it stores whole words, and its warps."""

    rows: int
    columns: int
    words: bool
    num_warps: int


def _quantize_launch(bits: int, group_size: int, update: bool = False) -> _Launch:
    """The quantize kernels' launch; the fused updates' (two tensors in, one out) keeps the decode kernels' tile
    and Triton's 4 warps, the launch their figures in docs/GPU.md were measured with."""
    if update:
        rows, columns = _tile_shape(group_size)
    else:
        rows, columns = _tile_shape(group_size, _QUANTIZE_TILE_ELEMENTS)
    words = _WORD_STORES and 32 % bits == 0 and columns == group_size and rows * columns * bits % 32 == 0
    return _Launch(rows, columns, words, 4 if update else _NUM_WARPS)


def _packed(numel: int, bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed codes (uint8, exactly packed_nbytes) and the int32 words they are the first bytes of (the buffer
    rounded up to whole words), which a kernel storing whole words (`_words`) writes."""
    nbytes = packed_nbytes(numel, bits)
    words = torch.empty((nbytes + 3) // 4, dtype=torch.int32, device=device)
    return words.view(torch.uint8)[:nbytes], words


def _grid(numel: int, group_size: int, rows: int) -> tuple[int]:
    return (triton.cdiv(num_groups(numel, group_size), rows),)


def _outputs(
    numel: int, bits: int, group_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = num_groups(numel, group_size)
    packed, words = _packed(numel, bits, device)
    scales = torch.empty(groups, dtype=SCALE_DTYPE, device=device)
    return packed, words, scales, torch.empty(groups, dtype=SCALE_DTYPE, device=device)


def _seed(seed: int | None) -> int:
    return (int.from_bytes(os.urandom(8), "little") if seed is None else seed) & (2**62 - 1)


def _check_group_size(group_size: int) -> None:
    if group_size % 8:
        raise ValueError(f"this backend needs a group size that is a multiple of 8, got {group_size}")


def _check(scales: torch.Tensor, what: str) -> None:
    """One device-to-host sync: the kernels flag bad groups with a NaN (NaN/Inf input) or Inf scale."""
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        raise_bad_group(what, first, nonfinite=bool(torch.isnan(scales[first])))
