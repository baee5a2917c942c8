"""The replicas' gradient sum of one stage: flatten, encode with error feedback, exchange, decode, sum.

Filled in below; `parameters_digest` tells whether replicas hold the same weights.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["parameters_digest"]


def parameters_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (hex) over the bytes of each tensor, in the order given (name order)."""
    h = hashlib.sha256()
    for _, p in named:
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
