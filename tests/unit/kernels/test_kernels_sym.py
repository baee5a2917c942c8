"""The symmetric (acsgd) quantizer: the C++ path matches the torch specification bit for bit, and the codec uses it."""

from __future__ import annotations

import pytest
import torch

import swarm.kernels as kernels
from swarm.compression import CodecConfig, LinkState, make_codec
from swarm.kernels import cpu, symmetric

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TIES = [4.0, 0.25, 0.75, 1.25, -0.25, -0.75, 1.0, 3.0]
"""A group of 8 whose quotients tie (x / step = k + 1/2 at 2 and 4 bits): rounding half to even decides them."""

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")


def awkward(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values over 12 decades, a zero group, fp16-underflowing and fp16-overflowing groups, -0.0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.logspace(-9, 3, numel)
    x[:8] = 0.0
    x[8:16] = -0.0
    x[16:24] = torch.tensor([1e-9, -3e-9, 2e-10, -1e-12, 5e-9, 0.0, -1e-9, 1e-9])  # the fp16 scale rounds to 0
    if dtype != torch.float16:
        x[24:32] = torch.tensor([7e4, -9e4, 1.0, 65519.0, -65504.0, 3e5, 0.5, -2.0])  # past fp16's largest
    x[40:48] = torch.tensor(TIES)
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("group", [8, 128, 40])
def test_cpu_quantize_matches_the_spec_bit_for_bit(dtype, bits, stochastic, group):
    x = awkward(1003, dtype)  # a partial last group
    ref = symmetric.quantize(x, bits, group, stochastic=stochastic, seed=11)
    got = cpu.sym_quantize(x, bits, group, stochastic=stochastic, seed=11)
    assert same_bits(ref.packed, got.packed) and same_bits(ref.scales, got.scales)
    assert same_bits(symmetric.dequantize(ref), cpu.sym_dequantize(got))
    for out in (torch.float16, torch.bfloat16):
        assert same_bits(symmetric.dequantize(ref).to(out), cpu.sym_dequantize(got, out))


@pytest.mark.parametrize("a_dtype", DTYPES)
@pytest.mark.parametrize("m_dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fused_update_moves_both_buffers_alike_across_backends(a_dtype, m_dtype, stochastic):
    a = awkward(1000, a_dtype, seed=1)
    m0 = (torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 3).to(m_dtype)
    m_ref, m_cpu = m0.clone(), m0.clone()
    q_ref = symmetric.update(a, m_ref, 2, 40, stochastic=stochastic, seed=3)
    q_cpu = cpu.sym_update(a, m_cpu, 2, 40, stochastic=stochastic, seed=3)
    assert same_bits(q_ref.packed, q_cpu.packed) and same_bits(q_ref.scales, q_cpu.scales)
    assert same_bits(m_ref, m_cpu)
    # the receiver, on either backend, from the sender's message on the other
    assert same_bits(cpu.sym_apply_delta(m0.clone(), q_ref), m_ref)
    assert same_bits(symmetric.apply_delta(m0.clone(), q_cpu), m_cpu)


def test_the_spec_is_the_old_torch_quantizer_for_nearest_rounding():
    """Nearest codes and scales are those the codec produced before the kernels (its clip, round-half-even)."""
    x = awkward(4096, torch.float32)
    half = 2
    g = x.view(-1, 128)
    scale = g.abs().amax(1).clamp(max=symmetric.FP16_MAX).half()
    step = (scale.float() / half).clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    codes = (torch.round(g / step).clamp(-half, half - 1) + half).to(torch.uint8).reshape(-1)
    got, scales = symmetric.quantize_codes(x, 2, 128)
    assert torch.equal(got, codes) and same_bits(scales, scale)
    assert torch.equal(cpu.sym_quantize(x, 2, 128).packed, kernels.reference.pack(codes, 2))


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.full((1 << 16,), 0.3)
    x[0] = 1.0  # scale 1: 2-bit step 0.5, 0.3 sits between the levels 0 and 0.5
    a = cpu.sym_quantize(x, 2, 1 << 16, stochastic=True, seed=1)
    assert torch.equal(a.packed, cpu.sym_quantize(x, 2, 1 << 16, stochastic=True, seed=1).packed)
    assert not torch.equal(a.packed, cpu.sym_quantize(x, 2, 1 << 16, stochastic=True, seed=2).packed)
    mean = float(cpu.sym_dequantize(a)[1:].mean())
    assert abs(mean - 0.3) < 0.01


def test_noise_is_the_scalar_hash():
    k0, k1 = symmetric.keys(9)
    u = symmetric.noise(5, k0, k1)
    for i in range(5):
        h = symmetric.mix32_int(i ^ k0 ^ symmetric.mix32_int(k1))
        assert float(u[i]) == (h >> 8) * 2.0**-24


@pytest.mark.parametrize("backend", [cpu.sym_quantize, symmetric.quantize])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(backend, bad):
    x = torch.randn(64)
    x[37] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        backend(x, 4, 8)


@pytest.mark.parametrize(
    "change",
    [
        {"packed": torch.zeros(3, dtype=torch.uint8)},  # short: the C++ would read past it
        {"scales": torch.zeros(1, dtype=torch.float16)},
        {"scales": torch.zeros(8, dtype=torch.float32)},
        {"bits": 5},
        {"numel": 1 << 33},
    ],
)
def test_inconsistent_quantized_tensors_are_refused_before_the_cpu_reads_them(change):
    q = cpu.sym_quantize(torch.randn(64), 4, 8)
    fields = {"packed": q.packed, "scales": q.scales, "bits": 4, "group_size": 8, "numel": 64, **change}
    bad = symmetric.SymQuantized(**fields)
    with pytest.raises(ValueError):
        cpu.sym_dequantize(bad)
    with pytest.raises(ValueError):
        cpu.sym_apply_delta(torch.zeros(64), bad)


def test_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError):
        cpu.sym_update(torch.randn(64), torch.zeros(63), 2, 8)
    with pytest.raises(ValueError):
        cpu.sym_update(torch.randn(64), torch.zeros(128)[::2], 2, 8)


def test_dispatch_picks_the_cpu_kernels_for_byte_aligned_groups():
    assert kernels.sym_backend_name("cpu", 128) == "cpu"
    assert kernels.sym_backend_name("cpu", 12) == "reference"
    x = awkward(120, torch.float32)
    assert same_bits(kernels.sym_quantize(x, 4, 12).packed, symmetric.quantize(x, 4, 12).packed)


@pytest.mark.parametrize("label", ["acsgd2+ch+nr", "acsgd2+ch", "acsgd4+sr"])
def test_the_codec_sends_the_same_bytes_on_the_cpu_kernels_as_on_the_spec(label, monkeypatch):
    def messages():
        cfg = CodecConfig.parse(label, seed=5, first_sight_bits=4)
        codec, send, recv = make_codec(cfg), LinkState(cfg), LinkState(cfg)
        gen = torch.Generator().manual_seed(0)
        out = []
        for step in range(3):
            x = torch.randn(3, 16, 40, generator=gen)
            msg = codec.encode(x, sample_ids=[1, 2, 3 + step], state=send)
            out.append((msg.SerializeToString(), codec.decode(msg, state=recv)))
        return out

    fast = messages()
    monkeypatch.setattr(kernels, "_sym_backend", lambda device, group: kernels._SymReference)
    slow = messages()
    for (a, ya), (b, yb) in zip(fast, slow, strict=True):
        assert a == b and same_bits(ya, yb)


def test_ties_round_half_to_even():
    x = torch.tensor(TIES)
    codes, _ = symmetric.quantize_codes(x, 4, 8)
    assert (codes.int() - 8).tolist() == [7, 0, 2, 2, 0, -2, 2, 6]  # 8 clips to 7; 0.5->0, 1.5->2, 2.5->2
    assert torch.equal(cpu.sym_quantize(x, 4, 8).packed, symmetric.quantize(x, 4, 8).packed)
    assert torch.equal(cpu.sym_quantize(x, 2, 8).packed, symmetric.quantize(x, 2, 8).packed)


def test_threads_split_the_groups_without_changing_a_bit():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 2**20 elements: the C++ path splits them across two threads
    try:
        x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5))
        m_ref, m_cpu = torch.zeros(1 << 20, dtype=torch.float16), torch.zeros(1 << 20, dtype=torch.float16)
        q_ref = symmetric.update(x, m_ref, 2, 128, stochastic=True, seed=1)
        q_cpu = cpu.sym_update(x, m_cpu, 2, 128, stochastic=True, seed=1)
    finally:
        torch.set_num_threads(threads)
    assert same_bits(q_ref.packed, q_cpu.packed) and same_bits(q_ref.scales, q_cpu.scales) and same_bits(m_ref, m_cpu)
