"""LOWRANK (PowerSGD factors of a gradient's matrix view): round trips, the warm start's power iteration, error
feedback on a fixed matrix, identical bytes and sums from two encoders and two decoders, and the stranger's
messages (wrong sizes, ranks, NaN/Inf factors, oversized, truncated) refused whole."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from swarm.compression import (
    CodecConfig,
    LinkState,
    WireError,
    WireLimits,
    codec_lowrank,
    decoder_for,
    frame,
    make_codec,
    unframe,
)
from swarm.compression.codec_lowrank import MAX_RANK, ROUNDING_SHARE, matrix_shape, powersgd_steps
from swarm.compression.codecs import BY_NAME, REGISTRY
from swarm.compression.factors import outer_sum, pack_factor
from swarm.proto import wire_pb2

LABELS = ["lowrank4+ef", "lowrank4+ef+f8", "lowrank1", "lowrank8+f8"]


def low_rank(rows: int, cols: int, rank: int, seed: int = 0, decay: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weights = torch.tensor([decay**k for k in range(rank)])
    return (torch.randn(rows, rank, generator=gen) * weights) @ torch.randn(rank, cols, generator=gen)


def test_registered_labelled_and_validated():
    assert REGISTRY[wire_pb2.LOWRANK] is BY_NAME["lowrank"]
    for label in LABELS:
        assert CodecConfig.parse(label).label == label
        assert CodecConfig.parse(label).wire_bits == 1
    cfg = CodecConfig.parse("lowrank8+ef+f8+g128")
    assert (cfg.rank, cfg.factor_bits, cfg.group_size, cfg.error_feedback) == (8, 8, 128, True)
    for bad in ("lowrank0", f"lowrank{MAX_RANK + 1}", "lowrank4+f2", "gradq4+f8"):
        with pytest.raises(ValueError):
            CodecConfig.parse(bad)
    with pytest.raises(ValueError, match="rank"):
        CodecConfig("gradq", rank=8)  # the rank is a ranked codec's
    assert CodecConfig.parse("gradq4+ef").bits == 4  # other codecs' digits stay bits


def test_matrix_view():
    assert matrix_shape(32768, 128) == (256, 128)
    assert matrix_shape(32768, None) == (256, 128)  # the largest divisor at most sqrt(numel)
    assert matrix_shape(32768, 100) == (256, 128)  # a row length that does not divide: the default view
    assert matrix_shape(7, None) == (7, 1) and matrix_shape(0, None) == (0, 1)


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("shape", [(64, 32), (7,), (3, 5, 8), (0,)])
def test_round_trips_through_the_framing(label, shape):
    cfg = CodecConfig.parse(label, seed=3)
    codec = make_codec(cfg)
    x = torch.randn(shape)
    msg = codec.encode(x, state=LinkState(cfg))
    back = unframe(frame(msg))
    y = decoder_for(back).decode(back)  # a decoder built from the message alone
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert torch.equal(y, codec.decode(msg))
    n = math.prod(shape)
    if n:
        sent = len(msg.quantized.payload) + len(msg.quantized.scales)
        sent += len(msg.quantized_full.payload) + len(msg.quantized_full.scales)
        assert codec.payload_nbytes(n) == sent
    else:
        assert not msg.HasField("quantized") and not msg.HasField("quantized_full")


@pytest.mark.parametrize("bits,tol", [(16, 2e-3), (8, 2e-2)])
def test_a_matrix_of_the_codecs_rank_comes_back_and_the_tied_message_is_small(bits, tol):
    x = low_rank(256, 128, 4)
    cfg = CodecConfig("lowrank", rank=4, factor_bits=bits, group_size=128)
    codec = make_codec(cfg)
    msg = codec.encode(x.reshape(-1), state=LinkState(cfg))
    y = codec.decode(msg).view(256, 128)
    assert float((y - x).norm() / x.norm()) < tol
    wire = sum(len(c.SerializeToString()) for c in frame(msg))
    assert wire < (256 + 128) * 4 * bits / 8 + 256  # vs 32,768 x 4 bits = 16 KB for the gradq4 tied sum


def test_the_warm_start_makes_repeated_messages_a_power_iteration():
    """Without error feedback, sending the same matrix again refines the subspace towards the best rank-r one."""
    x = low_rank(128, 64, 16, decay=0.7)
    cfg = CodecConfig("lowrank", rank=4, group_size=64)
    codec, state = make_codec(cfg), LinkState(cfg)
    errors = [float((codec.decode(codec.encode(x.reshape(-1), state=state)).view_as(x) - x).norm()) for _ in range(6)]
    u, s, vh = torch.linalg.svd(x)
    best = float((x - (u[:, :4] * s[:4]) @ vh[:4]).norm())
    assert errors[-1] < errors[0] and errors[-1] < best * 1.02
    cold = make_codec(cfg).encode(x.reshape(-1), state=LinkState(cfg))  # a fresh encoder: the first error again
    assert float((make_codec(cfg).decode(cold).view_as(x) - x).norm()) == pytest.approx(errors[0], rel=1e-5)


def test_error_feedback_converges_on_a_fixed_matrix():
    """Sending a fixed full-rank M every step with error feedback: what was sent plus the residual is exactly
    the steps' total, and the residual stays bounded, so the mean of what was sent converges to M."""
    gen = torch.Generator().manual_seed(2)
    m = torch.randn(64, 32, generator=gen)
    cfg = CodecConfig("lowrank", rank=2, group_size=32, error_feedback=True)
    codec, state = make_codec(cfg), LinkState(cfg)
    sent, gaps = torch.zeros(64 * 32), []
    for n in range(1, 201):
        sent += codec.decode(codec.encode(m.reshape(-1), state=state))
        assert torch.allclose(sent + state.residual, n * m.reshape(-1), rtol=1e-4, atol=1e-3)
        gaps.append(float((sent / n - m.reshape(-1)).norm() / m.norm()))
    assert gaps[-1] < 0.1 * gaps[0] and gaps[-1] < 0.1


