"""Factor matrices on the wire: a rank-r product P Q^T sent as two `Quantized` fields, one group per column.

Used by `lowrank` (PowerSGD's factors, or subspace coding's basis and coefficients, `compression.subspace`) and by
acsgd's subspace-coded first sights (`+fslR`). Each column travels with one fp32 step (`scales`) as fp16 codes in
[-1, 1] (`bits` 16), int8 codes in -127..127 (`bits` 8) or 4-bit codes in -7..7 (`bits` 4: two's-complement
nibbles, two to a byte, the first code in the low nibble, the columns one after another, a last odd nibble 0);
`group_size` is the column's length, `numel` r x that, no `mins`. A code in a column whose step is 0, an fp16 code
outside [-1, 1] or not finite, an int8 code of -128, a nibble of -8 or a set padding nibble, or a negative or
non-finite step is refused, naming the field.

The product is summed term by term (`outer_sum`), an elementwise multiply and add in fp32 in k order, never a
matmul: BLAS kernels may sum in another order on another CPU, and both ends of a link must decode the same bits.
"""

from __future__ import annotations

import torch

from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, wire_dtype
from swarm.kernels import packed_nbytes
from swarm.kernels.reference import pack, unpack
from swarm.proto import wire_pb2

__all__ = [
    "COARSEST_CODE", "FACTOR_BITS", "INT4_MAX", "INT8_MAX", "MAX_RANK", "check_ranked", "int8_steps", "outer_sum",
    "pack_factor", "pair_nbytes", "ranked_label", "unpack_factor", "warm_start",
]  # fmt: skip

FACTOR_BITS = (16, 8, 4)
"""How factor elements travel: fp16 codes (16), int8 codes (8) or 4-bit codes (4), each column with an fp32 step."""
INT8_MAX = 127
"""Largest int8 code a factor column may carry (-128 is refused on the wire)."""
INT4_MAX = 7
"""Largest 4-bit code a factor column may carry (-8 is refused on the wire)."""
MAX_RANK = 64
"""Largest rank a config or a message may have."""
COARSEST_CODE = 7
"""An int8 column a sender steps by what its error costs (`int8_steps`) still reaches this code at its peak: at least
15 levels a column, so no column rounds to a single nonzero code or to nothing."""


def check_ranked(config) -> None:
    """Refuses (ValueError) a factor codec's rank outside 1..`MAX_RANK` or factor bits outside `FACTOR_BITS`."""
    if not 1 <= config.rank <= MAX_RANK:
        raise ValueError(f"rank is 1..{MAX_RANK}, got {config.rank}")
    if config.factor_bits not in FACTOR_BITS:
        raise ValueError(f"factor_bits (+fN) is one of {FACTOR_BITS}, got {config.factor_bits}")


def ranked_label(name: str, config) -> str:
    """A factor codec's label: its rank where a quantized codec writes its bits, then `+ef`, `+f8` or `+f4`
    (lowrank4+ef+f8, mlowrank12+ef+f4)."""
    bits = f"+f{config.factor_bits}" if config.factor_bits != 16 else ""
    return f"{name}{config.rank}" + ("+ef" if config.error_feedback else "") + bits


def pair_nbytes(rows: int, cols: int, r: int, bits: int) -> int:
    """Payload of a rank-r pair of factors P (rows x r) and Q (cols x r) at `bits`: their codes and each column's fp32
    step."""
    return packed_nbytes(rows * r, bits) + packed_nbytes(cols * r, bits) + 8 * r


