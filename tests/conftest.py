"""Test-wide settings: one intra-op thread per process (the machine has 2 cores and tests run side by side)."""

import torch

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (skipped without one; scripts/gpu-check.sh runs it)")
