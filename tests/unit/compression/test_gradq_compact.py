"""gradq's Hadamard rotation (`+rot`) and compact scales (`+cs`, `+bs`): round trips, invertibility, error
feedback in the original domain, and malformed messages refused whole."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.rotation import fwht, padded_numel, rotate, unrotate
from swarm.proto import wire_pb2


def gradient(shape=(4, 16, 64), seed=0, outliers=True) -> torch.Tensor:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e-6
    if outliers:
        g[..., 3] *= 50  # an outlier channel, as activation gradients have
    return g


def roundtrip(cfg: CodecConfig, x: torch.Tensor, state=None) -> tuple[torch.Tensor, wire_pb2.TensorMessage]:
    msg = make_codec(cfg).encode(x, state=state)
    wire = unframe(list(frame(msg, zstd_level=1, chunk_bytes=1000)))
    return decoder_for(wire).decode(wire), msg  # the receiver's own config is the default: it reads the message


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("group", [2, 8, 256, 4096])
@pytest.mark.parametrize("numel", [1, 100, 4096, 5000])
def test_rotation_is_invertible_and_orthonormal(group, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    y = rotate(x, group, seed=7)
    assert y.numel() == padded_numel(numel, group)
    assert math.isclose(float(y.norm()), float(x.norm()), rel_tol=1e-5)  # orthonormal: norms kept
    torch.testing.assert_close(unrotate(y, group, 7, numel), x, atol=1e-5, rtol=1e-5)
    if numel >= 100:  # the seed matters (a single element may land on the same value by chance)
        assert not torch.allclose(unrotate(y, group, 8, numel), x)


def test_fwht_matches_the_hadamard_matrix():
    h = torch.tensor([[1.0]])
    for _ in range(4):
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(3, 16)
    torch.testing.assert_close(fwht(x), x @ h / 4)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("label", ["gradq{}+rot", "gradq{}+cs", "gradq{}+bs", "gradq{}+rot+cs", "gradq{}+rot+nr"])
def test_roundtrip_error_within_a_step(label, bits):
    cfg = CodecConfig.parse(label.format(bits), group_size=256)
    x = gradient()
    got, msg = roundtrip(cfg, x)
    assert got.shape == x.shape and got.dtype == x.dtype
    plain, _ = roundtrip(CodecConfig.parse(f"gradq{bits}" + ("+nr" if not cfg.stochastic else ""), group_size=256), x)
    assert rel(got, x) < 1.1 * rel(plain, x)  # compact scales cost little; rotation helps on outlier channels
    assert msg.rotation == (1 if cfg.rotation == "hadamard" else 0)
    compact = cfg.scale_dtype != "float32"
    assert (msg.quantized.scale_dtype != wire_pb2.FLOAT32) == compact
    if compact:
        assert len(msg.quantized.scales) == 2 * math.ceil(msg.quantized.numel / 256)


def test_rotation_cuts_the_error_of_outlier_gradients():
    x = gradient()
    plain, _ = roundtrip(CodecConfig.parse("gradq2+nr", group_size=1024), x)
    rotated, _ = roundtrip(CodecConfig.parse("gradq2+rot+nr", group_size=1024), x)
    assert rel(rotated, x) < 0.7 * rel(plain, x)


def test_auto_scales_pick_float16_for_unit_values_and_bfloat16_for_tiny_ones():
    cfg = CodecConfig.parse("gradq4+cs", group_size=256)
    _, unit = roundtrip(cfg, torch.randn(1024))
    _, tiny = roundtrip(cfg, torch.randn(1024) * 1e-7)
    assert unit.quantized.scale_dtype == wire_pb2.FLOAT16
    assert tiny.quantized.scale_dtype == wire_pb2.BFLOAT16


def test_compact_scales_still_cover_every_group_and_round_to_nearest_is_within_half_a_step():
    x = torch.randn(3000) * 3e-5 + 1e-3
    got, msg = roundtrip(CodecConfig.parse("gradq4+bs+nr", group_size=128), x)
    scales = torch.frombuffer(bytearray(msg.quantized.scales), dtype=torch.bfloat16).float()
    step = scales.repeat_interleave(128)[: x.numel()]
    assert bool(((got - x).abs() <= step / 2 * (1 + 1e-3) + 1e-12).all())


def test_stochastic_rounding_with_rotation_is_unbiased():
    x = gradient((2, 8, 64), outliers=False)
    cfg = CodecConfig.parse("gradq2+rot+cs", group_size=64)
    state = LinkState(cfg)
    mean = sum(make_codec(cfg).decode(make_codec(cfg).encode(x, state=state)) for _ in range(400)) / 400
    assert rel(mean, x) < 0.1


def test_error_feedback_residual_is_in_the_original_domain():
    cfg = CodecConfig.parse("gradq2+ef+rot+cs", group_size=256)
    state, codec = LinkState(cfg), make_codec(cfg)
    x = gradient()
    msg = codec.encode(x, state=state)
    sent = decoder_for(msg).decode(msg)
    torch.testing.assert_close(state.residual, x - sent, atol=1e-12, rtol=1e-4)
    x2 = gradient(seed=1)
    msg2 = codec.encode(x2, state=state)  # carries the residual: the sum of what arrived tracks the sum sent
    sent2 = decoder_for(msg2).decode(msg2)
    torch.testing.assert_close(state.residual, x + x2 - sent - sent2, atol=1e-12, rtol=1e-4)
    assert msg.rotation_seed != msg2.rotation_seed  # a fresh rotation per message, from the link's seed stream


def test_rotation_seeds_repeat_across_runs():
    cfg = CodecConfig.parse("gradq2+ef+rot", group_size=256, seed=3)
    runs = []
    for _ in range(2):
        state, codec = LinkState(cfg), make_codec(cfg)
        runs.append([codec.encode(gradient(seed=i), state=state).SerializeToString() for i in range(3)])
    assert runs[0] == runs[1]


def test_config_validation():
    with pytest.raises(ValueError, match="power-of-two"):
        CodecConfig.parse("gradq2+rot", group_size=1000)
    with pytest.raises(ValueError, match="gradq codec only"):
        CodecConfig.parse("directq2+cs")
    with pytest.raises(ValueError, match="scale_dtype"):
        CodecConfig(name="gradq", scale_dtype="float8")
    assert CodecConfig.parse("gradq2+ef+rot+cs").label == "gradq2+ef+rot+cs"
    assert CodecConfig.parse("gradq2+bs").label == "gradq2+bs"


def _message(label="gradq2+rot+cs", group=256) -> wire_pb2.TensorMessage:
    return make_codec(CodecConfig.parse(label, group_size=group)).encode(gradient())


def _bf16_bytes(n: int, value: float) -> bytes:
    return torch.full((n,), value, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


def _bad(msg: wire_pb2.TensorMessage, how: str) -> wire_pb2.TensorMessage:
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    q = bad.quantized
    if how == "rotation":
        bad.rotation = 7
    elif how == "seed-without-rotation":
        bad.rotation, bad.rotation_seed = 0, 5
    elif how == "not-power-of-two":
        q.group_size = 255
    elif how == "group-one":
        q.group_size = 1
    elif how == "nan-scale":
        q.scales = _bf16_bytes(len(q.scales) // 2, float("nan"))
    elif how == "inf-min":
        q.mins = _bf16_bytes(len(q.mins) // 2, float("inf"))
    elif how == "huge-scale":  # finite, but the un-rotated values would overflow float32
        q.scales = _bf16_bytes(len(q.scales) // 2, 1e37)
    elif how == "truncated":
        q.payload = q.payload[:-1]
    elif how == "numel-unpadded":
        q.numel = 4 * 16 * 64 - 1
    elif how == "scales-short":
        q.scales = q.scales[:-2]
    return bad


@pytest.mark.parametrize(
    "how, field",
    [
        ("rotation", "rotation"),
        ("seed-without-rotation", "rotation_seed"),
        ("not-power-of-two", "group_size"),
        ("group-one", "group_size"),
        ("nan-scale", "scales"),
        ("inf-min", "mins"),
        ("huge-scale", "scales"),
        ("truncated", "payload"),
        ("numel-unpadded", "numel"),
        ("scales-short", "scales"),
    ],
)
def test_malformed_messages_are_refused_whole(how, field):
    label = "gradq2+cs" if how == "seed-without-rotation" else "gradq2+rot+cs"
    bad = _bad(_message(label), how)
    cfg = CodecConfig.parse("gradq2+ef+rot+cs", group_size=256)
    state = LinkState(cfg)
    state.residual = torch.ones(3)
    with pytest.raises(WireError, match=field):
        decoder_for(bad, cfg).decode(bad, state=state)
    assert torch.equal(state.residual, torch.ones(3))  # refusal changed nothing


def test_fp16_output_that_overflows_after_unrotating_is_refused():
    msg = _message("gradq2+rot", 256)
    msg.dtype = wire_pb2.FLOAT16
    big = torch.full((len(msg.quantized.scales) // 4,), 3000.0)
    msg.quantized.scales = big.numpy().tobytes()
    with pytest.raises(WireError):
        decoder_for(msg).decode(msg)


def test_values_at_the_bound_unrotate_without_overflow():
    msg = _message("gradq2+rot", 256)
    groups = len(msg.quantized.scales) // 4
    edge = torch.finfo(torch.float32).max / 16 * 0.999  # the rotated domain's bound: float32 max / sqrt(256)
    msg.quantized.mins = torch.full((groups,), -edge).numpy().tobytes()
    msg.quantized.scales = torch.full((groups,), 2 * edge / 3).numpy().tobytes()
    out = decoder_for(msg).decode(msg)  # a sum of 256 such values would overflow before normalizing
    assert bool(torch.isfinite(out).all())
    msg.quantized.scales = torch.full((groups,), edge).numpy().tobytes()  # past the bound: refused
    with pytest.raises(WireError, match="scales"):
        decoder_for(msg).decode(msg)


def test_measure_script_counts_framed_bits_and_errors():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "scripts" / "measure_backward_codecs.py"
    spec = importlib.util.spec_from_file_location("measure_backward_codecs", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    steps = [[gradient(seed=2 * i), gradient(seed=2 * i + 1)] for i in range(2)]
    two = script.measure("gradq2+ef+rot+cs+nr", 256, steps)
    four = script.measure("gradq4+ef", 256, steps)
    assert two["messages"] == 4
    assert 1.0 < two["bits_per_element"] < 2.5 < four["bits_per_element"] < 4.5  # payload + scales + framing
    assert 0 < two["step_rel_error"] < 1 and 0 < four["step_rel_error"] < 1


@pytest.mark.parametrize("label", ["directq2", "aqsgd2", "acsgd2", "fp32"])
def test_codecs_that_never_rotate_refuse_a_rotated_message(label):
    import torch

    from swarm.compression import LinkState, make_codec
    from swarm.compression.codec_config import CodecConfig
    from swarm.compression.wire import WireError

    cfg = CodecConfig.parse(label)
    state = LinkState(cfg) if make_codec(cfg).uses_buffers else None
    msg = make_codec(cfg).encode(torch.randn(2, 4, 8), sample_ids=[0, 1], state=state)
    msg.rotation, msg.rotation_seed = 1, 7
    receiver = LinkState(cfg) if state is not None else None
    with pytest.raises(WireError, match="rotation"):
        make_codec(cfg).decode(msg, state=receiver)
