"""A seeded randomized Hadamard rotation per group, applied before quantizing and undone after decoding.

Per group of `g` elements (`g` a power of two), the rotation is `y = H D x / sqrt(g)`: `D` a diagonal of random
signs drawn from the seed (one sign per element of the padded tensor), `H` the Walsh-Hadamard matrix (as two small
matrix products, see `fwht`). `H / sqrt(g)` is orthonormal and its own inverse, so the inverse
is `x = D H y / sqrt(g)`, exact up to float32 rounding. The rotation spreads an outlier over its group: the
rotated group is close to Gaussian, so its (min, scale) pair fits the bulk of the values, not the largest one.

A tensor whose size is not a multiple of `g` is padded with zeros to one (the padding travels: its codes are
part of the message). Both ends draw the same signs from the seed the message carries.
"""

from __future__ import annotations

import functools
import math

import torch

MAX_ROTATION_GROUP = 65536
"""Largest group the rotation accepts (the quantized message's own group bound)."""


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def padded_numel(numel: int, group: int) -> int:
    """Elements after padding `numel` to whole groups of `group`."""
    return math.ceil(numel / group) * group


def check_group(group: int) -> None:
    """Raises ValueError unless `group` is a power of two in 2..MAX_ROTATION_GROUP."""
    if not (2 <= group <= MAX_ROTATION_GROUP and is_power_of_two(group)):
        raise ValueError(f"a Hadamard rotation needs a power-of-two group in 2..{MAX_ROTATION_GROUP}, got {group}")


@functools.cache
def _hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1; n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of `x` ([n, g], g a power of two): `x H / sqrt(g)`.

    `H_g = H_a (x) H_b` (Kronecker, a * b = g, a and b near sqrt(g)), so a row viewed as an [a, b] matrix `X`
    transforms as `H_a X H_b`: two small matrix products, O(g sqrt(g)) per row but a few BLAS calls instead of
    log2(g) butterfly passes in Python.
    """
    n, g = x.shape
    a = 1 << (g.bit_length() - 1) // 2
    b = g // a
    ha, hb = _hadamard(a).to(x.device), _hadamard(b).to(x.device)
    # normalize first: no intermediate exceeds the largest input or output, so bounded values cannot overflow
    y = torch.matmul(torch.matmul(ha, x.reshape(n, a, b) * (1.0 / math.sqrt(g))), hb)
    return y.reshape(n, g)


def _signs(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    bits = torch.randint(0, 2, (numel,), generator=generator, dtype=torch.int8)
    return (bits.float() * 2 - 1).to(device)


def rotate(x: torch.Tensor, group: int, seed: int) -> torch.Tensor:
    """The rotated, zero-padded, flattened float32 copy of `x` (padded_numel(x.numel(), group) elements)."""
    check_group(group)
    flat = x.reshape(-1).float()
    total = padded_numel(flat.numel(), group)
    if total != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, total - flat.numel()))
    signed = flat * _signs(total, seed, flat.device)
    return fwht(signed.view(-1, group)).reshape(-1)


def unrotate(y: torch.Tensor, group: int, seed: int, numel: int) -> torch.Tensor:
    """The inverse of `rotate`: the first `numel` elements of the un-rotated float32 `y` (flat, whole groups)."""
    check_group(group)
    flat = y.reshape(-1).float()
    if flat.numel() % group or flat.numel() < numel:
        raise ValueError(f"{flat.numel()} rotated elements are not whole groups of {group} covering {numel}")
    back = fwht(flat.view(-1, group)).reshape(-1) * _signs(flat.numel(), seed, flat.device)
    return back[:numel]


def hadamard_integers(x: torch.Tensor) -> torch.Tensor:
    """`x H` for each row of an integer tensor `x` ([n, g], g a power of two), unnormalized, in integer arithmetic:
    log2(g) butterfly passes of additions and subtractions, so the result is exact on every device and backend
    (a float matmul may round, or run in TF32 on a GPU). `H` is the Sylvester matrix `fwht` uses."""
    n, g = x.shape
    h = 1
    while h < g:
        pairs = x.reshape(n, g // (2 * h), 2, h)
        x = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return x.reshape(n, g)


def unrotate_grid(codes: torch.Tensor, steps: torch.Tensor, group: int, seed: int) -> torch.Tensor:
    """The inverse rotation of values on a per-group grid, `codes * step` (integer `codes`, flat, whole groups;
    one float32 `step` per group), computed so that every device gets the same bits: `D H c` is an exact integer
    (|c| * group < 2^24, so exact in float32 as well), and each element is then one float32 product with its
    group's `step / sqrt(group)`. Sender and receiver of a message buffer both decode through it, so their
    buffers stay bit-identical although the rotation itself is not exact."""
    check_group(group)
    k = hadamard_integers(codes.to(torch.int32).view(-1, group)).float()
    factor = steps.float() * torch.tensor(1.0 / math.sqrt(group), dtype=torch.float32, device=steps.device)
    return (k * factor[:, None]).reshape(-1) * _signs(codes.numel(), seed, codes.device)
