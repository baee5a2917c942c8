"""The symmetric quantizer's Triton kernels against its torch spec: on CUDA, or in Triton's interpreter on CPU
tensors (`test_kernels_triton.py` runs this file in a subprocess with TRITON_INTERPRET=1 when there is no CUDA)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from swarm.kernels import symmetric

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRETED):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (test_kernels_triton.py runs it so)", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered"),  # numpy, as the interpreter wraps uint32 products
    pytest.mark.filterwarnings("ignore:invalid value encountered"),  # numpy, on the NaN/Inf inputs
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TIES = [4.0, 0.25, 0.75, 1.25, -0.25, -0.75, 1.0, 3.0]
"""A group of 8 whose quotients tie: x / step = k + 1/2 at 4 bits (step 0.5: 0.5, 1.5, 2.5, -0.5, -1.5) and at
2 bits (step 2: 1.0 -> 0.5, 3.0 -> 1.5); rounding half to even decides them."""


@pytest.fixture(scope="module")
def tk():
    return importlib.import_module("swarm.kernels.triton_sym"), torch.device("cpu" if INTERPRETED else "cuda")


def awkward(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values over 12 decades, zero and -0.0 groups, an fp16-underflowing group, values past fp16's max."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.logspace(-9, 3, numel)
    x[:8], x[8:16] = 0.0, -0.0
    x[16:24] = torch.tensor([1e-9, -3e-9, 2e-10, -1e-12, 5e-9, 0.0, -1e-9, 1e-9])
    if dtype != torch.float16:
        x[24:32] = torch.tensor([7e4, -9e4, 1.0, 65519.0, -65504.0, 3e5, 0.5, -2.0])
    x[40:48] = torch.tensor(TIES)
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def cpu_copy(q):
    return symmetric.SymQuantized(q.packed.cpu(), q.scales.cpu(), q.bits, q.group_size, q.numel)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_and_dequantize_match_the_spec(tk, dtype, bits, stochastic):
    triton_sym, device = tk
    x = awkward(333, dtype)
    for group in (8, 40):
        ref = symmetric.quantize(x, bits, group, stochastic=stochastic, seed=4)
        got = triton_sym.sym_quantize(x.to(device), bits, group, stochastic=stochastic, seed=4)
        assert same_bits(ref.packed, got.packed) and same_bits(ref.scales, got.scales), group
        assert same_bits(symmetric.dequantize(ref), triton_sym.sym_dequantize(got))
        assert same_bits(symmetric.dequantize(ref).to(torch.bfloat16), triton_sym.sym_dequantize(got, torch.bfloat16))


@pytest.mark.parametrize("a_dtype", DTYPES)
@pytest.mark.parametrize("m_dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fused_update_and_apply_delta_match_the_spec(tk, a_dtype, m_dtype, stochastic):
    triton_sym, device = tk
    a = awkward(200, a_dtype, seed=1)
    m0 = (torch.randn(200, generator=torch.Generator().manual_seed(2)) * 3).to(m_dtype)
    m_ref, m_dev = m0.clone(), m0.clone().to(device)
    q_ref = symmetric.update(a, m_ref, 2, 16, stochastic=stochastic, seed=3)
    q_dev = triton_sym.sym_update(a.to(device), m_dev, 2, 16, stochastic=stochastic, seed=3)
    assert same_bits(q_ref.packed, q_dev.packed) and same_bits(q_ref.scales, q_dev.scales)
    assert same_bits(m_ref, m_dev)
    # a CPU receiver of the device's message, and a device receiver of the CPU's, both land on the same bits
    assert same_bits(symmetric.apply_delta(m0.clone(), cpu_copy(q_dev)), m_ref)
    q_back = symmetric.SymQuantized(q_ref.packed.to(device), q_ref.scales.to(device), 2, 16, 200)
    assert same_bits(triton_sym.sym_apply_delta(m0.clone().to(device), q_back), m_ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_is_refused_and_the_update_spares_that_group(tk, bad):
    triton_sym, device = tk
    a = torch.randn(64)
    a[20] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        triton_sym.sym_quantize(a.to(device), 4, 8)
    m = torch.zeros(64, device=device)
    with pytest.raises(ValueError, match="group 2"):
        triton_sym.sym_update(a.to(device), m, 4, 8)
    assert same_bits(m[16:24], torch.zeros(8))  # the bad group's buffer is untouched


def test_malformed_quantized_tensors_are_refused(tk):
    triton_sym, device = tk
    q = triton_sym.sym_quantize(torch.randn(64, device=device), 4, 8)
    short = symmetric.SymQuantized(q.packed[:-1], q.scales, 4, 8, 64)
    with pytest.raises(ValueError):
        triton_sym.sym_dequantize(short)
    with pytest.raises(ValueError):
        triton_sym.sym_apply_delta(torch.zeros(63, device=device), q)


@pytest.mark.parametrize("stochastic", [False, True])
def test_the_benchmarks_kernel_launch_fills_what_sym_quantize_returns(tk, stochastic):
    """`sym_quantize_launcher` (the kernel alone, for `swarm bench kernels`) launches what `sym_quantize` does."""
    triton_sym, device = tk
    x = awkward(3000, torch.float32).to(device)
    for bits, group in ((2, 256), (3, 64), (8, 40)):  # word stores, byte stores, padded columns
        launch, got = triton_sym.sym_quantize_launcher(x, bits, group, stochastic=stochastic, seed=4)
        launch()
        want = triton_sym.sym_quantize(x, bits, group, stochastic=stochastic, seed=4)
        assert same_bits(got.packed.cpu(), want.packed.cpu()) and same_bits(got.scales.cpu(), want.scales.cpu())
