"""MLOWRANK (the replicas' sum, each parameter on its own): which parameters are factored, the error feedback's
identity, each matrix's warm start, identical bytes from two encoders and bits from two decoders, the bytes it
claims, and the stranger's messages (another layout, count, rank or bits, bad codes, fields of other codecs, a
product past fp32) refused whole, naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, make_codec
from swarm.compression.codec_mlowrank import factor_plan, matrix_view
from swarm.compression.codecs import BY_NAME, REGISTRY
from swarm.proto import wire_pb2

LAYOUT = ((32, 128), (96, 32), (32,), (32,), (128, 32), (2, 3, 4))  # a block's matrices, two vectors, a 3-d one
NUMEL = sum(math.prod(s) for s in LAYOUT)


def config(label: str = "mlowrank8+ef+f8", layout=LAYOUT, **kw) -> CodecConfig:
    return CodecConfig.parse(label, layout=layout, **kw)


def grad(seed: int = 0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 1e-3


def test_registered_labelled_and_validated():
    assert REGISTRY[wire_pb2.MLOWRANK] is BY_NAME["mlowrank"]
    for label in ("mlowrank8+ef+f8", "mlowrank12+ef+f4", "mlowrank4+ef", "mlowrank1"):
        assert CodecConfig.parse(label).label == label
    assert (config().rank, config().factor_bits, config().error_feedback) == (8, 8, True)
    for bad in ("mlowrank0", "mlowrank65", "mlowrank8+f2", "mlowrank8+f8+s20"):
        with pytest.raises(ValueError):
            CodecConfig.parse(bad)
    with pytest.raises(ValueError, match="layout applies to mlowrank"):
        CodecConfig.parse("lowrank8+f8", layout=((4, 4),))
    with pytest.raises(ValueError, match="non-negative ints"):
        CodecConfig.parse("mlowrank8", layout=((4, -1),))


def test_matrices_are_factored_where_their_factors_are_fewer_codes_and_the_rest_goes_whole():
    assert matrix_view((32, 128)) == (32, 128) and matrix_view((2, 3, 4)) == (2, 12) and matrix_view((32,)) is None
    plan = factor_plan(LAYOUT, 8)
    assert plan == [(32, 128, 8), (96, 32, 8), (32, 1, 0), (32, 1, 0), (128, 32, 8), (24, 1, 0)]
    assert factor_plan(((16, 16),), 8) == [(256, 1, 0)]  # rank 8 of 16 x 16: 256 codes either way, sent whole
    assert factor_plan(((0, 5),), 8) == [(0, 1, 0)]


def test_the_residual_is_what_the_receiver_did_not_get_and_each_matrix_keeps_its_own_warm_start():
    codec, state = make_codec(config()), LinkState(config())
    x = grad()
    msg = codec.encode(x, state=state)
    decoded = decoder_for(msg, config()).decode(msg)
    assert decoded.shape == (NUMEL,) and torch.equal(x - decoded, state.residual)
    assert len(msg.factors) == 2 + 2 + 1 + 1 + 2 + 1
    warm = state.warm
    assert isinstance(warm, tuple) and [None if w is None else tuple(w.shape) for w in warm] == [
        (128, 8), (32, 8), None, None, (32, 8), None,
    ]  # fmt: skip
    # the whole parameters travel exactly but for int8 rounding; error feedback carries the rest into the next one
    offset = 32 * 128 + 96 * 32
    whole = x[offset : offset + 64]
    assert torch.allclose(decoded[offset : offset + 64], whole, atol=float(whole.abs().max()) / 127)
    x2 = grad(1)
    msg2 = codec.encode(x2, state=state)
    assert torch.equal(x2 + (x - decoded) - decoder_for(msg2, config()).decode(msg2), state.residual)


def test_a_fixed_low_rank_gradient_is_recovered_over_steps():
    gen = torch.Generator().manual_seed(3)
    mats = [torch.randn(r, 4, generator=gen) @ torch.randn(4, c, generator=gen) for r, c in ((32, 128), (96, 32))]
    layout = ((32, 128), (96, 32))
    cfg = config(layout=layout)
    x = torch.cat([m.reshape(-1) for m in mats])
    codec, state = make_codec(cfg), LinkState(cfg)
    total, sent = torch.zeros_like(x), 0
    for _ in range(6):
        msg = codec.encode(x, state=state)
        total += decoder_for(msg, cfg).decode(msg)
        sent += 1
    # rank-4 matrices at rank 8: error feedback drives the running sum to the exact one, within int8 rounding
    assert float((total / sent - x).norm() / x.norm()) < 0.02


def test_two_encoders_send_the_same_bytes_and_two_decoders_get_the_same_bits():
    msgs = []
    for _ in range(2):
        codec, state = make_codec(config(seed=7)), LinkState(config(seed=7))
        msgs.append([codec.encode(grad(s), state=state).SerializeToString() for s in range(3)])
    assert msgs[0] == msgs[1]
    msg = wire_pb2.TensorMessage.FromString(msgs[0][2])
    a, b = (decoder_for(msg, config()).decode(msg) for _ in range(2))
    assert torch.equal(a, b)


def test_payload_nbytes_is_what_the_codes_and_scales_take():
    msg = make_codec(config()).encode(grad(), state=LinkState(config()))
    codes = sum(len(q.payload) + len(q.scales) for q in msg.factors)
    assert codes == make_codec(config()).payload_nbytes(NUMEL)
    # hidden 128, rank 8: a transformer layer's matrices at 0.69 bits an element, framing aside
    h = 128
    layer = ((h, h), (3 * h, h), (h,), (h,), (h,), (h,), (4 * h, h), (h, 4 * h))
    n = sum(math.prod(s) for s in layer)
    assert 0.6 < 8 * make_codec(config(layout=layer)).payload_nbytes(n) / n < 0.75
    # without a layout: one matrix in rows of 128 (what a benchmark codes and the planner prices)
    flat = make_codec(CodecConfig.parse("mlowrank8+ef+f8"))
    assert flat.payload_nbytes(128 * 300 + 5) == (300 + 128) * 8 + 64 + 5 + 4
    decoded = flat.decode(flat.encode(torch.randn(128 * 300 + 5)))
    assert decoded.shape == (128 * 300 + 5,)


def _message() -> wire_pb2.TensorMessage:
    return make_codec(config()).encode(grad(), state=LinkState(config()))


def _refused(msg: wire_pb2.TensorMessage, match: str, cfg: CodecConfig | None = None) -> None:
    with pytest.raises(WireError, match=match):
        decoder_for(msg, cfg or config()).decode(msg)


def test_a_message_of_another_layout_is_refused():
    msg = _message()
    _refused(msg, "layout holds", config(layout=LAYOUT[:-1]))  # the receiver's parameters are fewer
    other = ((32, 128), (128, 32), (32,), (32,), (96, 32), (2, 3, 4))  # as many elements, other matrices
    assert sum(math.prod(s) for s in other) == NUMEL
    _refused(msg, "numel|rank", config(layout=other))


def test_a_stranger_s_factors_are_refused_whole():
    msg = _message()
    short = wire_pb2.TensorMessage()
    short.CopyFrom(msg)
    del short.factors[-1]
    _refused(short, "entries")
    low = _message()
    low.factors[0].numel = low.factors[0].group_size * 4  # P at rank 4 where the layout says 8
    _refused(low, "rank 4")
    mixed = _message()
    mixed.factors[1].bits = 16
    _refused(mixed, "bits")
    bad = _message()
    bad.factors[4].payload = b"\x80" + bad.factors[4].payload[1:]  # an int8 code of -128
    _refused(bad, "-128")
    nan = _message()
    nan.factors[0].scales = torch.tensor([float("nan")] * 8).numpy().tobytes()
    _refused(nan, "scale")
    other = _message()
    other.quantized.bits = 2  # a field of another codec
    _refused(other, "`factors` only")
    huge = _message()
    huge.factors[0].scales = torch.tensor([3e38] * 8).numpy().tobytes()
    huge.factors[1].scales = torch.tensor([3e38] * 8).numpy().tobytes()
    _refused(huge, "scales")


def test_four_bit_factors_halve_the_codes_keep_the_error_feedback_identity_and_refuse_bad_nibbles():
    cfg = config("mlowrank8+ef+f4")
    codec, state = make_codec(cfg), LinkState(cfg)
    x = grad()
    msg = codec.encode(x, state=state)
    assert {q.bits for q in msg.factors} == {4}
    decoded = decoder_for(msg, cfg).decode(msg)
    assert torch.equal(x - decoded, state.residual)
    assert sum(len(q.payload) + len(q.scales) for q in msg.factors) == codec.payload_nbytes(NUMEL)
    eight = make_codec(config()).payload_nbytes(NUMEL)
    scales = sum(len(q.scales) for q in msg.factors)
    assert codec.payload_nbytes(NUMEL) - scales <= (eight - scales) // 2 + len(msg.factors)  # odd columns pad a nibble
    # whole parameters to within a 4-bit step; the factors' columns each within half a step of what was sent
    offset = 32 * 128 + 96 * 32
    whole = x[offset : offset + 32]
    assert torch.allclose(decoded[offset : offset + 32], whole, atol=float(whole.abs().max()) / 7)
    # error feedback still recovers a fixed low-rank gradient, at 4-bit rounding
    gen = torch.Generator().manual_seed(3)
    mat = torch.randn(32, 4, generator=gen) @ torch.randn(4, 128, generator=gen)
    small = config("mlowrank8+ef+f4", layout=((32, 128),))
    enc, st, total = make_codec(small), LinkState(small), torch.zeros(32 * 128)
    for _ in range(12):
        m = enc.encode(mat.reshape(-1), state=st)
        total += decoder_for(m, small).decode(m)
    assert float((total / 12 - mat.reshape(-1)).norm() / mat.norm()) < 0.05
    # a nibble of -8, a set padding nibble, a payload of the wrong length, each refused naming the payload
    odd = config("mlowrank8+ef+f4", layout=((7,),))  # 7 codes: four bytes, the last nibble padding
    odd_msg = make_codec(odd).encode(torch.linspace(-1, 1, 7), state=LinkState(odd))
    assert len(odd_msg.factors[0].payload) == 4
    assert torch.allclose(decoder_for(odd_msg, odd).decode(odd_msg), torch.linspace(-1, 1, 7), atol=1 / 7)
    for good, field, change, match in (
        ((msg, cfg), 0, lambda b: b"\x08" + b[1:], "-8"),
        ((odd_msg, odd), 0, lambda b: b[:-1] + bytes([b[-1] | 0x10]), "padding"),
        ((msg, cfg), 0, lambda b: b[:-1], "bytes, expected"),
    ):
        bad = wire_pb2.TensorMessage()
        bad.CopyFrom(good[0])
        bad.factors[field].payload = change(bad.factors[field].payload)
        _refused(bad, match, good[1])
