"""GSIGN (1-bit scaled-sign activation gradients): the quantizer against a brute-force reference, round trips
with and without rotation, error feedback across micro-batches and steps, the sums' gradq fallback, and the
stranger's messages (malformed, relabelled, replayed, lost) refused whole."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.codec_gsign import sign_dequantize, sign_quantize
from swarm.compression.codecs import BY_NAME, REGISTRY
from swarm.proto import wire_pb2

LABELS = ["gsign+ef+rot+nr", "gsign+ef+rot", "gsign+ef", "gsign"]


def test_registered_labelled_and_one_bit():
    assert REGISTRY[wire_pb2.GSIGN] is BY_NAME["gsign"]
    for label in LABELS:
        assert CodecConfig.parse(label).label == label.replace("+nr", "")
        assert CodecConfig.parse(label).wire_bits == 1
    with pytest.raises(ValueError, match="gradq"):
        CodecConfig.parse("gsign+cs")  # compact scales are gradq's; gsign's are always fp16


def brute_force_sign(g: torch.Tensor) -> float:
    """The least squared error of any sign pattern times any scale (every pattern, best scale)."""
    v, best = g.double(), math.inf
    for signs in itertools.product((-1.0, 1.0), repeat=len(v)):
        s = torch.tensor(signs, dtype=torch.float64)
        scale = max(0.0, float((s * v).sum()) / len(v))
        best = min(best, float((v - scale * s).square().sum()))
    return best


def test_the_scaled_sign_is_the_mse_optimal_one_bit_code_of_each_group():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, generator=gen) * torch.rand(37, generator=gen) * 3
    codes, scales = sign_quantize(x, 8)
    y = sign_dequantize(codes, scales, 8)
    assert scales.dtype == torch.float16 and scales.numel() == 5 and codes.dtype == torch.bool
    for i in range(5):
        g = x[8 * i : 8 * i + 8]
        err = float((y[8 * i : 8 * i + 8] - g).double().square().sum())
        assert err <= brute_force_sign(g) * 1.002 + 1e-6  # optimal up to the fp16 rounding of the scale
    # the last group's 5 elements: its mean is over them, not over the padding
    assert scales[-1].item() == pytest.approx(float(x[32:].abs().mean()), rel=1e-3)


def test_zero_and_huge_groups_stay_finite_and_canonical():
    x = torch.zeros(2, 8)
    x[1] = -1e6  # beyond fp16: the scale clamps to its largest finite value
    codes, scales = sign_quantize(x, 8)
    y = sign_dequantize(codes, scales, 8).view(2, 8)
    assert (y[1] == -65504.0).all() and (y[0] == 0).all() and not codes[:8].any()


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 64), (1,)])
def test_round_trips_through_the_framing(label, shape):
    cfg = CodecConfig.parse(label, group_size=32, seed=3)
    codec = make_codec(cfg)
    x = torch.randn(shape)
    msg = codec.encode(x, state=LinkState(cfg))
    y = decoder_for(unframe(frame(msg))).decode(unframe(frame(msg)))
    assert y.shape == x.shape and torch.isfinite(y).all()
    if "+rot" not in label:  # unrotated: every element keeps its sign (or is 0) at its group's mean |x|
        assert bool(((torch.sign(y) == torch.sign(x)) | (y == 0)).all())
    n = math.prod(shape)
    coded = -(-n // 32) * 32 if "+rot" in label else n
    assert len(msg.quantized.payload) == -(-coded // 8) and len(msg.quantized.scales) == 2 * -(-coded // 32)
    assert codec.payload_nbytes(n) == len(msg.quantized.payload) + len(msg.quantized.scales)


def test_error_feedback_carries_the_error_within_a_step_only():
    cfg = CodecConfig.parse("gsign+ef+rot", group_size=64, seed=1)
    codec, state = make_codec(cfg), LinkState(cfg)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 64, generator=gen) for _ in range(12)]
    sent = torch.zeros(4, 64)
    for x in xs:
        sent += codec.decode(codec.encode(x, state=state))
    # what was sent plus what is still owed is exactly what was asked for
    total = torch.stack(xs).sum(0)
    assert torch.allclose(sent + state.residual, total, atol=1e-4)
    # the running sum's error stays bounded (one message's worth) instead of growing with the count
    assert float((sent - total).norm()) < 1.5 * float(xs[0].norm())
    no_ef = CodecConfig.parse("gsign+rot", group_size=64, seed=1)
    plain = sum(make_codec(no_ef).decode(make_codec(no_ef).encode(x, state=LinkState(no_ef))) for x in xs)
    assert float((sent - total).norm()) < float((plain - total).norm())
    state.end_step()
    assert state.residual is None
    again = codec.decode(codec.encode(xs[0], state=state))
    assert torch.allclose(again + state.residual, xs[0], atol=1e-5)  # the next step owes nothing of the last


def test_a_fresh_rotation_each_message_unless_nearest():
    for label, fresh in (("gsign+ef+rot", True), ("gsign+ef+rot+nr", False)):
        cfg = CodecConfig.parse(label, group_size=16, seed=2)
        state, codec = LinkState(cfg), make_codec(cfg)
        seeds = {codec.encode(torch.randn(32), state=state).rotation_seed for _ in range(3)}
        assert len(seeds) == (3 if fresh else 1)


def test_sums_under_a_gsign_backward_are_gradq_at_their_floor():
    cfg = CodecConfig.parse("gsign+ef+rot+nr+g1024")
    sums = BY_NAME["gsign"].sum_config(cfg)
    assert sums.label == "gradq2+ef+rot+cs" and not sums.stochastic and sums.group_size == 1024
    assert BY_NAME["gradq"].sum_config(CodecConfig.parse("gradq2+ef")) == CodecConfig.parse("gradq2+ef")


def fp16_bytes(v: float) -> bytes:
    return torch.tensor([v], dtype=torch.float16).numpy().tobytes()


TAMPERS = {
    "padding bit": lambda m: setattr(m.quantized, "payload", m.quantized.payload[:-1] + b"\xff"),
    "short payload": lambda m: setattr(m.quantized, "payload", m.quantized.payload[:-1]),
    "long payload": lambda m: setattr(m.quantized, "payload", m.quantized.payload + b"\0"),
    "nan scale": lambda m: setattr(m.quantized, "scales", fp16_bytes(float("nan")) + m.quantized.scales[2:]),
    "inf scale": lambda m: setattr(m.quantized, "scales", fp16_bytes(float("inf")) + m.quantized.scales[2:]),
    "negative scale": lambda m: setattr(m.quantized, "scales", fp16_bytes(-1.0) + m.quantized.scales[2:]),
    "missing scale": lambda m: setattr(m.quantized, "scales", m.quantized.scales[2:]),
    "extra scale": lambda m: setattr(m.quantized, "scales", m.quantized.scales + fp16_bytes(1.0)),
    "mins": lambda m: setattr(m.quantized, "mins", m.quantized.scales),
    "fp32 scales": lambda m: setattr(m.quantized, "scale_dtype", wire_pb2.FLOAT32),
    "bits": lambda m: setattr(m.quantized, "bits", 2),
    "numel": lambda m: setattr(m.quantized, "numel", m.quantized.numel + 1),
    "group": lambda m: setattr(m.quantized, "group_size", 0),
    "huge group": lambda m: setattr(m.quantized, "group_size", 1 << 20),
    "odd rotated group": lambda m: setattr(m.quantized, "group_size", 24),
    "unknown rotation": lambda m: setattr(m, "rotation", 2),
    "seed without rotation": lambda m: (setattr(m, "rotation", 0), setattr(m, "rotation_seed", 5)),
    "code in a zero group": lambda m: (
        setattr(m.quantized, "scales", fp16_bytes(0.0) + m.quantized.scales[2:]),
        setattr(m.quantized, "payload", b"\x01" + m.quantized.payload[1:]),
    ),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_malformed_messages_are_refused_whole(tamper):
    cfg = CodecConfig.parse("gsign+ef+rot", group_size=32, seed=5)
    codec = make_codec(cfg)
    x = torch.randn(3, 15, 7)  # 315 elements: padded to 320 when rotated, the unrotated payload has padding
    msg = codec.encode(x, state=LinkState(cfg))
    if tamper in ("padding bit", "code in a zero group"):
        msg = make_codec(CodecConfig.parse("gsign+ef", group_size=32)).encode(x)
        msg.quantized.payload = msg.quantized.payload[:-1] + bytes([msg.quantized.payload[-1] & 0x07])
        codec.decode(msg)  # still canonical: 315 = 39 * 8 + 3 codes, the last byte's 5 high bits are padding
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    TAMPERS[tamper](bad)
    with pytest.raises(WireError):
        codec.decode(bad)


def test_a_huge_but_finite_scale_cannot_overflow_a_half_tensor():
    cfg = CodecConfig.parse("gsign+ef+rot", group_size=32)
    codec = make_codec(cfg)
    msg = codec.encode(torch.randn(4, 32).half(), state=LinkState(cfg))
    msg.quantized.scales = fp16_bytes(60000.0) * 4  # rotated back, a group's values sum to 60000 * sqrt(32)
    with pytest.raises(WireError):
        codec.decode(msg)


def test_another_codecs_message_or_label_is_refused():
    cfg = CodecConfig.parse("gsign+ef+rot", group_size=32)
    msg = make_codec(cfg).encode(torch.randn(64), state=LinkState(cfg))
    msg.codec = wire_pb2.GRADQ  # a stranger relabels it: gradq refuses a 1-bit message with no mins
    with pytest.raises(WireError):
        decoder_for(msg).decode(msg)
    with pytest.raises(WireError, match="codec"):
        make_codec(cfg).decode(msg)


def test_replayed_and_lost_messages_change_nothing_on_the_receiver():
    """gsign keeps no receiver state: a replay decodes to the same tensor (the runtime's step and micro-batch
    checks refuse the duplicate), and a lost message only leaves its error with the sender."""
    cfg = CodecConfig.parse("gsign+ef+rot", group_size=32, seed=7)
    codec, send, recv = make_codec(cfg), LinkState(cfg), LinkState(cfg)
    msgs = [codec.encode(torch.randn(2, 32), state=send) for _ in range(3)]
    first = codec.decode(msgs[0], state=recv)
    assert torch.equal(codec.decode(msgs[0], state=recv), first)
    assert recv.residual is None and torch.equal(codec.decode(msgs[2], state=recv), codec.decode(msgs[2]))


def test_the_encoder_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        make_codec(CodecConfig.parse("gsign+ef")).encode(torch.tensor([1.0, float("nan")]))
