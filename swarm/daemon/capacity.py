"""What a peer offers the swarm: its measured compute speed and its memory."""

from __future__ import annotations

import os
import time

import torch

__all__ = ["measure_compute", "memory_bytes"]


def measure_compute(model, device: str, iters: int = 10, micro_batch_size: int = 2) -> float:
    """Forward+backward throughput of one block on one micro-batch of the plan's size (layers per second).

    The fastest of `iters` timed passes after two warm-ups: a peer measures while others start beside it on a
    shared machine, and the median of passes then measured the neighbours (on a loaded 2-core machine the median
    read 22-25 layers/s where the fastest pass read 51-59 and a 2-stage swarm computed at about 41). The plan's
    FLOPs per layer are for the same micro-batch size, so the predicted compute is this time, not an
    extrapolation from another size.
    """
    from swarm.model.spec import build_stage

    block = build_stage(model, 0, 1, False, False).to(device)  # one block of whichever family (a middle stage)
    x = torch.randn(micro_batch_size, model.seq_len_tokens, model.hidden_dim, device=device, requires_grad=True)
    for _ in range(2):  # warm-up: allocator and kernel selection
        block(x).sum().backward()
    fastest = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        block(x).sum().backward()
        fastest = min(fastest, time.perf_counter() - start)
    return 1.0 / fastest


def memory_bytes() -> int:
    """Physical memory of the machine, in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
