"""The Triton kernels against the reference: on CUDA, or in Triton's interpreter on CPU tensors.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function, so the variable must be set before
Triton is first imported in the process: without CUDA, `test_kernels_triton.py` runs this file in a
subprocess with TRITON_INTERPRET=1 (run it directly the same way to see each case). The interpreter runs every
program in numpy, so the tensors here are small.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from kernel_helpers import BITS, DTYPES, assert_within_bound, over_the_wire, sample

from swarm.kernels import reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRETED):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (test_kernels_triton.py runs it so)", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in cast"),  # numpy, as the interpreter casts inf
    pytest.mark.filterwarnings("ignore:invalid value encountered"),  # numpy, on the NaN/Inf inputs
]


@pytest.fixture(scope="module")
def triton_kernels():
    device = torch.device("cpu" if INTERPRETED else "cuda")
    return importlib.import_module("swarm.kernels.triton_kernels"), device


def to_reference(q):
    """q's tensors on the CPU, for the reference and for comparisons."""
    return type(q)(q.packed.cpu(), q.scales.cpu(), q.mins.cpu(), q.bits, q.group_size, q.numel)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 13, 200, 1000])
def test_nearest_matches_reference_bit_for_bit(triton_kernels, bits, dtype, numel):
    tk, device = triton_kernels
    x = sample("normal", numel, dtype, seed=numel)
    q = to_reference(tk.quantize(x.to(device), bits, 64, stochastic=False))
    expected = reference.quantize(x, bits, 64, stochastic=False)
    assert torch.equal(q.packed, expected.packed)
    assert torch.equal(q.scales, expected.scales) and torch.equal(q.mins, expected.mins)


@pytest.mark.parametrize("kind", ["offset", "tiny", "huge", "mixed", "outliers"])
def test_hard_data_matches_reference(triton_kernels, kind):
    tk, device = triton_kernels
    x = sample(kind, 700)
    for bits, group_size in ((2, 256), (8, 32)):
        q = to_reference(tk.quantize(x.to(device), bits, group_size, stochastic=False))
        assert torch.equal(q.packed, reference.quantize(x, bits, group_size, stochastic=False).packed)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_and_apply_delta_match_reference(triton_kernels, bits, out_dtype):
    tk, device = triton_kernels
    q = reference.quantize(sample("mixed", 333, seed=bits), bits, 64, seed=1)
    q_device = type(q)(q.packed.to(device), q.scales.to(device), q.mins.to(device), bits, 64, q.numel)
    assert torch.equal(tk.dequantize(q_device, out_dtype).cpu(), reference.dequantize(q, out_dtype))
    out = torch.empty(333, dtype=out_dtype, device=device)
    assert tk.dequantize(q_device, out_dtype, out=out) is out
    assert torch.equal(out.cpu(), reference.dequantize(q, out_dtype))
    m = sample("normal", 333, out_dtype, seed=2)
    assert torch.equal(tk.apply_delta(m.clone().to(device), q_device).cpu(), reference.apply_delta(m.clone(), q))


