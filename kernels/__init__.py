"""swarm.kernels: per-group quantization to 2/3/4/8 bits, bit packing, and the fused AQ-SGD buffer update.

`reference` is the specification (its docstring states the arithmetic); `cpu` (C++ compiled on first use)
and `triton_kernels` (CUDA) are tested against it. Dispatch: a CUDA tensor goes to Triton, a CPU tensor to
the C++ path, anything else (or a group size that is not a multiple of 8) to the reference.

Choices, by measurement (`swarm bench kernels --encodings` reprints the table; 1 Mi elements, stochastic
rounding, error ||x - deQ(Q(x))|| / ||x - mean(x)||):

============================================  ====  ========  ========  ========  ========  ========
data                                          bits  fp16@128  bf16@128  fp32@128  fp32@256  fp32@512
============================================  ====  ========  ========  ========  ========  ========
N(0, 1)                                          2     0.707     0.711     0.707     0.773     0.836
N(0, 1)                                          4     0.141     0.142     0.141     0.154     0.167
activations, 8 of 1024 channels x20              4     0.310     0.312     0.310     0.439     0.611
gradients N(0, 1e-7)                             4     0.244     0.142     0.141     0.154     0.166
gradients N(0, 1e-9)                             4     6.82      0.142     0.141     0.154     0.166
offset N(100, 0.01)                              4     0.240     1.42      0.142     0.155     0.167
wire bytes per element at 2 bits                       0.281     0.281     0.313     0.281     0.266
============================================  ====  ========  ========  ========  ========  ========

- Scales and mins are float32, on an exact power-of-two grid (see `reference`): dequantization never
  rounds, so both ends of an AQ-SGD link agree bit for bit whatever device or instruction mix they use, and
  the error bound holds against the stored step. At the same wire bytes, 16-bit pairs allow groups of 128
  and win 8% on well-behaved data (30% with outlier channels), but float16 underflows on small gradients
  (up to 44x worse) and bfloat16's 8-bit mantissa cannot place the min of a group far from zero (up to 9x
  worse). float32 has no such cliff; robustness won over the typical-case gain.
- DEFAULT_GROUP_SIZE = 256: the smallest power of two whose float32 pair meets the 2-bit budget of 1/14 of
  float32's bytes (0.25 + 8/256 = 0.281 B/element; 128 would need 0.313 = 1/12.8). Error grows with the
  group while bytes shrink little (512 saves 5.6% for 8% more error); the CPU quantizer's speed is the same
  from 128 to 512 within this machine's noise. Callers bound only by the 4-bit budget (1/7) can pass
  group_size=128 (0.5625 B/element = 1/7.1) for 9% less error, 30% on outlier-heavy activations.
- The CPU path is plain C++ (no torch headers) compiled once per machine and loaded with ctypes: one pass
  over memory per call, vectorized, split across torch's intra-op threads; see `cpu` for the alternatives.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from . import cpu, reference, symmetric
from .qtensor import DEFAULT_GROUP_SIZE, SCALE_DTYPE, QuantizedTensor, all_finite, packed_nbytes
from .symmetric import SymQuantized

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "SCALE_DTYPE",
    "QuantizedTensor",
    "SymQuantized",
    "all_finite",
    "apply_delta",
    "aqsgd_update",
    "backend_name",
    "dequantize",
    "packed_nbytes",
    "quantize",
    "sym_apply_delta",
    "sym_backend_name",
    "sym_dequantize",
    "sym_quantize",
    "sym_update",
]


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    *,
    stochastic: bool = True,
    seed: int | None = None,
) -> QuantizedTensor:
    """Quantize `x` (any shape, flattened row-major; fp32, fp16 or bf16) per group of `group_size` elements.

    Args:
        x: the tensor; NaN or Inf anywhere raises ValueError.
        bits: code width, 2, 3, 4 or 8.
        group_size: elements per (min, scale) pair; the last group may be partial.
        stochastic: unbiased stochastic rounding (floor(v + u)) if True, round to nearest if False.
        seed: seeds the rounding noise (same seed and backend, same codes); None draws a fresh seed.

    Returns:
        The packed codes with their per-group float32 scales and mins, on x's device.
    """
    return _backend(x.device, group_size).quantize(x, bits, group_size, stochastic=stochastic, seed=seed)


@torch.no_grad()
def dequantize(
    q: QuantizedTensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The 1-D tensor of q.numel values `min + code * scale`, computed exactly in float32, then cast to dtype.

    Deterministic: the same q gives the same bits on every backend and device.

    Args:
        q: the quantized tensor.
        dtype: float32, float16 or bfloat16 (others are cast from float32).
        out: optional contiguous tensor of q.numel elements and of `dtype` to write into (any shape); it is
            returned. Reusing one saves the allocation, which for large tensors costs more than the decoding.
    """
    return _backend(q.device, q.group_size).dequantize(q, dtype, out=out)


