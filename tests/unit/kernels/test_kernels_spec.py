"""Behaviour of every CPU-runnable backend (the reference and the C++ path) against the quantizer's contract."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import BITS, DTYPES, KINDS, assert_within_bound, bitstream_oracle, over_the_wire, sample

from swarm.kernels import packed_nbytes, reference


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("numel", [1, 7, 8, 255, 256, 257, 1000, 4099])
def test_round_trip_within_one_step(backend, bits, dtype, stochastic, numel):
    x = sample("normal", numel, dtype, seed=numel)
    q = backend.quantize(x, bits, 256, stochastic=stochastic, seed=1)
    y = backend.dequantize(q)
    assert y.dtype == torch.float32 and y.shape == (numel,)
    assert q.packed.numel() == packed_nbytes(numel, bits) == math.ceil(numel * bits / 8)
    assert q.scales.numel() == q.mins.numel() == math.ceil(numel / 256)
    assert_within_bound(x.float(), q, y, stochastic)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [64, 256, 512])
def test_bound_holds_on_hard_data(backend, kind, bits, group_size):
    x = sample(kind, 3000)
    for stochastic in (False, True):
        q = backend.quantize(x, bits, group_size, stochastic=stochastic, seed=2)
        assert_within_bound(x, q, backend.dequantize(q), stochastic)


@pytest.mark.parametrize("kind", ["offset", "tiny", "normal"])
def test_step_stays_close_to_the_ideal_range_over_levels(backend, kind):
    """The exact grid costs a relative 2**-22 of the group's magnitude: far below a step on realistic data."""
    x = sample(kind, 4096)
    q = backend.quantize(x, 4, 256, stochastic=False)
    groups = x.view(-1, 256)
    ideal = (groups.amax(dim=1) - groups.amin(dim=1)) / 15
    assert bool((q.scales >= ideal).all())
    assert bool((q.scales <= ideal * 1.01).all())


def test_dequantization_is_exact_on_the_grid(backend):
    """min + code * scale is representable in float32: no rounding, so FMA or not, any device agrees."""
    x = torch.cat([sample(kind, 1024, seed=3) for kind in KINDS])
    for bits in BITS:
        q = backend.quantize(x, bits, 256, seed=4)
        codes = reference.unpack(q.packed, bits, q.numel).double()
        mins = q.mins.double().repeat_interleave(256)[: q.numel]
        scales = q.scales.double().repeat_interleave(256)[: q.numel]
        exact = mins + codes * scales
        y = backend.dequantize(q)
        assert torch.equal(y.double(), exact)


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -3.75, 1e-40, -1e-45, 123456.789, 3e37, 1.0 + 2**-23])
@pytest.mark.parametrize("bits", BITS)
def test_constant_groups_reconstruct_exactly(backend, value, bits):
    x = torch.full((300,), value)
    for stochastic in (False, True):
        q = backend.quantize(x, bits, 256, stochastic=stochastic)
        assert torch.equal(backend.dequantize(q), x)
        assert bool((q.scales == 0).all())
        assert bool((reference.unpack(q.packed, bits, 300) == 0).all())


def test_zero_groups_among_others(backend):
    x = sample("normal", 1024)
    x[256:512] = 0
    q = backend.quantize(x, 2, 256, stochastic=True, seed=0)
    y = backend.dequantize(q)
    assert bool((y[256:512] == 0).all())
    assert q.scales[1] == 0 and q.mins[1] == 0


@pytest.mark.parametrize("shape", [(0,), (3, 0), (5, 7, 3), (1,), (2, 256), (33, 9), (4, 1, 8, 8)])
def test_any_shape_is_flattened_row_major(backend, shape):
    x = torch.randn(shape)
    q = backend.quantize(x, 4, 64, stochastic=False)
    assert q.numel == x.numel()
    y = backend.dequantize(q)
    assert y.shape == (x.numel(),)
    assert_within_bound(x, q, y, stochastic=False)
    flat = backend.quantize(x.reshape(-1), 4, 64, stochastic=False)
    assert torch.equal(q.packed, flat.packed)


def test_non_contiguous_input_is_its_logical_order(backend):
    x = torch.randn(48, 40)
    q = backend.quantize(x.t(), 3, 64, stochastic=False)
    assert torch.equal(q.packed, backend.quantize(x.t().contiguous(), 3, 64, stochastic=False).packed)


def test_empty_tensors(backend):
    for dtype in DTYPES:
        q = backend.quantize(torch.empty(0, dtype=dtype), 2, 256)
        assert q.numel == 0 and q.packed.numel() == 0 and q.scales.numel() == 0
        assert backend.dequantize(q).shape == (0,)
        m = torch.empty(0, dtype=torch.float16)
        q = backend.aqsgd_update(torch.empty(0, dtype=dtype), m, 2, 256)
        backend.apply_delta(m, q)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 300, 999])
def test_nan_and_inf_raise(backend, bad, where):
    x = torch.randn(1000)
    x[where] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        backend.quantize(x, 4, 256)
    with pytest.raises(ValueError, match="NaN or Inf"):
        backend.aqsgd_update(x, torch.zeros(1000, dtype=torch.float16), 4, 256)


def test_too_large_raises(backend):
    for x in (torch.tensor([0.0, 2.0**126]), torch.tensor([-3e38, 3e38])):
        with pytest.raises(ValueError, match="too large"):
            backend.quantize(x, 8, 256)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [1, 5, 8, 13, 64, 77])
