"""First sights quantized directly (`+fsN`), rotated (`+rot`): both ends buffer what the receiver decoded, bit for
bit, a later visit's delta is taken against it, and a message that misstates its rotation is refused whole."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression import rotation as rot
from swarm.proto import wire_pb2


def ends(label: str, **kw):
    cfg = CodecConfig.parse(label, seed=7, **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def snapshot(state):
    ids = sorted(state.buffers.ids())
    return ids, state.buffers.gather(state.buffers.lookup(ids)).clone()


def activations(gen, n: int, tokens: int, hidden: int) -> torch.Tensor:
    """Residual-stream-like rows: a few loud channels and a loud first token."""
    x = torch.randn(n, tokens, hidden, generator=gen)
    x[:, :, :2] *= 8
    x[:, 0] *= 20
    return x


def test_integer_hadamard_is_the_rotations_matrix():
    for g in (2, 8, 128):
        assert torch.equal(rot.hadamard_integers(torch.eye(g, dtype=torch.int32)).float(), rot._hadamard(g))


def test_unrotate_grid_inverts_rotate():
    x = torch.randn(6, 64)
    y = rot.rotate(x, 64, 11)
    steps = torch.full((6,), 1 / 64)
    codes = torch.round(y.view(6, 64) / steps[:, None]).to(torch.int32)
    back = rot.unrotate_grid(codes.view(-1), steps, 64, 11)
    assert torch.allclose(back, rot.unrotate(codes.float().view(-1) * (1 / 64), 64, 11, x.numel()), atol=1e-6)
    assert float((back.view(6, 64) - x).abs().max()) < 0.05


@pytest.mark.parametrize(
    "label", ["acsgd2+ch+nr+rot+fs4", "acsgd2+ch+sr+rot+fs2", "acsgd4+nr+rot+fs3", "tern+ch+rot+fs4", "acsgd2+ch+fs8"]
)
@pytest.mark.parametrize("tokens, hidden", [(32, 16), (24, 16), (16, 12)])  # hidden 12: first sights unrotated
def test_buffers_stay_bit_identical_with_rotated_first_sights(label, tokens, hidden):
    codec, send, recv = ends(label, group_size=32)
    gen = torch.Generator().manual_seed(0)
    acts = {i: activations(gen, 1, tokens, hidden)[0] for i in range(12)}
    for _ in range(12):
        ids = sorted(torch.randperm(12, generator=gen)[:4].tolist())
        x = torch.stack([acts[i] for i in ids])
        msg = unframe(list(frame(codec.encode(x, sample_ids=ids, state=send), chunk_bytes=500)))
        expect_rotated = "+rot" in label and hidden == 16 and not all(msg.sample_is_delta)
        assert msg.rotation == int(expect_rotated)
        if expect_rotated:
            assert msg.quantized_full.group_size == hidden  # one group per token
        out = decoder_for(msg).decode(msg, state=recv)
        (a_ids, a), (b_ids, b) = snapshot(send), snapshot(recv)
        assert a_ids == b_ids and torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert torch.equal(out.half(), recv.buffers.gather(recv.buffers.lookup(ids)))


def test_a_revisit_is_a_delta_against_what_the_receiver_decoded():
    codec, send, recv = ends("acsgd2+ch+nr+rot+fs2")
    x = activations(torch.Generator().manual_seed(1), 3, 32, 8)
    first = codec.decode(codec.encode(x, sample_ids=[4, 5, 6], state=send), state=recv)
    assert not torch.equal(first, x)  # 2 bits lose something...
    assert torch.equal(send.buffers.gather(send.buffers.lookup([4, 5, 6])), first.half())  # ...the sender knows
    again = codec.encode(x, sample_ids=[4, 5, 6], state=send)
    assert list(again.sample_is_delta) == [True] * 3 and not again.HasField("quantized_full")
    second = codec.decode(again, state=recv)
    assert float((second - x).norm()) < float((first - x).norm())  # the delta carries the first sight's error


def test_rotation_lowers_the_first_sights_error_on_a_loud_first_token():
    x = activations(torch.Generator().manual_seed(2), 8, 128, 32)
    errors = {}
    for label in ("acsgd2+ch+nr+fs4", "acsgd2+ch+nr+rot+fs4"):
        codec, send, recv = ends(label)
        y = codec.decode(codec.encode(x, sample_ids=list(range(8)), state=send), state=recv)
        errors[label] = float((y - x).norm() / x.norm())
    assert errors["acsgd2+ch+nr+rot+fs4"] < 0.7 * errors["acsgd2+ch+nr+fs4"], errors


@pytest.mark.parametrize("label", ["acsgd2+ch+nr+rot+fs2", "acsgd2+nr+rot+fs4"])
def test_a_rotated_first_sight_of_a_token_depends_on_no_later_token(label):
    codec = make_codec(CodecConfig.parse(label, group_size=32))
    x = activations(torch.Generator().manual_seed(3), 2, 32, 16)
    later = x.clone()
    later[:, -1] *= 50  # only the last position changes
    decoded = [codec.decode(codec.encode(a, sample_ids=[1, 2], state=LinkState(codec.config)),
                            state=LinkState(codec.config)) for a in (x, later)]  # fmt: skip
    assert torch.equal(decoded[0][:, :-1], decoded[1][:, :-1])


def test_a_channel_grouped_first_sight_depends_on_later_tokens():
    """Why the causal choice is per-token groups: a channel's one scale spans all its tokens, so a loud last token
    changes every earlier position's decoded value (the future reaches the past through the scale)."""
    codec = make_codec(CodecConfig.parse("acsgd2+ch+nr+fs3"))
    x = activations(torch.Generator().manual_seed(3), 2, 32, 16)
    later = x.clone()
    later[:, -1] *= 50
    decoded = [codec.decode(codec.encode(a, sample_ids=[1, 2], state=LinkState(codec.config)),
                            state=LinkState(codec.config)) for a in (x, later)]  # fmt: skip
    assert not torch.equal(decoded[0][:, :-1], decoded[1][:, :-1])


