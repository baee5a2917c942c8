"""`lowrank`'s subspace coding (`+sN`, `swarm.compression.subspace`): activations in the top-r eigenbasis of the
message's own Gram matrix, the coefficients on one common step. Round trips within a stated bound (zeros, bf16,
odd sizes, an empty tensor), fewer bytes than 3-bit channel-scaled codes at a lower error on correlated channels,
the labels and their validation, and a tampered message refused by `lowrank`'s own checks."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, WireError, decoder_for, frame, make_codec, subspace, unframe
from swarm.compression.factors import COARSEST_CODE, pack_factor
from swarm.compression.subspace import (
    basis_steps,
    coefficient_steps,
    least_squares_coefficients,
    subspace_basis,
)
from swarm.proto import wire_pb2


def correlated_activations(batch: int = 2, tokens: int = 32, hidden: int = 32, rank: int = 6, seed: int = 0):
    """[B, T, D] rows in a few loud directions plus a quiet floor and a shared mean, like a residual stream."""
    gen = torch.Generator().manual_seed(seed)
    loud = torch.randn(batch * tokens, rank, generator=gen) * torch.linspace(4, 1, rank)
    rows = loud @ torch.randn(rank, hidden, generator=gen) + 0.05 * torch.randn(batch * tokens, hidden, generator=gen)
    return (rows + torch.randn(hidden, generator=gen)).view(batch, tokens, hidden)


def round_trip(label: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    cfg = CodecConfig.parse(label)
    chunks = list(frame(make_codec(cfg).encode(x), zstd_level=1))
    msg = unframe(chunks)
    return decoder_for(msg).decode(msg), sum(c.ByteSize() for c in chunks)


def rel_error(out: torch.Tensor, x: torch.Tensor) -> float:
    return float((out.float() - x.float()).norm() / x.float().norm())


def test_labelled_parsed_and_validated():
    cfg = CodecConfig.parse("lowrank24+f8+s30")
    assert (cfg.rank, cfg.factor_bits, cfg.subspace_step_percent) == (24, 8, 30)
    assert cfg.label == "lowrank24+f8+s30" and CodecConfig.parse(cfg.label) == cfg
    assert CodecConfig.parse("lowrank4+f8").subspace_step_percent == 0  # PowerSGD unless told
    with pytest.raises(ValueError, match=r"\+f8"):
        CodecConfig.parse("lowrank8+s30")  # the coefficients' common step is an int8 step
    with pytest.raises(ValueError, match="0..1000"):
        CodecConfig.parse("lowrank8+f8+s1001")
    with pytest.raises(ValueError, match="ranked"):
        CodecConfig("gradq", subspace_step_percent=30)
    with pytest.raises(ValueError, match="ranked"):
        CodecConfig.parse("acsgd2+s30")


def test_the_basis_is_orthonormal_loudest_first_and_sign_fixed():
    x = correlated_activations().view(-1, 32)
    basis = subspace_basis(x, 8)
    torch.testing.assert_close(basis.t() @ basis, torch.eye(8), atol=1e-5, rtol=0)
    energy = (x @ basis).pow(2).sum(0)
    assert bool((energy[:-1] >= energy[1:] - 1e-3).all())
    peak = basis.gather(0, basis.abs().argmax(dim=0, keepdim=True))
    assert bool((peak > 0).all())
    torch.testing.assert_close(subspace_basis(-x, 8), basis)  # the same basis whatever the signs


def test_coefficients_fit_the_decoded_basis_and_steps_never_clip():
    x = correlated_activations().view(-1, 32)
    basis = subspace_basis(x, 32) * 1.01  # a basis as int8 codes decode it: nearly, not exactly, orthonormal
    coefficients = least_squares_coefficients(x, basis)
    torch.testing.assert_close(coefficients @ basis.t(), x, atol=1e-3, rtol=1e-3)
    steps = coefficient_steps(coefficients, 0.01)
    assert bool((steps >= 0.01).all()) and bool(((coefficients / steps).abs() <= 127 + 1e-4).all())


@pytest.mark.parametrize("shape", [(2, 32, 32), (3, 7, 32), (1, 1, 32), (40, 32)])
def test_round_trips_within_the_bound_of_the_rank_and_the_step(shape):
    x = correlated_activations().reshape(-1)[: torch.Size(shape).numel()].view(shape)
    out, _ = round_trip("lowrank8+f8+s10", x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_error(out, x) < 0.05  # the 6 loud directions and the mean fit in rank 8; the rest is the floor


def test_zeros_empty_bf16_and_a_full_rank_message():
    out, _ = round_trip("lowrank8+f8+s30", torch.zeros(2, 8, 32))
    assert bool((out == 0).all())
    out, _ = round_trip("lowrank8+f8+s30", torch.zeros(0, 4, 32))
    assert out.shape == (0, 4, 32)
    x = correlated_activations()
    out, _ = round_trip("lowrank8+f8+s10", x.bfloat16())
    assert out.dtype == torch.bfloat16 and rel_error(out, x) < 0.05
    white = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(1))
    out, _ = round_trip("lowrank16+f8+s5", white)  # rank = hidden: only the steps' error is left
    assert rel_error(out, white) < 0.03


def test_a_token_is_a_row_the_hidden_size_a_column():
    msg = make_codec(CodecConfig.parse("lowrank4+f8+s30")).encode(correlated_activations(2, 8, 32))
    assert (msg.quantized.group_size, msg.quantized_full.group_size) == (16, 32)  # P: 2 x 8 tokens, Q: hidden
    msg = make_codec(CodecConfig.parse("lowrank4+f8+s30+g64")).encode(correlated_activations(2, 8, 32))
    assert (msg.quantized.group_size, msg.quantized_full.group_size) == (16, 32)  # a group size splits no token
    msg = make_codec(CodecConfig.parse("lowrank4+f8+s30+g64")).encode(correlated_activations(2, 8, 32).reshape(-1))
    assert msg.quantized_full.group_size == 64  # a flat tensor has no tokens: the group size is the row


def test_fewer_bytes_than_3_bit_channel_codes_at_a_lower_error_on_correlated_channels():
    x = correlated_activations(4, 64, 64, rank=8)
    sub, sub_bytes = round_trip("lowrank12+f8+s30", x)
    ch, ch_bytes = round_trip("directq3+nr", x)
    assert rel_error(sub, x) < rel_error(ch, x) and sub_bytes < ch_bytes
    coarse, coarse_bytes = round_trip("lowrank12+f8+s100", x)  # a larger step: fewer bytes, more error
    assert coarse_bytes < sub_bytes and rel_error(coarse, x) > rel_error(sub, x)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: setattr(m.quantized, "payload", b"\x80" + m.quantized.payload[1:]),
        lambda m: setattr(m.quantized, "scales", m.quantized.scales[4:]),
        lambda m: setattr(m.quantized_full, "group_size", 16),
        lambda m: setattr(m.quantized, "scales", b"\x00\x00\xc0\x7f" + m.quantized.scales[4:]),  # NaN
        lambda m: m.ClearField("quantized_full"),
    ],
)
def test_a_tampered_subspace_message_is_refused_by_lowranks_checks(tamper):
    codec = make_codec(CodecConfig.parse("lowrank4+f8+s30"))
    msg = codec.encode(correlated_activations(2, 8, 32))
    assert msg.codec == wire_pb2.LOWRANK
    tamper(msg)
    with pytest.raises(WireError):
        codec.decode(msg)


def test_a_wide_message_takes_the_randomized_basis_and_keeps_the_exact_ones_energy():
    gen = torch.Generator().manual_seed(5)
    width = subspace.EXACT_MAX_COLS + 88  # past the exact eigendecomposition
    loud = torch.randn(256, 40, generator=gen) * torch.logspace(1, -1, 40)
    x = loud @ torch.randn(40, width, generator=gen) / width**0.5 + 0.05 * torch.randn(256, width, generator=gen)
    basis = subspace_basis(x, 16)
    torch.testing.assert_close(basis.t() @ basis, torch.eye(16), atol=1e-5, rtol=0)
    assert torch.equal(basis, subspace_basis(x, 16))  # seeded: the same message codes the same way
    exact = torch.linalg.eigh((x.t() @ x).double())[1].flip(1)[:, :16].float()
    assert float((x @ basis).pow(2).sum()) > 0.999 * float((x @ exact).pow(2).sum())


def test_basis_columns_are_coarser_the_quieter_their_direction_and_bounded():
    x = correlated_activations(4, 64, 64, rank=8).view(-1, 64)
    basis = subspace_basis(x, 12)
    steps = basis_steps(x, basis, step=0.3 * float(x.pow(2).mean().sqrt()))
    peak = basis.abs().amax(dim=0)
    assert bool((steps >= peak / 127 - 1e-9).all()) and bool((steps <= peak / COARSEST_CODE + 1e-9).all())
    codes = steps / peak  # the share of a column's peak one code step is: larger for quieter directions
    assert float(codes[-1]) > 4 * float(codes[0])  # the floor's directions against the loudest
    energy = (x @ basis).pow(2).sum(0)
    free = (steps > peak / 127 * 1.001) & (steps < peak / COARSEST_CODE * 0.999)
    assert int(free.sum()) >= 4
    cost = steps[free] * energy[free].sqrt()  # a step times its direction's rms: the same for every free column
    torch.testing.assert_close(cost, cost[:1].expand_as(cost), rtol=1e-4, atol=0)


def test_energy_set_basis_steps_send_fewer_bytes_at_nearly_the_same_error():
    x = correlated_activations(4, 64, 64, rank=8)
    tuned, tuned_bytes = round_trip("lowrank12+f8+s30", x)
    with pytest.MonkeyPatch.context() as mp:  # every column on its finest step, as before s69
        mp.setattr(subspace, "BASIS_MIN_GRAM_EIGENVALUE", 2.0)  # no decoded basis passes: the fallback
        finest, finest_bytes = round_trip("lowrank12+f8+s30", x)
    assert tuned_bytes < 0.95 * finest_bytes
    assert rel_error(tuned, x) < 1.05 * rel_error(finest, x)


def test_a_basis_too_coarse_to_stay_orthonormal_falls_back_to_the_finest_steps():
    x = correlated_activations(4, 64, 64, rank=8).view(-1, 64)
    basis = subspace_basis(x, 12)
    finest = wire_pb2.Quantized()
    pack_factor(basis, 8, finest)
    q = wire_pb2.Quantized()
    subspace._pack_basis(x, basis, 0.3, q)
    assert q.payload != finest.payload  # tuned steps
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subspace, "BASIS_MIN_GRAM_EIGENVALUE", 2.0)
        q = wire_pb2.Quantized()
        subspace._pack_basis(x, basis, 0.3, q)
    assert q.payload == finest.payload and q.scales == finest.scales
    q = wire_pb2.Quantized()
    subspace._pack_basis(x, basis, 0.0, q)  # a step of 0 (+s0): nothing to weigh the columns by
    assert q.payload == finest.payload
