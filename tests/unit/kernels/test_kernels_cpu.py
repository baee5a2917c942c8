"""The C++ CPU path against the reference: bit for bit where the spec is deterministic; its build and threads."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import BITS, DTYPES, KINDS, sample

from swarm.kernels import cpu, reference

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")


def assert_same(a, b) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.mins, b.mins)
    assert (a.bits, a.group_size, a.numel) == (b.bits, b.group_size, b.numel)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 9, 256, 1000, 33333])
@pytest.mark.parametrize("group_size", [8, 64, 200, 256, 512])
def test_nearest_matches_reference_bit_for_bit(bits, dtype, numel, group_size):
    x = sample("normal", numel, dtype, seed=numel)
    assert_same(
        cpu.quantize(x, bits, group_size, stochastic=False), reference.quantize(x, bits, group_size, stochastic=False)
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", BITS)
def test_hard_data_matches_reference(kind, bits):
    x = sample(kind, 5000, seed=bits)
    assert_same(cpu.quantize(x, bits, 256, stochastic=False), reference.quantize(x, bits, 256, stochastic=False))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_and_apply_delta_match_reference(bits, out_dtype):
    x = sample("mixed", 3001, seed=bits)
    q = cpu.quantize(x, bits, 128, stochastic=True, seed=3)
    assert torch.equal(cpu.dequantize(q, out_dtype), reference.dequantize(q, out_dtype))
    m = sample("normal", 3001, out_dtype, seed=9)
    assert torch.equal(cpu.apply_delta(m.clone(), q), reference.apply_delta(m.clone(), q))


@pytest.mark.parametrize("input_dtype", DTYPES)
@pytest.mark.parametrize("buffer_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 3])
def test_fused_update_matches_reference(input_dtype, buffer_dtype, bits):
    a = sample("outliers", 2500, input_dtype, seed=1)
    m_cpu = (0.5 * sample("normal", 2500, seed=2)).to(buffer_dtype)
    m_ref = m_cpu.clone()
    q_cpu = cpu.aqsgd_update(a, m_cpu, bits, 256, stochastic=False)
    assert_same(q_cpu, reference.aqsgd_update(a, m_ref, bits, 256, stochastic=False))
    assert torch.equal(m_cpu, m_ref)


def test_stochastic_codes_do_not_depend_on_the_thread_count():
    x = sample("normal", 3 * cpu._ELEMENTS_PER_THREAD + 100)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.quantize(x, 4, 256, seed=11)
        torch.set_num_threads(2)
        two = cpu.quantize(x, 4, 256, seed=11)
        m = torch.zeros(x.numel(), dtype=torch.float16)
        cpu.aqsgd_update(x, m, 4, 256, seed=11)
    finally:
        torch.set_num_threads(threads)
    assert_same(one, two)
    assert torch.equal(m, reference.apply_delta(torch.zeros_like(m), one))


def test_errors_in_any_thread_are_reported():
    x = sample("normal", 3 * cpu._ELEMENTS_PER_THREAD)
    x[-5] = float("nan")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(ValueError, match=f"group {(x.numel() - 5) // 256}"):
            cpu.quantize(x, 4, 256)
    finally:
        torch.set_num_threads(threads)


def test_supports_only_byte_aligned_groups_on_cpu():
    assert cpu.supports(torch.device("cpu"), 256)
    assert not cpu.supports(torch.device("cpu"), 100)
    assert not cpu.supports(torch.device("meta"), 256)


def test_a_missing_compiler_falls_back_with_one_warning(monkeypatch):
    import swarm.kernels as kernels

    def no_compiler():
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")

    monkeypatch.setattr(cpu, "_build", no_compiler)
    cpu._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="slow reference path"):
            assert not cpu.available()
        assert kernels.backend_name("cpu") == "reference"
        q = kernels.quantize(torch.randn(100), 4)  # still works, on the reference
        assert q.numel == 100
    finally:
        monkeypatch.undo()
        cpu._library.cache_clear()
    assert cpu.available()


def test_the_build_is_cached_on_disk():
    path = cpu._build()
    assert path.exists() and path.stat().st_size > 0
    assert cpu._build() == path  # found again, not rebuilt
