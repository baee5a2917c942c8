"""Runs the Triton kernels' cases in Triton's interpreter, in a subprocess, when there is no CUDA device.

TRITON_INTERPRET is read when `@triton.jit` decorates a function, from Triton's own modules on: it must be set
before Triton is first imported, which in a shared test process is out of our hands. A fresh interpreter with
the variable set is the one reliable way, and leaves this process untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("test_kernels_triton_cases.py")
SYM_CASES = Path(__file__).with_name("test_kernels_triton_sym_cases.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the cases run directly on the GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the cases already run interpreted here")
@pytest.mark.parametrize("cases", [CASES, SYM_CASES], ids=["asymmetric", "symmetric"])
def test_triton_kernels_in_the_interpreter(cases):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(cases)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=CASES.parents[3])
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout.strip().splitlines()[-1]  # not skipped as a whole
