"""Fixtures of the kernels' tests: every backend that runs on this machine's CPU, one intra-op thread."""

import pytest
import torch

from swarm.kernels import cpu, reference

torch.set_num_threads(1)


@pytest.fixture(params=["reference", "cpu"])
def backend(request):
    """A backend module (same functions as the public API, group size required)."""
    if request.param == "cpu" and not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    return {"reference": reference, "cpu": cpu}[request.param]
