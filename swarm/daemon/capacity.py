"""What a peer offers the swarm: its measured compute speed in each precision and its memory."""

from __future__ import annotations

import os

import torch

__all__ = ["low_precisions", "measure_compute", "measure_speeds", "memory_bytes"]


def measure_compute(model, device: str, iters: int = 10, micro_batch_size: int = 2, precision: str = "fp32") -> float:
    """Forward+backward throughput of one block on one micro-batch of the plan's size (layers per second).

    The fastest of `iters` timed passes after two warm-ups: a peer measures while others start beside it on a
    shared machine, and the median of passes then measured the neighbours (on a loaded 2-core machine the median
    read 22-25 layers/s where the fastest pass read 51-59 and a 2-stage swarm computed at about 41). The plan's
    FLOPs per layer are for the same micro-batch size, so the predicted compute is this time, not an
    extrapolation from another size. `precision` times the pass as a stage computes in it
    (`swarm.runtime.precision.autocast`: fp32 weights, the forward under autocast, the backward following it).
    On CUDA the device is synchronized before each clock read (`swarm.runtime.device.fastest_seconds`): kernel
    launches return at once, and an unsynchronized clock would time the launches and inflate the speed.
    """
    from swarm.model.spec import build_stage
    from swarm.runtime.device import fastest_seconds
    from swarm.runtime.precision import autocast

    block = build_stage(model, 0, 1, False, False).to(device)  # one block of whichever family (a middle stage)
    x = torch.randn(micro_batch_size, model.seq_len_tokens, model.boundary_dim, device=device, requires_grad=True)

    def one_pass() -> None:
        with autocast(precision, device):
            out = block(x)
        out.float().sum().backward()

    return 1.0 / fastest_seconds(one_pass, device, iters, warmup=2)


def low_precisions(device: str) -> tuple[str, ...]:
    """The precisions below fp32 a peer measures on `device`. CUDA: bf16 (where supported) and fp16. CPU: bf16
    only: CPU autocast runs fp16 too, but without an fp16 matmul (a block's pass measured 0.05-0.08x fp32's on
    an AVX-512 EPYC, torch 2.13) it is never worth planning. No int8 anywhere: torch has no int8 training path
    (its quantized kernels are inference-only, without autograd), even on a CPU with VNNI."""
    if torch.device(device).type != "cuda":
        return ("bf16",)
    return ("bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp16",)


def measure_speeds(model, device: str, micro_batch_size: int = 2, iters: int = 10) -> tuple[tuple[str, float], ...]:
    """`measure_compute` in each of `low_precisions(device)`: what a peer announces as `PeerAnnouncement.speeds`
    beside its fp32 speed. A precision that fails on the device (an autocast op it lacks) is left out."""
    speeds = []
    for precision in low_precisions(device):
        try:
            speeds.append((precision, measure_compute(model, device, iters, micro_batch_size, precision)))
        except RuntimeError:
            continue
    return tuple(speeds)


def memory_bytes() -> int:
    """Physical memory of the machine, in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
