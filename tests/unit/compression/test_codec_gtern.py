"""GTERN (ternary activation gradients with a rate weight): gsign's message and checks with TERN's quantizer and
packing. Round trips, error feedback, the rate's bytes-for-error trade on the wire, the sums' gradq fallback,
and the stranger's messages refused."""

from __future__ import annotations

import math

import pytest
import torch
from test_codec_gsign import TAMPERS, fp16_bytes

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.codec_tern import ternary_dequantize, ternary_quantize
from swarm.compression.codecs import BY_NAME, REGISTRY
from swarm.proto import wire_pb2

LABELS = ["gtern+ef+rot+nr+r150", "gtern+ef+rot+r100", "gtern+ef", "gtern"]


def test_registered_labelled_and_validated():
    assert REGISTRY[wire_pb2.GTERN] is BY_NAME["gtern"]
    for label in LABELS:
        assert CodecConfig.parse(label).label == label.replace("+nr", "")
    assert CodecConfig.parse("gtern+r150").rate_percent == 150
    with pytest.raises(ValueError, match="gtern"):
        CodecConfig.parse("gsign+r50")  # the rate weight is tern's and gtern's


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 64), (1,)])
def test_round_trips_through_the_framing_and_decode_exactly(label, shape):
    cfg = CodecConfig.parse(label, group_size=32, seed=3)
    codec = make_codec(cfg)
    x = torch.randn(shape)
    msg = codec.encode(x, state=LinkState(cfg))
    y = decoder_for(unframe(frame(msg))).decode(unframe(frame(msg)))
    assert y.shape == x.shape and torch.isfinite(y).all() and msg.quantized.bits == 0
    if "+rot" not in label:  # unrotated: the decoded tensor is the ternary code of x, exactly
        codes, scales = ternary_quantize(x, 32, cfg.rate_percent / 100)
        assert torch.equal(y.reshape(-1), ternary_dequantize(codes, scales, 32))
    n = math.prod(shape)
    coded = -(-n // 32) * 32 if "+rot" in label else n
    assert len(msg.quantized.payload) == -(-coded // 5) and len(msg.quantized.scales) == 2 * -(-coded // 32)
    assert codec.payload_nbytes(n) == len(msg.quantized.payload) + len(msg.quantized.scales)


def test_the_rate_trades_bytes_on_the_wire_for_error():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=gen) * torch.rand(1, 1024, generator=gen) ** 3
    sizes, errors = [], []
    for rate in (0, 75, 150):
        cfg = CodecConfig.parse(f"gtern+rot+nr+r{rate}", group_size=1024)
        msg = make_codec(cfg).encode(x, state=LinkState(cfg))
        sizes.append(sum(len(c.SerializeToString()) for c in frame(msg)))
        errors.append(float((make_codec(cfg).decode(msg) - x).norm() / x.norm()))
    assert sizes == sorted(sizes, reverse=True) and errors == sorted(errors)
    # r150 on the wire: under 1 bit an element after zstd, the 2-bit grid's error or better (module doc)
    q2 = CodecConfig.parse("gradq2+rot+nr+cs", group_size=1024)
    q2_msg = make_codec(q2).encode(x, state=LinkState(q2))
    assert 8 * sizes[-1] / x.numel() < 1.0
    assert errors[-1] <= float((make_codec(q2).decode(q2_msg) - x).norm() / x.norm()) * 1.05


def test_error_feedback_carries_the_error_within_a_step_only():
    cfg = CodecConfig.parse("gtern+ef+rot+nr+r150", group_size=64, seed=1)
    codec, state = make_codec(cfg), LinkState(cfg)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 64, generator=gen) for _ in range(8)]
    sent = sum(codec.decode(codec.encode(x, state=state)) for x in xs)
    assert torch.allclose(sent + state.residual, torch.stack(xs).sum(0), atol=1e-4)
    state.end_step()
    again = codec.decode(codec.encode(xs[0], state=state))
    assert torch.allclose(again + state.residual, xs[0], atol=1e-5)


def test_sums_under_a_gtern_backward_are_gradq_without_the_rate():
    sums = BY_NAME["gtern"].sum_config(CodecConfig.parse("gtern+ef+rot+nr+r150+g1024"))
    assert sums.label == "gradq2+ef+rot+cs" and sums.rate_percent == 0 and sums.group_size == 1024


TERN_TAMPERS = {
    **{k: v for k, v in TAMPERS.items() if k not in ("padding bit", "bits", "code in a zero group")},
    "bits": lambda m: setattr(m.quantized, "bits", 1),
    "byte over 242": lambda m: setattr(m.quantized, "payload", b"\xf3" + m.quantized.payload[1:]),
    "padding code": lambda m: setattr(m.quantized, "payload", m.quantized.payload[:-1] + b"\x00"),
    "code in a zero group": lambda m: (
        setattr(m.quantized, "scales", fp16_bytes(0.0) + m.quantized.scales[2:]),
        setattr(m.quantized, "payload", b"\x00" + m.quantized.payload[1:]),  # five -1 codes
    ),
}


@pytest.mark.parametrize("tamper", sorted(TERN_TAMPERS))
def test_malformed_messages_are_refused_whole(tamper):
    cfg = CodecConfig.parse("gtern+ef+rot+r50", group_size=32, seed=5)
    codec = make_codec(cfg)
    msg = codec.encode(torch.randn(3, 15, 7), state=LinkState(cfg))  # 315 elements, 320 rotated: 64 bytes
    if tamper == "padding code":  # unrotated 316 elements: the last byte holds one code and four of padding
        msg = make_codec(CodecConfig.parse("gtern+ef", group_size=32)).encode(torch.randn(316))
        codec.decode(msg)
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    TERN_TAMPERS[tamper](bad)
    with pytest.raises(WireError):
        codec.decode(bad)


def test_a_gsign_message_relabelled_as_gtern_is_refused():
    cfg = CodecConfig.parse("gsign+ef+rot", group_size=32)
    msg = make_codec(cfg).encode(torch.randn(64), state=LinkState(cfg))
    msg.codec = wire_pb2.GTERN
    with pytest.raises(WireError, match="bits"):
        decoder_for(msg).decode(msg)


def test_the_planners_tied_estimate_follows_the_averager():
    """`sizes.tied_bytes` sizes a gtern (or gsign) backward's tied sum as the gradq sum the averager sends."""
    from swarm.model.gpt import ModelConfig
    from swarm.scheduler.sizes import tied_bytes

    model = ModelConfig(seq_len_tokens=16, hidden_dim=32, n_layers=2, n_heads=2)
    gradq = tied_bytes(model, CodecConfig.parse("gradq2+ef+rot+nr+cs+g1024"))
    for label in ("gtern+ef+rot+nr+r150+g1024", "gsign+ef+rot+nr+g1024"):
        assert tied_bytes(model, CodecConfig.parse(label)) == gradq > 0
