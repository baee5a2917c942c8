"""TERN (ternary deltas, 5 codes a byte) and BILEVEL (1-bit deltas on two levels per group) behind AQ-SGD's
buffer protocol: the quantizers against brute-force references, exact packing round trips, bit-identical buffers
over many rounds, and the stranger's messages (malformed, replayed, mislabelled, never arriving) refused whole
with nothing committed."""

from __future__ import annotations

import itertools

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.codec_aqsgd import BufferDriftError
from swarm.compression.codec_bilevel import (
    bilevel_dequantize,
    bilevel_quantize,
    pack_bits,
    pack_bits_torch,
    unpack_bits,
)
from swarm.compression.codec_tern import pack_trits, ternary_dequantize, ternary_quantize, unpack_trits
from swarm.compression.codecs import BY_NAME, REGISTRY
from swarm.proto import wire_pb2

LABELS = ["tern+ch", "tern", "bilevel+ch", "bilevel"]


def test_registered_under_their_own_enums():
    assert REGISTRY[wire_pb2.TERN] is BY_NAME["tern"] and REGISTRY[wire_pb2.BILEVEL] is BY_NAME["bilevel"]
    assert CodecConfig.parse("tern+ch").label == "tern+ch" and CodecConfig.parse("bilevel").label == "bilevel"
    assert CodecConfig.parse("bilevel+ch").wire_bits == 1


def brute_force_ternary(g: torch.Tensor) -> float:
    """The least squared error of any code in {-1, 0, 1}^n times any scale (every support, best scale)."""
    best = float(g.square().sum())
    v = g.double()
    for k in range(1, len(v) + 1):
        for support in itertools.combinations(range(len(v)), k):
            a = v[list(support)].abs()
            best = min(best, float(v.square().sum() - a.sum() ** 2 / k))
    return best


def test_ternary_is_the_mse_optimal_code_of_each_group():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, generator=gen) * torch.rand(40, generator=gen) * 4
    codes, scales = ternary_quantize(x, 8)
    y = ternary_dequantize(codes, scales, 8)
    for i in range(5):
        g = x[8 * i : 8 * i + 8]
        err = float((y[8 * i : 8 * i + 8] - g).double().square().sum())
        # optimal up to the fp16 rounding of the scale
        assert err <= brute_force_ternary(g) * 1.002 + 1e-6
    assert set(codes.tolist()) <= {-1, 0, 1} and codes.dtype == torch.int8


def lloyd_reference(v: list[float], rounds: int = 2) -> tuple[float, float]:
    """Two-level Lloyd in plain Python from the mean split: the (lo, hi) levels before fp16."""
    t = sum(v) / len(v)
    for _ in range(rounds):
        up, down = [a for a in v if a >= t], [a for a in v if a < t]
        hi = sum(up) / len(up) if up else None
        lo = sum(down) / len(down) if down else None
        hi, lo = (hi if hi is not None else lo), (lo if lo is not None else hi)
        t = (lo + hi) / 2
    return lo, hi


def test_bilevel_levels_are_lloyds_and_codes_pick_the_nearer_level():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(45, generator=gen) + torch.tensor([3.0] * 16 + [-1.0] * 16 + [0.0] * 13)
    codes, lo, hi = bilevel_quantize(x, 16)
    assert lo.dtype == hi.dtype == torch.float16 and codes.dtype == torch.bool and codes.numel() == 45
    for i in range(3):
        ref_lo, ref_hi = lloyd_reference(x[16 * i : 16 * i + 16].tolist())  # the last group: 13, no padding
        assert float(lo[i]) == float(torch.tensor(ref_lo).half()) and float(hi[i]) == float(torch.tensor(ref_hi).half())
    y = bilevel_dequantize(codes, lo, hi, 16)
    levels = torch.stack([lo.float().repeat_interleave(16)[:45], hi.float().repeat_interleave(16)[:45]])
    assert torch.equal((y - x).abs(), (levels - x).abs().min(0).values)
    # a constant group decodes exactly; a group with one value apart keeps it
    codes, lo, hi = bilevel_quantize(torch.tensor([2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 8.0]), 4)
    assert bilevel_dequantize(codes, lo, hi, 4).tolist() == [2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 8.0]


