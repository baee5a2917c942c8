"""Device-to-host copies of what leaves a GPU stage (packed codes, scales), off the compute stream.

`to_host` copies CUDA tensors into pinned host memory on a copy stream of their device: that stream first waits
for the work already queued on the current stream (the kernels that produced the tensors), then copies, and the
calling thread waits for the copy only. Kernels queued meanwhile on the compute stream (the next micro-batch's
forward, from another thread) keep running while the bytes cross PCIe. CPU tensors come back as they are.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["to_host"]


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the CPU; CUDA ones through pinned memory on the device's copy stream (see module doc)."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    out = []
    for t in tensors:
        if t.device.type != "cuda":
            out.append(t.cpu())
            continue
        stream = _copy_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the caching allocator keeps t's memory until the copy is done
        out.append((host, stream))
    done = []
    for item in out:
        if isinstance(item, tuple):
            host, stream = item
            stream.synchronize()
            done.append(host)
        else:
            done.append(item)
    return tuple(done)


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)