def test_bitstream_layout(backend, bits, numel):
    """Element i occupies stream bits [i*bits, (i+1)*bits), little-endian; pad bits are zero."""
    x = torch.arange(numel, dtype=torch.float32) % (2**bits)
    x[0], x[-1] = 0, 2**bits - 1  # min 0 and scale 1: the codes are the values
    if numel == 1:
        x[0] = 0
    q = backend.quantize(x, bits, 128, stochastic=False)  # one group
    codes = [int(v) for v in x.tolist()]
    assert bytes(q.packed.tolist()) == bitstream_oracle(codes, bits)


@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_rounding_is_unbiased(backend, bits):
    """Mean of deQ(Q(x)) over many seeds converges to x; round-to-nearest would not."""
    x = sample("normal", 512, seed=5)
    draws = 400
    total = torch.zeros(512, dtype=torch.float64)
    for seed in range(draws):
        q = backend.quantize(x, bits, 256, stochastic=True, seed=seed)
        total += backend.dequantize(q).double()
    step = q.scales.double().repeat_interleave(256)
    sigma = step / 2 / math.sqrt(draws)  # deQ is x + a zero-mean error of variance <= step**2 / 4
    z = (total / draws - x.double()) / sigma
    assert float(z.abs().max()) < 6.0
    assert abs(float(z.mean())) < 6.0 / math.sqrt(512)  # no systematic bias across elements


def test_seed_determinism(backend):
    x = sample("normal", 5000)
    a = backend.quantize(x, 2, 256, seed=7)
    assert torch.equal(a.packed, backend.quantize(x, 2, 256, seed=7).packed)
    assert not torch.equal(a.packed, backend.quantize(x, 2, 256, seed=8).packed)
    assert not torch.equal(backend.quantize(x, 2, 256).packed, backend.quantize(x, 2, 256).packed)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_to_dtype_is_the_float32_result_cast(backend, out_dtype):
    q = backend.quantize(sample("mixed", 2000), 8, 256)
    assert torch.equal(backend.dequantize(q, out_dtype), backend.dequantize(q).to(out_dtype))


def test_dequantize_into_a_given_tensor(backend):
    q = backend.quantize(sample("normal", 1000), 4, 256)
    for dtype in DTYPES:
        out = torch.full((10, 100), 7.0, dtype=dtype)
        assert backend.dequantize(q, dtype, out=out) is out
        assert torch.equal(out.view(-1), backend.dequantize(q, dtype))
    for bad in (torch.empty(999), torch.empty(1000, dtype=torch.float16), torch.empty(100, 10).t()):
        with pytest.raises(ValueError):
            backend.dequantize(q, out=bad)


@pytest.mark.parametrize("buffer_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("input_dtype", DTYPES)
def test_aqsgd_update_equals_quantize_then_apply_delta(backend, buffer_dtype, input_dtype):
    a = sample("normal", 1500, input_dtype, seed=1)
    m = (0.9 * sample("normal", 1500, seed=1)).to(buffer_dtype).view(30, 50)
    expected_m = m.clone()
    q = backend.aqsgd_update(a, m, 4, 256, stochastic=False)
    expected_q = backend.quantize(a.float() - expected_m.reshape(-1).float(), 4, 256, stochastic=False)
    assert torch.equal(q.packed, expected_q.packed) and torch.equal(q.scales, expected_q.scales)
    backend.apply_delta(expected_m, expected_q)
    assert torch.equal(m, expected_m) and m.shape == (30, 50)


@pytest.mark.parametrize("buffer_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_sender_and_receiver_buffers_stay_bit_identical(backend, buffer_dtype, bits):
    """Many AQ-SGD rounds of a drifting activation: the receiver only sees q's bytes."""
    generator = torch.Generator().manual_seed(0)
    activation = torch.randn(8, 96, generator=generator)
    sender = activation.to(buffer_dtype)  # first sight: the full activation was sent
    receiver = sender.clone()
    for step in range(60):
        activation = activation + 0.05 * torch.randn(activation.shape, generator=generator)
        q = backend.aqsgd_update(activation, sender, bits, 256, seed=step)
        backend.apply_delta(receiver, over_the_wire(q))
        assert torch.equal(sender, receiver), f"buffers diverged at round {step}"
    assert float((activation - sender.float()).norm() / activation.norm()) < 0.2  # it tracks the activation


def test_buffer_converges_to_a_fixed_activation(backend):
    a = sample("normal", 2048)
    m = torch.zeros(2048, dtype=torch.float16)
    errors = []
    for step in range(12):
        backend.aqsgd_update(a, m, 2, 256, seed=step)
        errors.append(float((a - m.float()).norm() / a.norm()))
    assert errors[-1] < 0.01 < errors[0]


@pytest.mark.parametrize("bad_m", ["shape", "dtype", "layout"])
def test_bad_buffers_are_rejected(backend, bad_m):
    a = torch.randn(64, 8)
    m = {
        "shape": torch.zeros(100, dtype=torch.float16),
        "dtype": torch.zeros(512, dtype=torch.int32),
        "layout": torch.zeros(8, 64, dtype=torch.float16).t(),
    }[bad_m]
    with pytest.raises(ValueError):
        backend.aqsgd_update(a, m, 4, 256)


@pytest.mark.parametrize("args", [(torch.randn(10), 5, 256), (torch.randn(10), 4, 0), (torch.arange(10), 4, 256)])
def test_bad_arguments_are_rejected(backend, args):
    with pytest.raises(ValueError):
        backend.quantize(*args)
