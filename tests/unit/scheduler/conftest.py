"""Tiny swarms shared by the scheduler's tests (no sockets, a few peers, milliseconds to plan)."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.scheduler.plans import ModelSpec, Peer, PlanInput


def tiny_swarm(n: int, seed: int, symmetric: bool = True) -> PlanInput:
    """`n` peers in three sites: fast links inside a site, slow random ones across; mixed speed and memory."""
    rng = np.random.default_rng(seed)
    site = rng.integers(0, 3, n)
    same = site[:, None] == site[None, :]
    delay = np.where(same, 0.002, rng.uniform(0.001, 0.08, (n, n)))
    bandwidth = np.where(same, 1e9, rng.uniform(20e6, 300e6, (n, n)))
    if symmetric:
        delay, bandwidth = (delay + delay.T) / 2, (bandwidth + bandwidth.T) / 2
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    peers = tuple(
        Peer(f"p{i}", float(rng.choice([10e12, 20e12, 40e12])), float(rng.choice([4e9, 8e9, 16e9])), f"site-{site[i]}")
        for i in range(n)
    )
    return PlanInput(peers, delay, bandwidth)


@pytest.fixture
def make_swarm():
    """`make_swarm(n, seed, symmetric=True)`: a tiny swarm (see `tiny_swarm`)."""
    return tiny_swarm


@pytest.fixture
def small_models() -> list[ModelSpec]:
    """Two settings in which replicas, uneven layers and memory limits all matter."""
    return [
        ModelSpec(
            layers=4,
            flops_per_layer=2e12,
            forward_bytes=4e6,
            backward_bytes=8e6,
            gradient_bytes_per_layer=10e6,
            memory_bytes_per_layer=3e9,
            stash_bytes_per_micro_batch=50e6,
            working_bytes=200e6,
            micro_batches=16,
        ),
        ModelSpec(
            layers=5,
            flops_per_layer=4e12,
            forward_bytes=2e6,
            backward_bytes=4e6,
            gradient_bytes_per_layer=5e6,
            memory_bytes_per_layer=2e9,
            micro_batches=32,
        ),
    ]
