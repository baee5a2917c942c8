"""Audit tensors on the wire: fp32 exact, compact within fp16's rounding at any magnitude, and every malformed
message refused with the field named."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, WireError, WireLimits, make_codec
from swarm.runtime.audit import AuditRecord, Recomputed
from swarm.runtime.audit_wire import (
    MAX_SCALE_EXP,
    audit_reply,
    compact_equal,
    decode_tensor,
    encode_tensor,
    recompute_reply,
)

torch.manual_seed(0)


@pytest.mark.parametrize("magnitude", [1.0, 1e-9, 1e-30, 1e30, 3e38])
@pytest.mark.parametrize("shape", [(2, 16, 32), (3, 5, 7), (1,), (0, 4)])
def test_compact_round_trips_within_fp16s_rounding_at_any_magnitude(magnitude, shape):
    t = torch.randn(shape) * magnitude if magnitude < 1e38 else torch.full(shape, 3e38)
    msg, scale = encode_tensor(t, True)
    back = decode_tensor(msg, scale, "x")
    assert back.dtype == torch.float32 and back.shape == t.shape
    err = (back.double() - t.double()).abs()
    assert bool((err <= t.double().abs() * 2.0**-11).all())  # fp16's half ulp, relative: no under- or overflow
    assert compact_equal(t, back)
    if t.numel() > 4:
        assert msg.ByteSize() < 0.55 * encode_tensor(t, False)[0].ByteSize()


def test_fp32_is_exact_and_zeros_need_no_scale():
    t = torch.randn(2, 3, 4)
    msg, scale = encode_tensor(t, False)
    assert scale == 0 and torch.equal(decode_tensor(msg, 0, "x"), t)
    msg, scale = encode_tensor(torch.zeros(2, 3), True)
    assert scale == 0 and torch.equal(decode_tensor(msg, scale, "x"), torch.zeros(2, 3))


def test_bf16_and_fp16_tensors_are_taken():
    for dtype in (torch.bfloat16, torch.float16):
        t = torch.randn(4, 8).to(dtype)
        msg, scale = encode_tensor(t, True)
        assert torch.equal(decode_tensor(msg, scale, "x"), t.float())


def test_nan_and_inf_are_refused_before_sending():
    for bad in (float("nan"), float("inf")):
        t = torch.ones(3)
        t[1] = bad
        for compact in (False, True):
            with pytest.raises(ValueError, match="NaN or Inf"):
                encode_tensor(t, compact)


def test_compact_equal_sees_one_changed_element():
    t = torch.randn(2, 8, 16)
    msg, scale = encode_tensor(t, True)
    shown = decode_tensor(msg, scale, "x")
    assert compact_equal(t, shown)
    moved = shown.clone()
    moved[1, 3, 5] *= 1.01
    assert not compact_equal(t, moved) and not compact_equal(t, shown[:1])


def test_malformed_tensors_are_refused_naming_the_field():
    t = torch.randn(2, 4)
    msg, scale = encode_tensor(t, True)
    with pytest.raises(WireError, match="grad.*scale"):
        decode_tensor(msg, MAX_SCALE_EXP + 1, "grad")
    with pytest.raises(WireError, match="input.*range"):  # a legal scale that takes the values past fp32
        decode_tensor(msg, MAX_SCALE_EXP, "input")
    exact, _ = encode_tensor(t, False)
    with pytest.raises(WireError, match="output.*scale"):
        decode_tensor(exact, 3, "output")
    other = make_codec(CodecConfig.parse("directq8")).encode(t)
    with pytest.raises(WireError, match="input.*fp32 or fp16"):
        decode_tensor(other, 0, "input")
    short = type(msg)()
    short.CopyFrom(msg)
    short.raw = short.raw[:-2]
    with pytest.raises(WireError, match="input"):
        decode_tensor(short, scale, "input")
    big, big_scale = encode_tensor(torch.randn(64, 64), True)
    with pytest.raises(WireError, match="input"):
        decode_tensor(big, big_scale, "input", WireLimits(max_numel=1000))
    nan = type(msg)()
    nan.CopyFrom(msg)
    nan.raw = torch.tensor([float("nan")] * 8, dtype=torch.float16).numpy().tobytes()
    with pytest.raises(WireError, match="input"):
        decode_tensor(nan, scale, "input")


def test_replies_carry_what_was_asked():
    record = AuditRecord(torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8) * 1e-7, torch.randn(2, 4, 8))
    exact = audit_reply(record, False, False, True)
    compact = audit_reply(record, False, False, True, compact=True)
    assert compact.ByteSize() < 0.55 * exact.ByteSize()
    for name in ("input", "output", "grad_received", "grad_sent"):
        got = decode_tensor(getattr(compact, name), getattr(compact, f"{name}_scale"), name)
        assert compact_equal(getattr(record, "inputs" if name == "input" else name), got)
        assert torch.equal(
            decode_tensor(getattr(exact, name), 0, name), getattr(record, "inputs" if name == "input" else name)
        )
    done = recompute_reply(Recomputed(torch.randn(2, 4, 8), 0.0, torch.randn(2, 4, 8)), compact=True)
    assert done.output_scale and done.grad_in_scale
