"""MSE-clipped scales for the symmetric max-abs quantizer: each group's scale searched below its max |x|.

Why: a group's max-abs scale spreads its few levels over the whole range, so one loud value (an outlier token in
a channel's group of a sample's tokens) makes every other value of the group coarse. At 3-4 bits the least squared
error usually sits below the max: a few values clip, the rest get a finer step (ACIQ, Banner et al. 2019, put the
best clip of a Laplace group at 3.9 b for 3 bits against an expected max of about 4.9 b over 128 values). The
search is the sender's alone: the codes and the fp16 scales travel as `acsgd`'s always do and decode with the
same spec (`kernels/symmetric.py`), so a receiver neither knows nor checks how a scale was chosen, and both ends
buffer the same bits.

The codes are those of `kernels.symmetric.quantize_codes` with the chosen scale in place of the max (round to
nearest, clip to the grid): `clipped_quantize(x, bits, group, fractions=(1.0,))` equals `symmetric.quantize`.
"""

from __future__ import annotations

import torch

from swarm.kernels import SymQuantized, all_finite, symmetric
from swarm.kernels.reference import pack

__all__ = ["CLIP_FRACTIONS", "clipped_quantize"]

CLIP_FRACTIONS = tuple(1.0 - 0.05 * i for i in range(11))
"""Scales tried per group, as fractions of its max |x|: 1.0 (the plain quantizer) down to 0.5 in steps of 0.05."""


def clipped_quantize(
    x: torch.Tensor, bits: int, group_size: int, fractions: tuple[float, ...] = CLIP_FRACTIONS
) -> SymQuantized:
    """`x` (flattened, float) quantized per group of `group_size`, round to nearest, each group at the fp16 scale
    among `fractions` x its max |x| that gives the least squared error (the first of equals: ties keep the larger
    scale). NaN or Inf raises ValueError, as the plain quantizer does."""
    v = x.detach().reshape(-1).float()
    symmetric.check_sym_args(v.numel(), bits, group_size)
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"clip fractions must be in (0, 1], got {fractions}")
    if not all_finite(v):
        raise ValueError("the tensor to quantize has NaN or Inf")
    half = 1 << (bits - 1)
    pad = (-v.numel()) % group_size
    g = torch.cat([v, v.new_zeros(pad)]).view(-1, group_size) if pad else v.view(-1, group_size)
    peak = g.abs().amax(1) if g.numel() else g.new_empty(0)
    best_scale = best_error = None
    for fraction in fractions:
        scale = (peak * fraction).clamp(max=symmetric.FP16_MAX).half()
        error = ((_codes(g, scale, half) * _step(scale, half) - g) ** 2).sum(1)
        if best_error is None:
            best_scale, best_error = scale, error
        else:
            better = error < best_error
            best_scale, best_error = torch.where(better, scale, best_scale), torch.where(better, error, best_error)
    if best_scale is None or not g.numel():
        best_scale = g.new_empty(0, dtype=torch.float16)
    codes = (_codes(g, best_scale, half) + half).to(torch.uint8).reshape(-1)[: v.numel()]
    return SymQuantized(pack(codes, bits), best_scale, bits, group_size, v.numel())


def _step(scale: torch.Tensor, half: int) -> torch.Tensor:
    return (scale.float() / half).clamp_min(symmetric.TINY)[:, None]


def _codes(g: torch.Tensor, scale: torch.Tensor, half: int) -> torch.Tensor:
    """Signed codes in [-half, half - 1] of the groups `g` at `scale` (step 3-4 of the spec, nearest)."""
    return torch.round(g / _step(scale, half)).clamp(-half, half - 1)
