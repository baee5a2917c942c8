"""Round trips of every codec, the AQ-SGD buffer protocol, error feedback and bad-input handling."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import (
    BufferMissError,
    CodecConfig,
    LinkState,
    WireError,
    decoder_for,
    frame,
    make_codec,
    unframe,
)
from swarm.proto import wire_pb2

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def roundtrip(cfg: CodecConfig, x: torch.Tensor, ids=None, send=None, recv=None) -> torch.Tensor:
    codec = make_codec(cfg)
    msg = codec.encode(x, sample_ids=ids, state=send)
    wire = unframe(list(frame(msg, zstd_level=cfg.zstd_level, chunk_bytes=1000)))
    return decoder_for(wire, cfg).decode(wire, state=recv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5, 7), (2, 1000), (4, 16, 33)])
def test_raw_codecs_roundtrip_within_their_precision(dtype, shape):
    x = torch.randn(shape).to(dtype)
    for name, tol in (("fp32", 0.0), ("fp16", 1e-3), ("bf16", 8e-3)):
        y = roundtrip(CodecConfig(name=name), x)
        assert y.dtype == dtype and y.shape == x.shape
        assert torch.allclose(y.float(), x.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("name", ["directq", "gradq"])
def test_quantized_codecs_error_within_one_step(name, bits):
    x = torch.randn(3, 17, 29)
    y = roundtrip(CodecConfig(name=name, bits=bits, group_size=64), x)
    flat = x.flatten()
    pad = (-flat.numel()) % 64
    groups = torch.cat([flat, flat[-1:].expand(pad)]).view(-1, 64)
    step = ((groups.max(1).values - groups.min(1).values) / (2**bits - 1)).repeat_interleave(64)[: flat.numel()]
    assert ((y.flatten() - flat).abs() <= step * 1.01 + 1e-6).all()


def test_zeros_and_empty_roundtrip_exactly():
    for name in ("directq", "gradq", "fp16"):
        assert torch.equal(roundtrip(CodecConfig(name=name, bits=2), torch.zeros(5, 300)), torch.zeros(5, 300))
        assert roundtrip(CodecConfig(name=name, bits=2), torch.zeros(0, 8)).shape == (0, 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_encoding_nan_or_inf_is_refused(bad):
    x = torch.randn(10)
    x[3] = bad
    for name in ("fp32", "directq"):
        with pytest.raises(ValueError, match="NaN or Inf"):
            make_codec(CodecConfig(name=name)).encode(x)


def test_ratio_targets_on_the_wire():
    """Payload plus scales: 2 bits at most 1/14 of fp32, 4 bits at most 1/7."""
    numel = 1 << 20
    assert make_codec(CodecConfig(name="aqsgd", bits=2)).ratio(numel) >= 14
    assert make_codec(CodecConfig(name="directq", bits=4)).ratio(numel) >= 7
    assert make_codec(CodecConfig(name="fp16")).ratio(numel) == 2


def test_gradq_error_feedback_carries_error_within_a_step_only():
    cfg = CodecConfig(name="gradq", bits=2, error_feedback=True, group_size=64)
    codec, state = make_codec(cfg), LinkState(cfg)
    g = torch.randn(4, 256)
    sent = [codec.decode(codec.encode(g, state=state)) for _ in range(200)]
    # With error feedback the running mean of what was sent converges to g far better than one message does.
    one_error = (sent[0] - g).norm()
    mean_error = (torch.stack(sent).mean(0) - g).norm()
    assert mean_error < one_error / 10
    assert state.residual is not None
    state.end_step()
    assert state.residual is None


def drifting_activations(rounds: int, samples: int, shape=(8, 32), seed=0):
    """Per-sample activations that move less and less, like a model settling."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(samples, *shape, generator=gen)
    for t in range(rounds):
        drift = torch.randn(samples, *shape, generator=gen) * (0.5 / (1 + t))
        base = base + drift
        yield base.clone()


def test_aqsgd_buffers_stay_bit_identical_and_error_falls_while_directq_does_not():
    cfg = CodecConfig(name="aqsgd", bits=2, group_size=128, seed=1)
    dq_cfg = CodecConfig(name="directq", bits=2, group_size=128, seed=1)
    send, recv = LinkState(cfg), LinkState(cfg)
    samples, batch = 12, 4
    aq_err, dq_err = [], []
    gen = torch.Generator().manual_seed(2)
    for t, acts in enumerate(drifting_activations(300, samples)):
        ids = torch.randperm(samples, generator=gen)[:batch].tolist()
        x = acts[ids]
        y = roundtrip(cfg, x, ids, send, recv)
        d = roundtrip(dq_cfg, x)
        if t >= 20:
            aq_err.append(float((y - x).norm() / x.norm()))
            dq_err.append(float((d - x).norm() / x.norm()))
        for s in ids:  # both ends' buffers, bit for bit
            assert torch.equal(send.buffers.get(s), recv.buffers.get(s))
    early, late = sum(aq_err[:40]) / 40, sum(aq_err[-40:]) / 40
    assert late < early / 3, (early, late)
    dq_early, dq_late = sum(dq_err[:40]) / 40, sum(dq_err[-40:]) / 40
    assert dq_late > dq_early * 0.7, (dq_early, dq_late)
    assert late < dq_late / 5


