"""A slower device, made of a normal one: a stage's compute stretched by a factor, in every precision.

`ComputeThrottle` wraps a `StageWorker`'s `forward` and `backward`: after each it sleeps (factor - 1) times the CPU
time the call took on its thread. torch runs one intra-op thread in a peer (`--threads 1`), so a pass computes on
the calling thread and `time.thread_time` is its own compute, not its neighbours' load on a shared machine. A stage
that computes in bf16 takes less CPU and so sleeps less: it is `factor` x slower in every precision, as a slower
device is. The sleep happens where the compute did (under the stage's compute lock), so the peer's pipeline sees
a slower stage, not a delay beside it. Used by `swarm-peer --compute-slowdown` and `swarm experiment hetero`.
"""

from __future__ import annotations

import math
import time

__all__ = ["ComputeThrottle"]


class ComputeThrottle:
    """Makes `worker` `factor` x slower (see the module docstring) until `remove`.

    Args:
        worker: a `swarm.runtime.worker.StageWorker` (anything with `forward` and `backward` methods).
        factor: >= 1; 1 wraps nothing away (sleeps 0).
    """

    def __init__(self, worker, factor: float):
        if not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"factor must be a finite number >= 1, got {factor}")
        self.worker, self.factor = worker, factor
        self.slept_s = 0.0
        """seconds slept so far"""
        self._forward, self._backward = worker.forward, worker.backward
        worker.forward, worker.backward = self._timed(self._forward), self._timed(self._backward)

    def sleep(self, compute_s: float) -> None:
        pause = max(compute_s, 0.0) * (self.factor - 1)
        self.slept_s += pause
        time.sleep(pause)

    def _timed(self, call):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.sleep(time.thread_time() - start)

        return timed

    def remove(self) -> None:
        """Gives the worker its own methods back."""
        self.worker.forward, self.worker.backward = self._forward, self._backward
