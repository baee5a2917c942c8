"""Shared checks of the kernels' tests: the error bound, an independent bitstream oracle, test data, wire copies."""

from __future__ import annotations

import torch

from swarm.kernels import QuantizedTensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (2, 3, 4, 8)


def per_element(per_group: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    return per_group.repeat_interleave(group_size)[:numel]


def assert_within_bound(x: torch.Tensor, q: QuantizedTensor, y: torch.Tensor, stochastic: bool) -> None:
    """|x - y| <= step/2 (nearest) or < step (stochastic) per element, step = the stored scale of its group.

    The slack covers float32 rounding of (x - min) / scale: a few ulps of a value at most 2**bits - 1.
    """
    x64 = x.reshape(-1).double()
    step = per_element(q.scales, q.group_size, q.numel).double()
    error = (x64 - y.double()).abs()
    bound = step * ((1.0 if stochastic else 0.5) + (2**q.bits) * 2.0**-21)
    worst = (error - bound).max() if error.numel() else torch.tensor(0.0)
    assert bool((error <= bound).all()), f"error exceeds the bound by {float(worst):.3g}"


def bitstream_oracle(codes: list[int], bits: int) -> bytes:
    """The wire layout from its definition, with Python integers: code i at stream bits [i*bits, (i+1)*bits)."""
    stream = 0
    for i, code in enumerate(codes):
        stream |= code << (i * bits)
    return stream.to_bytes((len(codes) * bits + 7) // 8, "little")


def sample(kind: str, numel: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Test data of the shapes that break quantizers: offsets, tiny gradients, mixed magnitudes, outliers."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g)
    data = {
        "normal": base,
        "offset": 100.0 + 0.01 * base,
        "tiny": 1e-9 * base,
        "huge": 1e30 * base,
        "mixed": base * torch.exp(8 * torch.randn(numel, generator=g)),
        "positive": base.abs() + 3.0,
        "outliers": base * torch.where(torch.rand(numel, generator=g) < 0.01, 100.0, 1.0),
    }[kind]
    return data.to(dtype)


KINDS = ("normal", "offset", "tiny", "huge", "mixed", "positive", "outliers")


def over_the_wire(q: QuantizedTensor) -> QuantizedTensor:
    """A copy of q rebuilt from raw bytes, as a receiver would decode it."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        return torch.frombuffer(bytearray(t.numpy().tobytes()), dtype=t.dtype) if t.numel() else t.clone()

    return QuantizedTensor(copy(q.packed), copy(q.scales), copy(q.mins), q.bits, q.group_size, q.numel)
