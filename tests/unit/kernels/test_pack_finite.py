"""The reference bit packing's whole-code path (1, 2, 4 and 8 bits: 8 / bits codes a byte) writes the bytes of the
bit-by-bit stream it replaced, and reads them back; `all_finite`'s one float64 sum answers what `isfinite().all()`
answers, for every float dtype and any place and mix of NaN, +Inf and -Inf (two infinities that cancel included)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.kernels import all_finite
from swarm.kernels.reference import _pack_bits, _unpack_bits, pack, unpack


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@given(n=st.integers(0, 300), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_pack_equals_the_bitstream(bits, n, seed):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = pack(codes, bits)
    assert torch.equal(packed, _pack_bits(codes, bits))
    assert torch.equal(unpack(packed, bits, n), codes)
    assert torch.equal(_unpack_bits(packed, bits, n), codes)


def test_pack_layout_is_little_endian_within_a_byte():
    # 2-bit codes 1, 2, 3, 0 -> 0b00_11_10_01; a partial byte is zero-padded above its codes
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001]
    assert pack(torch.tensor([3], dtype=torch.uint8), 2).tolist() == [0b11]
    assert pack(torch.tensor([0xA, 0x5, 0xF], dtype=torch.uint8), 4).tolist() == [0x5A, 0x0F]


SPECIALS = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@given(n=st.integers(0, 200), marks=st.lists(st.tuples(st.integers(0, 199), st.sampled_from(SPECIALS)), max_size=3),
       big=st.booleans(), seed=st.integers(0, 2**31))  # fmt: skip
@settings(max_examples=60, deadline=None)
def test_all_finite_answers_as_isfinite(dtype, n, marks, big, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if big and n:  # the dtype's largest finite values everywhere: their sum must not read as an overflow
        x = torch.full((n,), torch.finfo(dtype).max, dtype=dtype)
    for i, v in marks:
        if i < n:
            x[i] = v
    assert all_finite(x) == bool(torch.isfinite(x).all())


def test_cancelling_infinities_are_not_finite():
    assert not all_finite(torch.tensor([float("inf"), float("-inf"), 1.0]))
    assert all_finite(torch.empty(0)) and all_finite(torch.zeros(3, dtype=torch.int64))
