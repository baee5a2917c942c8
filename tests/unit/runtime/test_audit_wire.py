"""Audit tensors on the wire: fp32 exact, compact within fp16's rounding at any magnitude, and every malformed
message refused with the field named."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, WireError, WireLimits, make_codec
from swarm.runtime.audit import AuditRecord, Recomputed
from swarm.runtime.audit_wire import (
    MAX_SCALE_EXP,
    MAX_SKETCH_SIZE,
    audit_reply,
    compact_equal,
    decode_tensor,
    encode_tensor,
    recompute_reply,
    sketch,
)

torch.manual_seed(0)

PINNED = [4.0, -1.0, 2.0, 8.0]
"""sketch(arange(6), seed 12345, 4 buckets): a change of the hash would make every older stage's sketches differ"""


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


def test_the_sketch_is_linear_portable_and_estimates_norms():
    # the same bits on every machine: integer hashing, fp64 sums (this value pins the hash)
    assert sketch(torch.arange(6, dtype=torch.float32), 12345, 4).tolist() == PINNED
    a, b = torch.randn(2, 64, 64), torch.randn(2, 64, 64)
    assert torch.allclose(sketch(a - b, 7, 1024), sketch(a, 7, 1024) - sketch(b, 7, 1024), atol=1e-5)
    ratios = [float(sketch(a, seed, 1024).norm() / a.norm()) for seed in range(20)]
    assert all(0.85 < r < 1.15 for r in ratios)  # 3% standard deviation at 1024 buckets
    spike = torch.zeros(2, 64, 64)
    spike[1, 2, 3] = 5.0  # one element: kept whole in its bucket
    assert float(sketch(spike, 3, 1024).norm()) == pytest.approx(5.0)
    assert sketch(torch.zeros(0), 1, 8).tolist() == [0.0] * 8


def test_replies_sketch_only_what_a_sketch_shrinks_and_only_when_asked():
    big = AuditRecord(torch.randn(2, 64, 64), torch.randn(2, 64, 64), torch.randn(2, 64, 64), torch.randn(2, 64, 64))
    reply = audit_reply(big, False, False, True, compact=True, sketch_seed=5, sketch_size=1024)
    # a sibling recomputes from the input and the received gradient: values; the rest: sketches
    assert reply.HasField("input") and reply.HasField("grad_received") and not reply.HasField("output")
    assert len(reply.output_sketch) == 1024 and len(reply.grad_sent_sketch) == 1024
    assert torch.allclose(torch.tensor(list(reply.output_sketch), dtype=torch.float64), sketch(big.output, 5, 1024))
    first = audit_reply(big, True, False, True, compact=True, sketch_seed=5, sketch_size=1024)
    assert len(first.grad_received_sketch) == 1024  # stage 0's received gradient: nobody recomputes from it
    small = AuditRecord(torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8))
    assert audit_reply(small, False, False, True, True, 5, 1024).HasField("output")  # 64 elements: values pay
    assert not audit_reply(big, False, False, True, False, 5, 1024).output_sketch  # fp32 asked: never sketched
    with pytest.raises(WireError, match="sketch_size"):
        audit_reply(big, False, False, True, True, 5, MAX_SKETCH_SIZE + 1)
    done = recompute_reply(Recomputed(torch.randn(2, 64, 64), 0.0, torch.randn(2, 64, 64)), True, 9, 1024)
    assert len(done.output_sketch) == 1024 and len(done.grad_in_sketch) == 1024 and not done.HasField("output")
