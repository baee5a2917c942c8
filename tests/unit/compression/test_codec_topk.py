"""TOPK, the replicas' sparsified sum: each group's largest elements survive with their signs, error feedback makes
every element arrive eventually, decoding is deterministic, and every malformed message is refused by field."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CodecConfig, WireError, decoder_for, make_codec
from swarm.compression.codec_topk import index_bits, kept_counts, pack_fields, unpack_fields
from swarm.compression.state import LinkState

TOPK = CodecConfig.parse("topk2+ef+k8+g64", zstd_level=0)


def roundtrip(x: torch.Tensor, config: CodecConfig = TOPK, state: LinkState | None = None):
    msg = make_codec(config).encode(x, state=state)
    return msg, decoder_for(msg, config).decode(msg)


def test_label_parses_back_and_keep_belongs_to_topk_only():
    assert TOPK.label == "topk2+ef+k8+g64" and CodecConfig.parse(TOPK.label, zstd_level=0) == TOPK
    default = CodecConfig.parse("topk2+ef")
    assert default.label == "topk2+ef" and make_codec(default).payload_nbytes(4096) == 64 * 14 // 8 + 8  # 64 of 4096
    with pytest.raises(ValueError, match="keep"):
        CodecConfig.parse("gradq2+ef+k8")
    with pytest.raises(ValueError, match="topk keeps"):
        CodecConfig.parse("topk2+k100+g64")
    with pytest.raises(ValueError, match="flat groups"):
        CodecConfig.parse("topk2+rot")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_each_group_keeps_its_largest_elements_with_their_signs(bits):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(bits))
    config = CodecConfig(name="topk", bits=bits, keep=8, group_size=64)
    _, y = roundtrip(x, config)
    for g in range(math.ceil(1000 / 64)):
        part, got = x[g * 64 : (g + 1) * 64], y[g * 64 : (g + 1) * 64]
        kept = got != 0
        assert int(kept.sum()) == min(8, part.numel())
        assert set(part.abs().topk(int(kept.sum())).indices.tolist()) == set(kept.nonzero().view(-1).tolist())
        assert torch.equal(got[kept].sign(), part[kept].sign())
        span = part[kept].abs().max() - part[kept].abs().min()
        assert (got[kept].abs() - part[kept].abs()).abs().max() <= span / ((1 << (bits - 1)) - 1) / 2 + 1e-6


def test_error_feedback_keeps_what_the_message_left_out_and_sends_it_later():
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    state = LinkState(TOPK)
    _, y = roundtrip(x, state=state)
    torch.testing.assert_close(state.residual + y, x, rtol=0, atol=1e-6)
    sent = y.clone()
    for _ in range(200):  # the same gradient again and again: what is sent catches up with all of it
        _, y = roundtrip(x, state=state)
        sent += y
    torch.testing.assert_close(sent / 201, x, rtol=0, atol=0.1 * float(x.abs().max()))
    assert float(state.residual.abs().max()) < 20 * float(x.abs().max())  # bounded, not growing without end


def test_decoding_is_a_pure_function_of_the_message():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    msg, y = roundtrip(x)
    again = decoder_for(msg).decode(msg)  # another decoder, no config: the same bits
    assert torch.equal(y.view(torch.int32), again.view(torch.int32))


@pytest.mark.parametrize("numel", [0, 1, 5, 63, 64, 65, 129])
def test_odd_sizes_zeros_and_bf16(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    msg, y = roundtrip(x)
    assert y.shape == x.shape and int((y != 0).sum()) <= int(kept_counts(numel, 64, 8).sum())
    _, z = roundtrip(torch.zeros(numel))
    assert torch.equal(z, torch.zeros(numel))
    _, b = roundtrip(x.view(1, -1).bfloat16())
    assert b.dtype == torch.bfloat16 and b.shape == (1, numel)
    assert len(msg.SerializeToString()) <= 8 * math.ceil(numel / 64) + 4 * numel + 64


def test_nan_or_inf_is_never_sent():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or Inf"):
            make_codec(TOPK).encode(torch.tensor([1.0, bad]))


def test_a_64th_of_the_elements_costs_about_a_quarter_bit_each():
    x = torch.randn(1 << 16)
    config = CodecConfig.parse("topk2+ef+k64+g4096", zstd_level=0)
    msg, _ = roundtrip(x, config)
    bits = 8 * len(msg.SerializeToString()) / x.numel()
    assert bits < 0.26 and config.wire_bits == 1  # 64 x (12 + 2) bits and 64 bits of scales per 4096


def test_fields_pack_and_unpack_exactly_and_refuse_padding():
    values = torch.randint(0, 1 << 12, (77,)).numpy()
    payload = pack_fields(values, 12)
    assert (unpack_fields(payload, 77, 12, "f") == values).all()
    with pytest.raises(WireError, match="padding"):
        unpack_fields(payload[:-1] + bytes([payload[-1] | 0x80]), 77, 12, "f")
    with pytest.raises(WireError, match="bytes"):
        unpack_fields(payload + b"\0", 77, 12, "f")
    assert index_bits(1) == 1 and index_bits(4096) == 12 and index_bits(4097) == 13


def _tampered(edit):
    x = torch.randn(200, generator=torch.Generator().manual_seed(3))
    msg = make_codec(TOPK).encode(x)
    edit(msg)
    return msg


def _set_floats(field, values):
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: setattr(m.sparse, "group_size", 0), "sparse.group_size"),
        (lambda m: setattr(m.sparse, "keep", 0), "sparse.keep"),
        (lambda m: setattr(m.sparse, "keep", 65), "sparse.keep"),
        (lambda m: setattr(m.sparse, "bits", 5), "sparse.bits"),
        (lambda m: setattr(m.sparse, "index", m.sparse.index[:-1]), "sparse.index"),
        (lambda m: setattr(m.sparse, "codes", m.sparse.codes + b"\0"), "sparse.codes"),
        (lambda m: setattr(m.sparse, "lo", m.sparse.lo[:-4]), "sparse.lo"),
        (lambda m: setattr(m.sparse, "lo", _set_floats(m, [float("nan")] * 4)), "sparse.lo"),
        (lambda m: setattr(m.sparse, "hi", _set_floats(m, [float("inf")] * 4)), "sparse.lo"),
        (lambda m: setattr(m.sparse, "lo", _set_floats(m, [-1.0] * 4)), "sparse.lo"),
        (lambda m: setattr(m.sparse, "lo", _set_floats(m, [1e9] * 4)), "sparse.lo"),  # lo > hi
        (lambda m: setattr(m.sparse, "index", pack_fields([5, 3] + [0] * 30, 6)), "sparse.index"),  # descending
        (lambda m: setattr(m.sparse, "index", pack_fields(list(range(24)) + [0, 1, 2, 3, 4, 5, 6, 9], 6)),
         "sparse.index"),  # the last group (8 elements long) has an offset past its end
    ],
)  # fmt: skip
def test_malformed_messages_are_refused_by_field(edit, field):
    msg = _tampered(edit)
    with pytest.raises(WireError) as e:
        decoder_for(msg).decode(msg)
    assert e.value.field == field, str(e.value)


def test_a_decoded_value_past_the_messages_dtype_is_refused():
    msg = make_codec(TOPK).encode(torch.randn(64).half())
    msg.sparse.hi = _set_floats(msg, [1e6])
    with pytest.raises(WireError, match="hi"):
        decoder_for(msg).decode(msg)