def test_aqsgd_first_sight_travels_in_full_and_receiver_computes_on_m():
    cfg = CodecConfig(name="aqsgd", bits=2)
    send, recv = LinkState(cfg), LinkState(cfg)
    x = torch.randn(3, 4, 50)
    codec = make_codec(cfg)
    msg = codec.encode(x, sample_ids=[7, 8, 9], state=send)
    assert list(msg.sample_is_delta) == [False, False, False]
    y = codec.decode(msg, state=recv)
    assert torch.equal(y, x.half().float())
    msg2 = codec.encode(x + 0.01, sample_ids=[9, 10, 7], state=send)
    assert list(msg2.sample_is_delta) == [True, False, True]
    y2 = codec.decode(msg2, state=recv)
    assert torch.equal(y2[0], recv.buffers.get(9).float())
    assert torch.equal(y2[2], recv.buffers.get(7).float())


def test_aqsgd_first_sight_quantized_keeps_buffers_identical():
    cfg = CodecConfig(name="aqsgd", bits=2, first_sight_bits=8)
    send, recv = LinkState(cfg), LinkState(cfg)
    codec = make_codec(cfg)
    x = torch.randn(2, 300)
    for _ in range(3):
        codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=recv)
        x = x + 0.01
    for s in (1, 2):
        assert torch.equal(send.buffers.get(s), recv.buffers.get(s))


def test_restarted_receiver_reports_a_miss_and_a_full_resend_recovers():
    cfg = CodecConfig(name="aqsgd", bits=4)
    codec = make_codec(cfg)
    send, recv = LinkState(cfg), LinkState(cfg)
    x = torch.randn(2, 64)
    codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=recv)
    fresh = LinkState(cfg)  # the receiver restarted: its buffers are gone
    with pytest.raises(BufferMissError) as miss:
        codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=fresh)
    assert sorted(miss.value.sample_ids) == [1, 2]
    send.buffers.forget(miss.value.sample_ids)
    y = codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=fresh)
    assert torch.equal(y, x.half().float())
    assert torch.equal(send.buffers.get(1), fresh.buffers.get(1))


def test_aqsgd_at_capacity_sends_new_samples_in_full_every_time():
    cfg = CodecConfig(name="aqsgd", bits=2, buffer_capacity=2, buffer_eviction="none")
    codec = make_codec(cfg)
    send, recv = LinkState(cfg), LinkState(cfg)
    x = torch.randn(3, 40)
    with pytest.warns(UserWarning, match="full"):
        codec.decode(codec.encode(x, sample_ids=[1, 2, 3], state=send), state=recv)
    msg = codec.encode(x, sample_ids=[1, 2, 3], state=send)
    assert list(msg.sample_is_delta) == [True, True, False]
    y = codec.decode(msg, state=recv)
    assert torch.equal(y[2], x[2].half().float())
    assert len(send.buffers) == len(recv.buffers) == 2


def test_aqsgd_on_a_memory_mapped_store(tmp_path):
    cfg = CodecConfig(name="aqsgd", bits=4, buffer_path=str(tmp_path / "send.buf"))
    rcfg = CodecConfig(name="aqsgd", bits=4, buffer_path=str(tmp_path / "recv.buf"))
    send, recv = LinkState(cfg), LinkState(rcfg)
    codec = make_codec(cfg)
    for t in range(5):
        x = torch.randn(4, 8, 16) * 0.1 + t
        codec.decode(codec.encode(x, sample_ids=[0, 1, 2, 3], state=send), state=recv)
    assert (tmp_path / "send.buf").exists()
    for s in range(4):
        assert torch.equal(send.buffers.get(s), recv.buffers.get(s))


def test_aqsgd_rejects_missing_or_repeated_sample_ids():
    cfg = CodecConfig(name="aqsgd", bits=2)
    codec = make_codec(cfg)
    with pytest.raises(ValueError, match="sample id"):
        codec.encode(torch.randn(2, 4), sample_ids=[1], state=LinkState(cfg))
    with pytest.raises(ValueError, match="distinct"):
        codec.encode(torch.randn(2, 4), sample_ids=[1, 1], state=LinkState(cfg))


def test_decode_names_the_bad_field():
    codec = make_codec(CodecConfig(name="directq", bits=4))
    msg = codec.encode(torch.randn(10, 10))
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    bad.quantized.payload = bad.quantized.payload[:-1]
    with pytest.raises(WireError, match="quantized.payload"):
        codec.decode(bad)
    bad.CopyFrom(msg)
    bad.shape[:] = [10, 11]
    with pytest.raises(WireError, match="quantized.numel"):
        codec.decode(bad)
    bad.CopyFrom(msg)
    bad.quantized.bits = 5
    with pytest.raises(WireError, match="bits"):
        codec.decode(bad)
    bad.CopyFrom(msg)
    bad.shape[:] = [2] * 9
    with pytest.raises(WireError, match="dims"):
        codec.decode(bad)
    bad.CopyFrom(msg)
    bad.codec = 42
    with pytest.raises(WireError, match="codec"):
        decoder_for(bad)


def test_decoded_nan_from_the_network_is_refused():
    msg = make_codec(CodecConfig(name="fp32")).encode(torch.ones(4))
    msg.raw = torch.tensor([1.0, float("nan"), 1.0, 1.0]).numpy().tobytes()
    with pytest.raises(WireError, match="NaN"):
        make_codec(CodecConfig(name="fp32")).decode(msg)


def test_registry_is_complete_and_parse_roundtrips_labels():
    from swarm.compression import REGISTRY

    assert set(REGISTRY) == set(wire_pb2.Codec.values()) - {wire_pb2.CODEC_UNSPECIFIED}
    for label in ("fp32", "aqsgd2", "gradq4+ef", "directq8"):
        assert CodecConfig.parse(label).label == label
    with pytest.raises(ValueError, match="codec name"):
        CodecConfig(name="lz4")
