"""What a peer offers the swarm: its measured compute speed and its memory."""

from __future__ import annotations

import os
import statistics
import time

import torch

__all__ = ["measure_compute", "memory_bytes"]


def measure_compute(model, device: str, iters: int = 5, micro_batch_size: int = 2) -> float:
    """Forward+backward throughput of one block on one micro-batch of the plan's size (layers per second).

    The median of `iters` timed passes: a peer measures while others start beside it on a shared machine, and one
    slow pass must not set its speed. The plan's FLOPs per layer are for the same micro-batch size, so the
    predicted compute is this measured time, not an extrapolation from another size.
    """
    from swarm.model.gpt import Block

    block = Block(model).to(device)
    x = torch.randn(micro_batch_size, model.seq_len_tokens, model.hidden_dim, device=device, requires_grad=True)
    block(x).sum().backward()  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        block(x).sum().backward()
        times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times)


def memory_bytes() -> int:
    """Physical memory of the machine, in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
