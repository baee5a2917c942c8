"""ACSGD: the AQ-SGD paper's quantizer (fp16 max-abs scale per group, symmetric grid) behind AQ-SGD's buffer
protocol: exact round trips, bit-identical buffers, the bench's independent rewrite agrees, and malformed
messages are refused whole with nothing committed."""

from __future__ import annotations

import pytest
import torch

from swarm.bench.codec_deltas import pack_codes, paper_quantize, unpack_codes
from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.layout import CHANNEL, to_groups
from swarm.kernels import quantize
from swarm.kernels.symmetric import dequantize_codes as sym_dequantize
from swarm.kernels.symmetric import quantize_codes as sym_quantize
from swarm.proto import wire_pb2


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_matches_the_kernels_bitstream(bits):
    q = quantize(torch.randn(999), bits, 64, stochastic=False)
    payload = q.packed.numpy().tobytes()
    codes = unpack_codes(payload, bits, 999)
    assert pack_codes(codes, bits) == payload


@pytest.mark.parametrize("bits", [2, 4])
def test_channel_codes_are_the_papers(bits):
    d = torch.randn(3, 32, 16)
    d[..., 0] *= 10
    codes, scales = sym_quantize(to_groups(d, CHANNEL), bits, 32)
    ref_codes, ref_scale = paper_quantize(d, bits)
    assert torch.equal(scales, ref_scale.view(-1))
    assert torch.equal(codes.view(3, 16, 32).transpose(1, 2), ref_codes)
    y = sym_dequantize(codes, scales, bits, 32)
    assert (y.view(3, 16, 32).abs() <= scales.float().view(3, 16, 1)).all()


def test_zero_and_huge_groups_stay_finite():
    x = torch.zeros(2, 8)
    x[1] = 1e6  # beyond fp16: the scale clamps to its largest finite value and the values clip
    codes, scales = sym_quantize(x, 2, 8)
    y = sym_dequantize(codes, scales, 2, 8)
    assert torch.isfinite(y).all() and (y[:8] == 0).all()


def ends(label="acsgd2+ch+nr", **kw):
    cfg = CodecConfig.parse(label, seed=5, **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def snapshot(state):
    ids = sorted(state.buffers.ids())
    return ids, state.buffers.gather(state.buffers.lookup(ids)).clone()


@pytest.mark.parametrize("first_sight_bits", [16, 4])
@pytest.mark.parametrize("label", ["acsgd2+ch+nr", "acsgd2+sr", "acsgd4+ch+sr"])
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
        assert msg.codec == wire_pb2.ACSGD
        decoder_for(msg).decode(msg, state=recv)
        (a_ids, a), (b_ids, b) = snapshot(send), snapshot(recv)
        assert a_ids == b_ids and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert float((recv.buffers.gather(recv.buffers.lookup(ids)).float() - x).norm() / x.norm()) < 0.1


def fp16_bytes(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float16).numpy().tobytes()


TAMPERS = {
    "nan scale": lambda q: setattr(q, "scales", fp16_bytes(float("nan")) + q.scales[2:]),
    "negative scale": lambda q: setattr(q, "scales", fp16_bytes(-1.0) + q.scales[2:]),
    "scale past the buffer": lambda q: setattr(q, "scales", fp16_bytes(float("inf")) + q.scales[2:]),
    "short scales": lambda q: setattr(q, "scales", q.scales[:-2]),
    "short payload": lambda q: setattr(q, "payload", q.payload[:-1]),
    "mins": lambda q: setattr(q, "mins", b"\0" * 8),
    "fp32 scales": lambda q: setattr(q, "scale_dtype", wire_pb2.FLOAT32),
    "bits": lambda q: setattr(q, "bits", 5),
    "numel": lambda q: setattr(q, "numel", q.numel + 1),
    "group": lambda q: setattr(q, "group_size", 0),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_malformed_messages_are_refused_whole(tamper):
    codec, send, recv = ends(buffer_dtype="float16")
    x = torch.randn(3, 16, 8)
    codec.decode(codec.encode(x, sample_ids=[1, 2, 3], state=send), state=recv)
    msg = codec.encode(x + 0.1, sample_ids=[1, 2, 3], state=send)
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    TAMPERS[tamper](bad.quantized)
    before = snapshot(recv)[1]
    with pytest.raises(WireError):
        codec.decode(bad, state=recv)
    assert torch.equal(snapshot(recv)[1], before)
    codec.decode(msg, state=recv)
    assert torch.equal(snapshot(recv)[1], snapshot(send)[1])


def test_a_huge_but_finite_scale_cannot_overflow_an_fp16_buffer():
    codec, send, recv = ends(buffer_dtype="float16")
    x = torch.full((2, 16, 8), -100.0)
    codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=recv)
    msg = codec.encode(x, sample_ids=[1, 2], state=send)
    msg.quantized.scales = fp16_bytes(65504.0) * (len(msg.quantized.scales) // 2)
    msg.quantized.payload = b"\0" * len(msg.quantized.payload)  # every code -scale: -100 - 65504 leaves fp16
    before = snapshot(recv)[1]
    with pytest.raises(WireError):
        codec.decode(msg, state=recv)
    assert torch.equal(snapshot(recv)[1], before)


def test_label_and_bytes():
    cfg = CodecConfig.parse("acsgd2+ch")
    assert cfg.label == "acsgd2+ch" and cfg.wire_bits == 2
    assert make_codec(CodecConfig.parse("acsgd2", group_size=128)).payload_nbytes(1 << 14) == 4096 + 256