@torch.no_grad()
def aqsgd_update(
    a: torch.Tensor,
    m: torch.Tensor,
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    *,
    stochastic: bool = True,
    seed: int | None = None,
) -> QuantizedTensor:
    """The sender's AQ-SGD step, fused: `q = quantize(float32(a) - float32(m))`, then `apply_delta(m, q)`.

    Args:
        a: this round's activation (any shape, fp32/fp16/bf16).
        m: the message buffer, same number of elements, contiguous, fp16/bf16 (or fp32); updated in place.
        bits, group_size, stochastic, seed: as for `quantize`.

    Returns:
        q, to be sent; the receiver's `apply_delta(m_copy, q)` reproduces the new m bit for bit.

    Raises:
        ValueError: a - m has NaN/Inf. The CPU and Triton paths may then have updated part of m already:
            drop the buffer (the next round sends the full activation, as for a buffer miss).
    """
    return _backend(a.device, group_size).aqsgd_update(a, m, bits, group_size, stochastic=stochastic, seed=seed)


@torch.no_grad()
def apply_delta(m: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """The receiver's AQ-SGD step: `m <- (float32(m) + dequantize(q)).to(m.dtype)` in place; returns m.

    Exactly the update `aqsgd_update` makes on the sender's copy, on every backend and device.
    """
    return _backend(q.device, q.group_size).apply_delta(m, q)


@torch.no_grad()
def sym_quantize(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = None
) -> SymQuantized:
    """The symmetric max-abs quantizer of `symmetric` (acsgd's): codes packed, one fp16 scale per group.

    Every backend gives the same bits for the same seed, stochastic rounding included. NaN/Inf raises ValueError.
    """
    return _sym_backend(x.device, group_size).sym_quantize(x, bits, group_size, stochastic=stochastic, seed=seed)


@torch.no_grad()
def sym_dequantize(q: SymQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 1-D tensor `(code - 2^(bits-1)) * scale / 2^(bits-1)`, exact in float32, then cast to dtype."""
    return _sym_backend(q.device, q.group_size).sym_dequantize(q, dtype)


@torch.no_grad()
def sym_update(
    a: torch.Tensor, m: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = False, seed: int | None = None
) -> SymQuantized:
    """The sender's AQ-SGD step with the symmetric quantizer, fused: `q = Q(float32(a) - float32(m))`, then
    `m <- (float32(m) + deQ(q)).to(m.dtype)` in place (m contiguous). On ValueError a fast path may have moved
    part of m already: drop the buffer, as `aqsgd_update` says."""
    return _sym_backend(a.device, group_size).sym_update(a, m, bits, group_size, stochastic=stochastic, seed=seed)


@torch.no_grad()
def sym_apply_delta(m: torch.Tensor, q: SymQuantized) -> torch.Tensor:
    """The receiver's step: `m <- (float32(m) + sym_dequantize(q)).to(m.dtype)` in place; returns m."""
    return _sym_backend(q.device, q.group_size).sym_apply_delta(m, q)


def sym_backend_name(device: torch.device | str, group_size: int) -> str:
    """Which implementation serves the symmetric quantizer on `device`: "triton", "cpu" or "reference"."""
    backend = _sym_backend(torch.device(device), group_size)
    return "reference" if backend is _SymReference else "cpu" if backend is cpu else "triton"


class _SymReference:
    """The torch specification under the backends' names."""

    sym_quantize = staticmethod(symmetric.quantize)
    sym_update = staticmethod(symmetric.update)
    sym_apply_delta = staticmethod(symmetric.apply_delta)

    @staticmethod
    def sym_dequantize(q: SymQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return symmetric.dequantize(q).to(dtype)


def _sym_backend(device: torch.device, group_size: int):
    backend = _backend(device, group_size)
    if backend is reference:
        return _SymReference
    if backend is cpu:
        return cpu
    return _triton_sym() or _SymReference


@functools.cache
def _triton_sym() -> ModuleType | None:
    try:
        return importlib.import_module(f"{__name__}.triton_sym")
    except ImportError:
        return None


def backend_name(device: torch.device | str, group_size: int = DEFAULT_GROUP_SIZE) -> str:
    """Which implementation serves tensors on `device`: "triton", "cpu" or "reference"."""
    backend = _backend(torch.device(device), group_size)
    return "reference" if backend is reference else "cpu" if backend is cpu else "triton"


def _backend(device: torch.device, group_size: int) -> ModuleType:
    if device.type == "cuda":
        triton_kernels = _triton_kernels()
        if triton_kernels is not None and triton_kernels.supports(device, group_size):
            return triton_kernels
    elif cpu.supports(device, group_size):
        return cpu
    return reference


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """Imported on first CUDA use only: importing Triton is slow, and fixes its interpret mode for the process."""
    try:
        return importlib.import_module(f"{__name__}.triton_kernels")
    except ImportError:
        return None