def test_error_feedbacks_int8_factors_round_by_what_each_entry_costs():
    """`+ef+f8`: Q on one step, P's column k on that over |q_k|, the rounding's error about `ROUNDING_SHARE` of the
    rank's residual; fewer bytes than every column on its finest step, and error feedback still converges."""
    m = low_rank(256, 128, 24, seed=3, decay=0.85)
    p = torch.linalg.qr(m @ torch.randn(128, 8, generator=torch.Generator().manual_seed(0))).Q
    q = m.t() @ p
    p_steps, q_steps = powersgd_steps(m, p, q)
    free = (q_steps > q.abs().amax(0) / 127 * 1.001) & (q_steps < q.abs().amax(0) / 7 * 0.999)
    assert int(free.sum()) >= 4 and float(q_steps[free].std()) < 1e-6 * float(q_steps[free].mean())
    torch.testing.assert_close(p_steps * q.norm(dim=0), q_steps, rtol=1e-4, atol=0)  # no P column clamped here
    rounded = outer_sum(
        pack_factor(p, 8, wire_pb2.Quantized(), p_steps), pack_factor(q, 8, wire_pb2.Quantized(), q_steps)
    )
    rounding = float((rounded - p @ q.t()).pow(2).sum())
    residual = float((m - p @ q.t()).pow(2).sum())
    assert 0.3 * ROUNDING_SHARE * residual < rounding < 2 * ROUNDING_SHARE * residual

    cfg = CodecConfig.parse("lowrank8+ef+f8+g128")

    def run(steps: int = 60) -> tuple[int, float]:
        codec, state, sent, wire = make_codec(cfg), LinkState(cfg), torch.zeros(m.numel()), 0
        for _ in range(steps):
            msg = codec.encode(m.reshape(-1), state=state)
            wire += sum(len(c.SerializeToString()) for c in frame(msg))
            sent += codec.decode(msg)
        return wire, float((sent / steps - m.reshape(-1)).norm() / m.norm())

    wire, gap = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec_lowrank, "ROUNDING_SHARE", 0.0)  # every column on its finest step
        finest_wire, finest_gap = run()
    assert wire < 0.85 * finest_wire
    assert gap < 0.05 and gap < finest_gap + 0.01


def test_two_encoders_send_the_same_bytes_and_every_member_sums_the_same_bits():
    cfg = CodecConfig.parse("lowrank4+ef", group_size=128, seed=11)
    grads = [torch.randn(256 * 128) for _ in range(2)]
    msgs = []
    for g in grads:
        a, b = make_codec(cfg).encode(g, state=LinkState(cfg)), make_codec(cfg).encode(g, state=LinkState(cfg))
        assert a.SerializeToString() == b.SerializeToString()
        msgs.append(a)
    members = [[decoder_for(m, cfg if i else None) for m in msgs] for i in range(2)]  # with and without a config
    sums = [sum(d.decode(m) for d, m in zip(ds, msgs, strict=True)) for ds in members]
    assert torch.equal(sums[0], sums[1])
    p, q = torch.randn(50, 3), torch.randn(40, 3)
    assert torch.allclose(outer_sum(p, q), p @ q.t(), atol=1e-5)