def test_zero_and_huge_groups_stay_finite():
    x = torch.zeros(2, 8)
    x[1] = 1e6  # beyond fp16: the scale clamps to its largest finite value
    y = ternary_dequantize(*ternary_quantize(x, 8), 8).view(2, 8)
    assert torch.isfinite(y).all() and (y[1] == 65504.0).all() and (y[0] == 0).all()
    y = bilevel_dequantize(*bilevel_quantize(x, 8), 8).view(2, 8)
    assert torch.isfinite(y).all() and (y[1] == 65504.0).all() and (y[0] == 0).all()


@pytest.mark.parametrize("numel", [1, 4, 5, 6, 8, 9, 999])
def test_packing_round_trips(numel):
    codes = torch.randint(-1, 2, (numel,), dtype=torch.int8)
    packed = pack_trits(codes)
    assert len(packed) == -(-numel // 5) and torch.equal(unpack_trits(packed, numel), codes)
    bits = codes > 0
    packed = pack_bits(bits)
    assert len(packed) == -(-numel // 8) and torch.equal(unpack_bits(packed, numel), bits)
    assert pack_bits_torch(bits) == packed  # a device's packing (here on the CPU) writes the same bytes


def test_packing_refuses_bad_bytes():
    with pytest.raises(WireError, match="243"):
        unpack_trits(bytes([243]), 5)
    with pytest.raises(WireError, match="expected"):
        unpack_trits(bytes(3), 5)
    with pytest.raises(WireError, match="padding"):
        unpack_trits(bytes([0]), 4)  # the fifth code is -1, not the padding's 0
    with pytest.raises(WireError, match="padding"):
        unpack_bits(bytes([0xFF]), 7)
    with pytest.raises(WireError, match="expected"):
        unpack_bits(bytes(2), 7)


def ends(label, **kw):
    cfg = CodecConfig.parse(label, seed=5, group_size=32, **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def snapshot(state):
    ids = sorted(state.buffers.ids())
    return ids, state.buffers.gather(state.buffers.lookup(ids)).clone()


@pytest.mark.parametrize("first_sight_bits", [16, 4])
@pytest.mark.parametrize("label", LABELS)
def test_buffers_stay_bit_identical_over_many_rounds(label, first_sight_bits):
    codec, send, recv = ends(label, first_sight_bits=first_sight_bits)
    gen = torch.Generator().manual_seed(0)
    acts = {i: torch.randn(24, 40, generator=gen) for i in range(10)}
    for _ in range(15):
        ids = sorted(torch.randperm(10, generator=gen)[:4].tolist())
        for i in ids:
            acts[i] = acts[i] + 0.05 * torch.randn(acts[i].shape, generator=gen)
        x = torch.stack([acts[i] for i in ids])
        msg = unframe(list(frame(codec.encode(x, sample_ids=ids, state=send), chunk_bytes=700)))
        assert msg.codec == codec.wire
        y = decoder_for(msg).decode(msg, state=recv)
        (a_ids, a), (b_ids, b) = snapshot(send), snapshot(recv)
        assert a_ids == b_ids and torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert torch.equal(y, recv.buffers.gather(recv.buffers.lookup(ids)).float())
    # the buffers' error feedback keeps m close to the activations although each delta is coarse
    assert float((recv.buffers.gather(recv.buffers.lookup(ids)).float() - x).norm() / x.norm()) < 0.1


def fp16_bytes(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float16).numpy().tobytes()


TAMPERS = {
    "nan scale": lambda q: setattr(q, "scales", fp16_bytes(float("nan")) + q.scales[2:]),
    "negative scale": lambda q: setattr(q, "scales", fp16_bytes(-70000.0 if q.mins else -1.0) + q.scales[2:]),
    "nan min": lambda q: setattr(q, "mins", fp16_bytes(float("nan")) + q.mins[2:]),
    "low above high": lambda q: setattr(q, "mins", fp16_bytes(1000.0) + q.mins[2:]),
    "inf scale": lambda q: setattr(q, "scales", fp16_bytes(float("inf")) + q.scales[2:]),
    "short scales": lambda q: setattr(q, "scales", q.scales[:-2]),
    "oversized scales": lambda q: setattr(q, "scales", q.scales * 1000),
    "short payload": lambda q: setattr(q, "payload", q.payload[:-1]),
    "oversized payload": lambda q: setattr(q, "payload", q.payload * 1000),
    "bad code byte": lambda q: setattr(q, "payload", b"\xff" + q.payload[1:]),
    "mins": lambda q: setattr(q, "mins", q.mins[:-2] if q.mins else b"\0" * 8),
    "fp32 scales": lambda q: setattr(q, "scale_dtype", wire_pb2.FLOAT32),
    "bits": lambda q: setattr(q, "bits", 2),
    "numel": lambda q: setattr(q, "numel", q.numel + 1),
    "group": lambda q: setattr(q, "group_size", 0),
    "huge group": lambda q: setattr(q, "group_size", 1 << 20),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
@pytest.mark.parametrize("label", ["tern+ch", "bilevel"])
def test_malformed_messages_are_refused_whole(label, tamper):
    codec, send, recv = ends(label, buffer_dtype="float16")
    x = torch.randn(3, 15, 7)  # 315 elements: the last payload byte has padding
    codec.decode(codec.encode(x, sample_ids=[1, 2, 3], state=send), state=recv)
    msg = codec.encode(x + 0.1, sample_ids=[1, 2, 3], state=send)
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    TAMPERS[tamper](bad.quantized)
    if tamper == "bad code byte" and label == "bilevel":  # every byte is 8 valid signs; a set padding bit is not
        bad.quantized.payload = bad.quantized.payload[:-1] + b"\xff"
    before = snapshot(recv)[1]
    with pytest.raises(WireError):
        codec.decode(bad, state=recv)
    assert torch.equal(snapshot(recv)[1], before)
    codec.decode(msg, state=recv)
    assert torch.equal(snapshot(recv)[1], snapshot(send)[1])


@pytest.mark.parametrize("label", ["tern+ch", "bilevel+ch"])
def test_a_replayed_or_stale_delta_is_drift_and_commits_nothing(label):
    codec, send, recv = ends(label)
    x = torch.randn(2, 16, 8)
    codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=recv)
    old = codec.encode(x + 0.3, sample_ids=[1, 2], state=send)
    codec.decode(old, state=recv)
    before = snapshot(recv)[1]
    with pytest.raises(BufferDriftError):  # the duplicate would move m a second time
        codec.decode(old, state=recv)
    assert torch.equal(snapshot(recv)[1], before)
    # a delta that never arrived: the next one does not match the receiver's buffers either
    codec.encode(x + 0.6, sample_ids=[1, 2], state=send)
    with pytest.raises(BufferDriftError):
        codec.decode(codec.encode(x + 0.9, sample_ids=[1, 2], state=send), state=recv)
    assert torch.equal(snapshot(recv)[1], before)


@pytest.mark.parametrize("label", ["tern", "bilevel"])
def test_a_huge_but_finite_scale_cannot_overflow_an_fp16_buffer(label):
    codec, send, recv = ends(label, buffer_dtype="float16")
    x = torch.full((2, 16, 8), -100.0)
    codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=recv)
    msg = codec.encode(x, sample_ids=[1, 2], state=send)
    msg.quantized.scales = fp16_bytes(65504.0) * (len(msg.quantized.scales) // 2)
    msg.quantized.payload = b"\0" * len(msg.quantized.payload)  # tern: every code -1: -100 - 65504 leaves fp16
    if msg.quantized.mins:  # bilevel: every code the low level, -65504
        msg.quantized.mins = fp16_bytes(-65504.0) * (len(msg.quantized.mins) // 2)
    before = snapshot(recv)[1]
    with pytest.raises(WireError):
        codec.decode(msg, state=recv)
    assert torch.equal(snapshot(recv)[1], before)


def test_another_codecs_message_is_refused():
    codec, send, recv = ends("tern")
    x = torch.randn(2, 16, 8)
    codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=recv)
    msg = codec.encode(x + 0.1, sample_ids=[1, 2], state=send)
    msg.codec = wire_pb2.BILEVEL  # a stranger relabels it: the bilevel decoder refuses its 0-bit deltas
    with pytest.raises(WireError):
        decoder_for(msg).decode(msg, state=recv)
    with pytest.raises(WireError, match="codec"):
        codec.decode(msg, state=recv)


def test_the_encoder_refuses_nan():
    codec, send, _ = ends("bilevel")
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(torch.full((1, 4, 4), float("nan")), sample_ids=[0], state=send)


def test_payload_bytes():
    assert make_codec(CodecConfig.parse("tern", group_size=128)).payload_nbytes(1 << 14) == 3277 + 256
    assert make_codec(CodecConfig.parse("bilevel", group_size=128)).payload_nbytes(1 << 14) == 2048 + 512


def brute_force_rated(g: torch.Tensor, penalty: float) -> float:
    """The least `error + penalty * nonzeros` of any ternary code of `g` (every support, best scale)."""
    v = g.double()
    best = float(v.square().sum())
    for k in range(1, len(v) + 1):
        for support in itertools.combinations(range(len(v)), k):
            a = v[list(support)].abs()
            best = min(best, float(v.square().sum() - a.sum() ** 2 / k) + penalty * k)
    return best


def test_tern_rate_trades_nonzero_codes_for_error_optimally():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(24, generator=gen) * torch.tensor([3.0] * 8 + [1.0] * 8 + [0.1] * 8)
    mean_square = float(x.square().mean())
    plain, _ = ternary_quantize(x, 8)
    for rate in (0.5, 2.0):
        codes, scales = ternary_quantize(x, 8, rate)
        y = ternary_dequantize(codes, scales, 8)
        for i in range(3):
            g, c = x[8 * i : 8 * i + 8], codes[8 * i : 8 * i + 8]
            cost = float((y[8 * i : 8 * i + 8] - g).double().square().sum()) + rate * mean_square * int(
                c.count_nonzero()
            )
            assert cost <= brute_force_rated(g, rate * mean_square) * 1.002 + 1e-6
        assert codes.count_nonzero() < plain.count_nonzero()
    assert ternary_quantize(x, 8, 2.0)[0][16:].count_nonzero() == 0  # the small group sends nothing


def test_rate_label_and_validation():
    cfg = CodecConfig.parse("tern+ch+r50")
    assert cfg.rate_percent == 50 and cfg.label == "tern+ch+r50"
    for bad in ("acsgd2+r50", "tern+r1001"):
        with pytest.raises(ValueError, match="rate_percent"):
            CodecConfig.parse(bad)


def test_rated_tern_round_trips_bit_identically():
    codec, send, recv = ends("tern+ch+r50")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, 8, generator=gen)
    codec.decode(codec.encode(x, sample_ids=[1, 2, 3], state=send), state=recv)
    for _ in range(4):
        x = x + 0.1 * torch.randn(x.shape, generator=gen)
        codec.decode(codec.encode(x, sample_ids=[1, 2, 3], state=send), state=recv)
        assert torch.equal(snapshot(send)[1], snapshot(recv)[1])
