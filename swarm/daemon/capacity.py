"""What a peer offers the swarm: its measured compute speed and its memory."""

from __future__ import annotations

import os
import time

import torch

__all__ = ["measure_compute", "memory_bytes"]


def measure_compute(model, device: str, iters: int = 3) -> float:
    """Forward+backward throughput of one block on one reference micro-batch (layers per second)."""
    from swarm.model.gpt import Block

    block = Block(model).to(device)
    x = torch.randn(4, model.seq_len_tokens, model.hidden_dim, device=device, requires_grad=True)
    block(x).sum().backward()  # warm-up
    start = time.perf_counter()
    for _ in range(iters):
        block(x).sum().backward()
    return iters / (time.perf_counter() - start)


def memory_bytes() -> int:
    """Physical memory of the machine, in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