def f16(v: float) -> bytes:
    return struct.pack("<e", v)


def f32(v: float) -> bytes:
    return struct.pack("<f", v)


def rank_65(m: wire_pb2.TensorMessage) -> None:
    """A well-sized 65 x 65 message of rank 65 (past MAX_RANK)."""
    m.ClearField("shape")
    m.shape.append(65 * 65)
    for q in (m.quantized, m.quantized_full):
        q.group_size, q.numel, q.scales, q.payload = 65, 65 * 65, f32(1.0) * 65, f16(0.5) * 65 * 65


TAMPERS = {
    "short payload": lambda m: setattr(m.quantized, "payload", m.quantized.payload[:-1]),
    "long payload": lambda m: setattr(m.quantized_full, "payload", m.quantized_full.payload + b"\0\0"),
    "nan scale": lambda m: setattr(m.quantized, "scales", f32(float("nan")) + m.quantized.scales[4:]),
    "inf scale": lambda m: setattr(m.quantized_full, "scales", f32(float("inf")) + m.quantized_full.scales[4:]),
    "negative scale": lambda m: setattr(m.quantized, "scales", f32(-1.0) + m.quantized.scales[4:]),
    "missing scale": lambda m: setattr(m.quantized, "scales", m.quantized.scales[4:]),
    "extra scale": lambda m: setattr(m.quantized_full, "scales", m.quantized_full.scales + f32(1.0)),
    "mins": lambda m: setattr(m.quantized, "mins", m.quantized.scales),
    "fp16 scales": lambda m: setattr(m.quantized, "scale_dtype", wire_pb2.FLOAT16),
    "bits": lambda m: (setattr(m.quantized, "bits", 4), setattr(m.quantized_full, "bits", 4)),
    "bits differ": lambda m: setattr(m.quantized_full, "bits", 8),
    "nan code": lambda m: setattr(m.quantized, "payload", f16(float("nan")) + m.quantized.payload[2:]),
    "inf code": lambda m: setattr(m.quantized_full, "payload", f16(float("inf")) + m.quantized_full.payload[2:]),
    "code over 1": lambda m: setattr(m.quantized, "payload", f16(1.5) + m.quantized.payload[2:]),
    "rank differs": lambda m: setattr(m.quantized_full, "numel", m.quantized_full.numel - 32),
    "rows x cols": lambda m: setattr(m.quantized, "group_size", 32),
    "zero rows": lambda m: setattr(m.quantized, "group_size", 0),
    "rank 0": lambda m: setattr(m.quantized, "numel", 0),
    "rank over the limit": lambda m: rank_65(m),
    "no Q": lambda m: m.ClearField("quantized_full"),
    "no P": lambda m: m.ClearField("quantized"),
    "code in a zero column": lambda m: setattr(m.quantized, "scales", f32(0.0) + m.quantized.scales[4:]),
    "overflowing product": lambda m: (
        setattr(m.quantized, "scales", f32(3e38) * 4),
        setattr(m.quantized_full, "scales", f32(3e38) * 4),
    ),
    "past fp16": lambda m: (setattr(m, "dtype", wire_pb2.FLOAT16), setattr(m.quantized, "scales", f32(1e6) * 4)),
    "rotation": lambda m: setattr(m, "rotation", 1),
    "another codec": lambda m: setattr(m, "codec", wire_pb2.GTERN),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_malformed_messages_are_refused_whole(tamper):
    cfg = CodecConfig.parse("lowrank4+ef", group_size=32, seed=5)
    codec = make_codec(cfg)
    msg = codec.encode(torch.randn(64 * 32), state=LinkState(cfg))
    codec.decode(msg)
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    TAMPERS[tamper](bad)
    with pytest.raises(WireError):
        codec.decode(bad)


def test_an_int8_code_of_minus_128_and_oversized_or_truncated_messages_are_refused():
    cfg = CodecConfig.parse("lowrank4+f8", group_size=32)
    codec = make_codec(cfg)
    msg = codec.encode(torch.randn(64 * 32))
    msg.quantized.payload = b"\x80" + msg.quantized.payload[1:]
    with pytest.raises(WireError, match="-128"):
        codec.decode(msg)
    msg = codec.encode(torch.randn(64 * 32))
    with pytest.raises(WireError, match="shape"):  # more elements than the receiver's group holds
        codec.decode(msg, limits=WireLimits(max_dims=1, max_numel=1024))
    chunks = list(frame(msg))
    chunks[-1].data = chunks[-1].data[:-3]
    with pytest.raises(WireError):
        unframe(chunks)
