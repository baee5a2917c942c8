"""A slower device, made of a normal one: a stage's compute stretched by a factor, in every precision.

`ComputeThrottle` wraps a `StageWorker`'s `forward` and `backward`: after each it sleeps (factor - 1) times the
time the call took. That time is wall-clock by default: on a machine shared with other processes a pass's wall
time is what this peer's share of the CPU makes of it, and a device `factor` x slower under the same conditions
takes `factor` x that (CPU time would not do: under load a pass waits far longer than it computes, and a sleep
of (factor - 1) x its CPU time would make the peer barely slower). A stage that computes in bf16 takes less time
and so sleeps less: it is `factor` x slower in every precision, as a slower device is. The sleep happens where the
compute did (under the stage's compute lock), so the peer's pipeline sees a slower stage, not a delay beside it.
Used by `swarm-peer --compute-slowdown` and `swarm experiment hetero`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["ComputeThrottle"]


class ComputeThrottle:
    """Makes `worker` `factor` x slower (see the module docstring) until `remove`.

    Args:
        worker: a `swarm.runtime.worker.StageWorker` (anything with `forward` and `backward` methods).
        factor: >= 1; 1 wraps nothing away (sleeps 0).
        clock: what a call's time is read from (`time.thread_time`: its CPU time, on one intra-op thread).
    """

    def __init__(self, worker, factor: float, clock: Callable[[], float] = time.perf_counter):
        if not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"factor must be a finite number >= 1, got {factor}")
        self.worker, self.factor, self.clock = worker, factor, clock
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
            start = self.clock()
            try:
                return call(*args, **kwargs)
            finally:
                self.sleep(self.clock() - start)

        return timed

    def remove(self) -> None:
        """Gives the worker its own methods back."""
        self.worker.forward, self.worker.backward = self._forward, self._backward
