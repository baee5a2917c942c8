"""MSE-clipped first-sight scales (`+clip`): never more error than the max-abs scale, the plain quantizer at
fraction 1, the same wire (bounds refused naming the field), both ends buffering the same bits."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.clipping import CLIP_FRACTIONS, clipped_quantize
from swarm.kernels import symmetric


def ends(label: str, **kw):
    cfg = CodecConfig.parse(label, seed=7, **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def loud_token_rows(gen, n: int, tokens: int, hidden: int) -> torch.Tensor:
    """Residual-stream-like rows: a few loud channels and one loud token per sample."""
    x = torch.randn(n, tokens, hidden, generator=gen)
    x[:, :, :2] *= 8
    x[:, 0] *= 20
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("numel, group", [(4096, 128), (1000, 96), (5, 8), (0, 4)])
def test_fraction_one_is_the_plain_quantizer(bits, numel, group):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(bits)) * 3
    plain, clipped = symmetric.quantize(x, bits, group), clipped_quantize(x, bits, group, (1.0,))
    assert torch.equal(plain.packed, clipped.packed) and torch.equal(plain.scales, clipped.scales)


@pytest.mark.parametrize("bits, at_most", [(2, 0.8), (3, 0.9), (4, 0.97)])
def test_clipping_never_adds_error_and_cuts_it_on_heavy_tails(bits, at_most):
    gen = torch.Generator().manual_seed(bits)
    sign = torch.randint(0, 2, (64 * 128,), generator=gen) * 2 - 1
    x = torch.empty(64 * 128).exponential_(generator=gen) * sign  # Laplace: heavy tails make the max a poor scale
    plain, clipped = symmetric.quantize(x, bits, 128), clipped_quantize(x, bits, 128)
    plain_err = (symmetric.dequantize(plain) - x).view(-1, 128).pow(2).sum(1)
    clip_err = (symmetric.dequantize(clipped) - x).view(-1, 128).pow(2).sum(1)
    assert bool((clip_err <= plain_err * (1 + 1e-6)).all())  # per group: 1.0 is among the candidates
    assert float(clip_err.sum()) < at_most * float(plain_err.sum())
    assert bool((clipped.scales <= plain.scales).all())


def test_zeros_odd_sizes_and_bad_input():
    q = clipped_quantize(torch.zeros(37), 3, 16)
    assert torch.equal(symmetric.dequantize(q), torch.zeros(37))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or Inf"):
            clipped_quantize(torch.tensor([1.0, bad]), 3, 2)
    with pytest.raises(ValueError, match="fractions"):
        clipped_quantize(torch.ones(4), 3, 4, (1.5,))
    with pytest.raises(ValueError, match="bits"):
        clipped_quantize(torch.ones(4), 5, 4)
    big = torch.tensor([1e6, -1e6, 1.0])  # past fp16: the scale clamps to its largest finite value
    assert bool(torch.isfinite(symmetric.dequantize(clipped_quantize(big, 8, 4))).all())
    bf16 = torch.randn(300, dtype=torch.bfloat16)
    assert clipped_quantize(bf16, 4, 128).numel == 300


@pytest.mark.parametrize("label", ["acsgd2+ch+nr+fs3+clip", "acsgd2+ch+sr+fs4+clip", "acsgd3+nr+rot+fs3+clip"])
def test_buffers_stay_bit_identical_and_the_error_drops(label):
    codec, send, recv = ends(label, group_size=32)
    plain_codec, plain_send, plain_recv = ends(label.replace("+clip", ""), group_size=32)
    gen = torch.Generator().manual_seed(0)
    acts = {i: loud_token_rows(gen, 1, 32, 16)[0] for i in range(12)}
    clip_err = plain_err = 0.0
    for step in range(12):
        ids = sorted(torch.randperm(12, generator=gen)[:4].tolist())
        x = torch.stack([acts[i] for i in ids])
        msg = unframe(list(frame(codec.encode(x, sample_ids=ids, state=send), chunk_bytes=500)))
        out = decoder_for(msg).decode(msg, state=recv)
        a_ids, b_ids = sorted(send.buffers.ids()), sorted(recv.buffers.ids())
        a, b = (s.buffers.gather(s.buffers.lookup(a_ids)) for s in (send, recv))
        assert a_ids == b_ids and torch.equal(a.view(torch.int16), b.view(torch.int16))
        plain = plain_codec.decode(plain_codec.encode(x, sample_ids=ids, state=plain_send), state=plain_recv)
        if step == 0:  # all first sights
            clip_err, plain_err = float((out - x).norm()), float((plain - x).norm())
    assert clip_err < plain_err


def test_a_clipped_first_sight_is_checked_like_any_other():
    codec, send, recv = ends("acsgd3+ch+nr+fs3+clip")
    x = loud_token_rows(torch.Generator().manual_seed(2), 2, 16, 8)
    msg = codec.encode(x, sample_ids=[1, 2], state=send)
    msg.quantized_full.scales = torch.full((16,), float("nan"), dtype=torch.float16).numpy().tobytes()
    with pytest.raises(WireError, match="quantized_full.scales"):
        decoder_for(msg).decode(msg, state=recv)
    assert not list(recv.buffers.ids())  # a refused message commits nothing
    msg = codec.encode(x, sample_ids=[3, 4], state=send)
    msg.quantized_full.payload = msg.quantized_full.payload[:-1]
    with pytest.raises(WireError, match="quantized_full.payload"):
        decoder_for(msg).decode(msg, state=recv)


def test_labels_and_config_checks():
    cfg = CodecConfig.parse("acsgd2+ch+nr+fs3+clip")
    assert cfg.first_sight_clip and cfg.label == "acsgd2+ch+fs3+clip"
    assert CodecConfig.parse(cfg.label).first_sight_clip
    with pytest.raises(ValueError, match=r"\+fsN"):
        CodecConfig.parse("acsgd2+ch+clip")
    with pytest.raises(ValueError, match="applies to"):
        CodecConfig.parse("gradq2+ef+clip")
    assert CLIP_FRACTIONS[0] == 1.0 and min(CLIP_FRACTIONS) == 0.5