def rotated_message():
    codec, send, recv = ends("acsgd2+ch+nr+rot+fs4")
    msg = codec.encode(torch.randn(2, 16, 4), sample_ids=[1, 2], state=send)
    assert msg.rotation == 1
    return codec, recv, msg


TAMPERS = {
    "unknown rotation": lambda m: setattr(m, "rotation", 2),
    "seed without rotation": lambda m: setattr(m, "rotation", 0) or setattr(m, "rotation_seed", 3),
    "group not a power of two": lambda m: setattr(m.quantized_full, "group_size", 12),
    "rotation without first sights": lambda m: m.ClearField("quantized_full"),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_misstated_rotation_is_refused_and_commits_nothing(tamper):
    codec, recv, msg = rotated_message()
    TAMPERS[tamper](msg)
    with pytest.raises(WireError):
        codec.decode(msg, state=recv)
    assert len(recv.buffers) == 0


def test_a_rotated_first_sight_on_a_codec_that_never_rotates_is_refused():
    _, _, msg = rotated_message()
    msg.codec = wire_pb2.AQSGD
    cfg = CodecConfig.parse("aqsgd2+fs4")
    with pytest.raises(WireError, match="never rotated"):
        make_codec(cfg).decode(msg, state=LinkState(cfg))


def test_labels_carry_the_first_sight_bits():
    cfg = CodecConfig.parse("acsgd2+ch+rot+fs4")
    assert cfg.first_sight_bits == 4 and cfg.rotation == "hadamard"
    assert cfg.label == "acsgd2+ch+rot+fs4" and CodecConfig.parse(cfg.label) == cfg
    assert CodecConfig.parse("acsgd2+ch").label == "acsgd2+ch"
    with pytest.raises(ValueError, match="first_sight_bits"):
        CodecConfig.parse("gradq2+fs4")
    with pytest.raises(ValueError, match="first_sight_bits"):
        CodecConfig.parse("acsgd2+fs5")


def test_a_sample_shape_the_link_does_not_buffer_is_refused_on_both_ends():
    codec, send, recv = ends("acsgd2+ch+nr+rot+fs4")
    codec.decode(codec.encode(torch.randn(2, 16, 4), sample_ids=[1, 2], state=send), state=recv)
    before = snapshot(send), snapshot(recv)
    with pytest.raises(ValueError, match="this link buffers"):
        codec.encode(torch.randn(1, 8, 8), sample_ids=[1], state=send)  # id 1 again, same numel, other shape
    other, other_send, _ = ends("acsgd2+ch+nr+rot+fs4")
    msg = other.encode(torch.randn(1, 8, 8), sample_ids=[1], state=other_send)
    with pytest.raises(WireError, match="this link buffers"):
        codec.decode(msg, state=recv)
    for (ids, rows), state in zip(before, (send, recv), strict=True):
        assert snapshot(state)[0] == ids and torch.equal(snapshot(state)[1], rows)


def test_the_first_sights_bench_measures_every_scheme():
    from swarm.bench.codec_first_sights import adaptive_quantize, first_sight_rows, synthetic_activations

    acts = synthetic_activations(n=1, shape=(1, 32, 16))
    rows = first_sight_rows({"synthetic": acts})
    schemes = {r["scheme"] for r in rows}
    assert {"acsgd2", "acsgd2+rot", "tern+rot", "bilevel+rot", "adaptive-2.5"} <= schemes
    assert all(0 <= r["rel_error"] < 1 and r["wire_bytes_per_element"] > 0 for r in rows)
    by = {r["scheme"]: r for r in rows}
    assert by["acsgd8+rot"]["rel_error"] < by["acsgd4+rot"]["rel_error"] < by["acsgd2+rot"]["rel_error"]
    g = torch.randn(64, 32)
    g[:8] *= 10
    y, bits, _ = adaptive_quantize(g, 2.5)
    assert float(bits.float().mean()) == 2.5 and (bits[:8] == 4).all()  # the loud rows get the wide codes
    assert float((y - g).norm()) < float((adaptive_quantize(g, 2.0)[0] - g).norm())
