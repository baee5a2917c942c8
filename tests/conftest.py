"""Test-wide settings: one intra-op thread per process (the machine has 2 cores and tests run side by side)."""

import torch

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (skipped without one; scripts/gpu-check.sh runs it)")
    config.addinivalue_line(
        "markers",
        "docker: builds and runs the compose testbed under a docker engine (minutes; deselected unless `-m docker`)",
    )


def pytest_collection_modifyitems(config, items):
    """The `docker` tests build a multi-gigabyte image: they run only when asked for by `-m docker` (or any -m
    expression naming docker), never in the default suite."""
    if "docker" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("docker") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("docker")])
        items[:] = kept