def int8_steps(wanted: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Each column of `f` (n x r) on its `wanted` int8 step, kept between the column's peak / 127 (no code clipped)
    and its peak / `COARSEST_CODE`: for `pack_factor`'s `step`."""
    peak = f.detach().float().abs().amax(dim=0)
    return torch.minimum(torch.maximum(wanted.float(), peak / INT8_MAX), peak / COARSEST_CODE)


def _code_max(bits: int) -> int:
    return INT8_MAX if bits == 8 else INT4_MAX


def _from_nibbles(payload: bytes, count: int, field: str) -> torch.Tensor:
    """`count` 4-bit codes (int8) from `payload` (`swarm.kernels`' bit packing), checked: its length, no -8, a
    padding nibble of 0."""
    packed = bytes_to_tensor(payload, torch.uint8, packed_nbytes(count, 4), f"{field}.payload")
    if count % 2 and int(packed[-1]) >> 4:
        raise WireError(f"{field}.payload", "a set padding nibble after the last 4-bit code")
    u = unpack(packed, 4, count).to(torch.int16)
    if bool((u == 8).any()):
        raise WireError(f"{field}.payload", "a 4-bit code of -8")
    return torch.where(u > 7, u - 16, u).to(torch.int8)


def warm_start(q: torch.Tensor | None, cols: int, r: int, seed: int) -> torch.Tensor:
    """A power iteration's starting Q (cols x r): the encoder's last `q` where it has that shape and is finite, else
    a Gaussian drawn from `seed` (any start is valid: the encoder's own, never on the wire)."""
    if q is not None and q.shape == (cols, r) and bool(torch.isfinite(q).all()):
        return q
    return torch.randn(cols, r, generator=torch.Generator().manual_seed(seed))


def pack_factor(f: torch.Tensor, bits: int, q: wire_pb2.Quantized, step: torch.Tensor | None = None) -> torch.Tensor:
    """Writes factor `f` (n x r) into `q` column by column; returns what the receiver decodes from it (fp32, on
    the host). `step` (int8 and 4-bit only): each column's step, at least its peak / the largest code
    (`subspace.coefficient_steps`); none: exactly that."""
    f = f.detach().float().cpu()
    n, r = f.shape
    cols = f.t().contiguous()  # r x n: one group per column
    if step is None:
        peak = cols.abs().amax(dim=1) if n else torch.zeros(r)
        step = peak if bits == 16 else peak / _code_max(bits)  # fp16 codes in [-1, 1], int codes to +-max
    step = step.detach().float().cpu()
    codes = torch.where(step[:, None] > 0, cols / step.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    if bits == 16:
        codes = codes.to(torch.float16)
    else:
        codes = codes.round().clamp(-_code_max(bits), _code_max(bits)).to(torch.int8)
    q.bits, q.group_size, q.numel = bits, n, n * r
    q.scale_dtype = wire_dtype(torch.float32)
    q.scales = tensor_to_bytes(step)
    if bits == 4:  # two's-complement nibbles, packed as `swarm.kernels` packs 4-bit codes
        q.payload = pack((codes.to(torch.int16) & 0xF).to(torch.uint8), 4).numpy().tobytes()
    else:
        q.payload = tensor_to_bytes(codes)
    return (codes.float() * step[:, None]).t()


def unpack_factor(q: wire_pb2.Quantized, n: int, r: int, bits: int, field: str) -> torch.Tensor:
    """Factor (n x r) from `q`, checked whole."""
    if q.bits != bits:
        raise WireError(f"{field}.bits", f"{q.bits}; both factors travel with the same bits, one of {FACTOR_BITS}")
    if q.group_size != n or q.numel != n * r:
        raise WireError(f"{field}.numel", f"{q.numel} in groups of {q.group_size}, expected {r} x {n}")
    if q.scale_dtype != wire_pb2.FLOAT32:
        raise WireError(f"{field}.scale_dtype", "the factors carry fp32 scales")
    if q.mins:
        raise WireError(f"{field}.mins", "the factors carry no mins")
    step = bytes_to_tensor(q.scales, torch.float32, r, f"{field}.scales")
    if not bool(torch.isfinite(step).all()) or bool((step < 0).any()):
        raise WireError(f"{field}.scales", "a negative, NaN or Inf scale")
    if bits == 16:
        codes = bytes_to_tensor(q.payload, torch.float16, n * r, f"{field}.payload").float()
        if not bool(torch.isfinite(codes).all()) or bool((codes.abs() > 1).any()):
            raise WireError(f"{field}.payload", "an fp16 code outside [-1, 1]")
    elif bits == 4:
        codes = _from_nibbles(q.payload, n * r, field).float()
    else:
        codes = bytes_to_tensor(q.payload, torch.int8, n * r, f"{field}.payload")
        if bool((codes == -128).any()):
            raise WireError(f"{field}.payload", "an int8 code of -128")
        codes = codes.float()
    codes = codes.view(r, n)
    if bool(((codes != 0) & (step[:, None] == 0)).any()):
        raise WireError(f"{field}.payload", "a code set in a column whose scale is 0")
    return (codes * step[:, None]).t()


def outer_sum(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Q^T as sum_k P[:, k] Q[:, k]^T, one elementwise multiply and add a term in k order: the same bits on
    every machine (a matmul's summation order is its BLAS kernel's)."""
    out = torch.zeros(p.shape[0], q.shape[0], device=p.device)
    for k in range(p.shape[1]):
        out += p[:, k : k + 1] * q[:, k]
    return out