@pytest.mark.parametrize("buffer_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("input_dtype", DTYPES)
def test_fused_update_matches_reference(triton_kernels, buffer_dtype, input_dtype):
    tk, device = triton_kernels
    a = sample("normal", 500, input_dtype, seed=3)
    m = (0.8 * sample("normal", 500, seed=3)).to(buffer_dtype)
    m_device = m.clone().to(device)
    q = to_reference(tk.aqsgd_update(a.to(device), m_device, 4, 64, stochastic=False))
    expected = reference.aqsgd_update(a, m, 4, 64, stochastic=False)
    assert torch.equal(q.packed, expected.packed)
    assert torch.equal(m_device.cpu(), m)


def test_stochastic_update_keeps_a_cpu_receiver_bit_identical(triton_kernels):
    """Sender on Triton, receiver on the CPU path (or the reference), over several rounds."""
    tk, device = triton_kernels
    generator = torch.Generator().manual_seed(0)
    activation = torch.randn(300, generator=generator)
    sender = activation.to(torch.float16).to(device)
    receiver = sender.cpu().clone()
    for step in range(5):
        activation = activation + 0.1 * torch.randn(300, generator=generator)
        q = to_reference(tk.aqsgd_update(activation.to(device), sender, 2, 64, seed=step))
        assert_within_bound(activation - receiver.float(), q, reference.dequantize(q), stochastic=True)
        reference.apply_delta(receiver, over_the_wire(q))
        assert torch.equal(sender.cpu(), receiver)


def test_stochastic_rounding_is_unbiased_and_seeded(triton_kernels):
    tk, device = triton_kernels
    x = sample("normal", 128, seed=4)
    draws = 120
    total = torch.zeros(128, dtype=torch.float64)
    for seed in range(draws):
        q = to_reference(tk.quantize(x.to(device), 2, 64, stochastic=True, seed=seed))
        y = reference.dequantize(q)
        assert_within_bound(x, q, y, stochastic=True)
        total += y.double()
    sigma = q.scales.double().repeat_interleave(64) / 2 / math.sqrt(draws)
    z = (total / draws - x.double()) / sigma
    assert float(z.abs().max()) < 6.0
    assert abs(float(z.mean())) < 6.0 / math.sqrt(128)
    again = to_reference(tk.quantize(x.to(device), 2, 64, stochastic=True, seed=draws - 1))
    assert torch.equal(again.packed, q.packed)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_and_inf_raise(triton_kernels, bad):
    tk, device = triton_kernels
    x = torch.randn(200)
    x[150] = bad
    with pytest.raises(ValueError, match="NaN or Inf.*group 2"):
        tk.quantize(x.to(device), 4, 64)
    m = torch.zeros(200, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="NaN or Inf"):
        tk.aqsgd_update(x.to(device), m, 4, 64)
    assert bool((m.cpu()[128:192] == 0).all())  # the failed group left its buffer alone
    with pytest.raises(ValueError, match="too large"):
        tk.quantize(torch.tensor([0.0, 3e38], device=device), 4, 64)


def test_empty_tensors(triton_kernels):
    tk, device = triton_kernels
    q = tk.quantize(torch.empty(0, device=device), 3, 64)
    assert q.packed.numel() == 0 and tk.dequantize(q).numel() == 0
    tk.aqsgd_update(torch.empty(0, device=device), torch.empty(0, dtype=torch.float16, device=device), 3, 64)


def test_supports_cuda_only(triton_kernels):
    tk, _ = triton_kernels
    assert tk.supports(torch.device("cuda"), 256)
    assert not tk.supports(torch.device("cuda"), 100)
    assert not tk.supports(torch.device("cpu"), 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_public_api_dispatches_cuda_tensors_to_triton():
    import swarm.kernels as kernels

    assert kernels.backend_name("cuda") == "triton"
    x = torch.randn(10000, device="cuda")
    q = kernels.quantize(x, 4, stochastic=False)
    assert q.packed.is_cuda
    assert torch.equal(q.packed.cpu(), kernels.quantize(x.cpu(), 4, stochastic=False).packed)


@pytest.mark.parametrize("stochastic", [False, True])
def test_the_benchmarks_kernel_launch_fills_what_quantize_returns(triton_kernels, stochastic):
    """`quantize_launcher` (the kernel alone, for `swarm bench kernels`) launches what `quantize` launches."""
    tk, device = triton_kernels
    x = sample("mixed", 3000).to(device)
    for bits, group_size in ((2, 256), (3, 64), (8, 24)):  # word stores, byte stores, padded columns
        launch, got = tk.quantize_launcher(x, bits, group_size, stochastic=stochastic, seed=5)
        launch()
        want = tk.quantize(x, bits, group_size, stochastic=stochastic, seed=5)
        assert torch.equal(got.packed.cpu(), want.packed.cpu()) and torch.equal(got.scales.cpu(), want.scales.cpu())
        assert torch.equal(got.mins.cpu(), want.mins.cpu())
