"""Channel-wise groups (`group_layout="channel"`, `+ch`) in directq and aqsgd: round trips, the layout on the
wire, AQ-SGD buffers identical on both ends over many rounds, and malformed layouts refused with nothing
committed."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import BufferMissError, CodecConfig, LinkState, WireError, decoder_for, frame, make_codec
from swarm.compression import unframe as unframe_msg
from swarm.compression.layout import CHANNEL, FLAT, from_groups, to_groups
from swarm.proto import wire_pb2


def outlier_activation(b: int = 4, t: int = 32, d: int = 48, seed: int = 0) -> torch.Tensor:
    """An activation whose first three channels are 10x the rest, as a transformer's residual stream has."""
    x = torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed))
    x[..., :3] *= 10
    return x


def through_wire(msg: wire_pb2.TensorMessage) -> wire_pb2.TensorMessage:
    return unframe_msg(list(frame(msg, zstd_level=1, chunk_bytes=500)))


@pytest.mark.parametrize("shape", [(2, 5, 7), (3, 1, 9), (4, 32, 48), (2, 16, 8)])
def test_layout_permutation_round_trips(shape):
    x = torch.randn(shape)
    for layout in (FLAT, CHANNEL):
        g = to_groups(x, layout)
        assert g.is_contiguous()
        assert torch.equal(from_groups(g.flatten(), layout, shape), x)
    # channel: group j of sample b is channel j across the tokens
    g = to_groups(x, CHANNEL).view(-1, shape[1])
    assert torch.equal(g[1], x[0, :, 1])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_channel_directq_is_within_half_a_step_of_each_channel(bits):
    x = outlier_activation()
    cfg = CodecConfig.parse(f"directq{bits}+ch+nr")
    msg = through_wire(make_codec(cfg).encode(x))
    assert msg.group_layout == wire_pb2.GROUP_LAYOUT_CHANNEL and msg.quantized.group_size == x.shape[1]
    y = decoder_for(msg).decode(msg)  # the decoder's own config is flat: it decodes by the message
    assert y.shape == x.shape
    span = x.amax(1, keepdim=True) - x.amin(1, keepdim=True)  # per (sample, channel), across tokens
    step = span / (2**bits - 1)
    assert ((y - x).abs() <= step / 2 * 1.001 + 1e-6).all()


def test_channel_groups_stop_outlier_channels_inflating_the_others():
    x = outlier_activation()
    rest = (slice(None), slice(None), slice(3, None))
    errs = {}
    for label in ("directq2+nr", "directq2+ch+nr"):
        y = make_codec(CodecConfig.parse(label)).decode(make_codec(CodecConfig.parse(label)).encode(x))
        errs[label] = float((y[rest] - x[rest]).norm() / x[rest].norm())
    assert errs["directq2+ch+nr"] < errs["directq2+nr"] / 3


@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 4, 5), (1000,)])
def test_tensors_that_are_not_3d_travel_flat_and_say_so(shape):
    x = torch.randn(shape)
    cfg = CodecConfig.parse("directq4+ch", group_size=64)
    msg = make_codec(cfg).encode(x)
    assert msg.group_layout == wire_pb2.GROUP_LAYOUT_FLAT and msg.quantized.group_size == 64
    assert make_codec(cfg).decode(msg).shape == x.shape


def aqsgd_ends(label: str, **kw) -> tuple:
    cfg = CodecConfig.parse(label, seed=3, **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def buffers_of(state: LinkState) -> dict[int, torch.Tensor]:
    ids = sorted(state.buffers.ids())
    return dict(zip(ids, state.buffers.gather(state.buffers.lookup(ids)), strict=True))


def assert_same_buffers(a: LinkState, b: LinkState) -> None:
    ba, bb = buffers_of(a), buffers_of(b)
    assert ba.keys() == bb.keys()
    for k in ba:
        assert torch.equal(ba[k].view(torch.int16), bb[k].view(torch.int16)), k


@pytest.mark.parametrize("first_sight_bits", [16, 4])
@pytest.mark.parametrize("label", ["aqsgd2", "aqsgd2+ch", "aqsgd4+ch+nr", "aqsgd2+ch+sr"])
def test_aqsgd_buffers_stay_bit_identical_over_many_rounds(label, first_sight_bits):
    codec, send, recv = aqsgd_ends(label, first_sight_bits=first_sight_bits, buffer_dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)
    acts = {i: outlier_activation(1, 24, 40, seed=i)[0] for i in range(12)}
    for r in range(20):
        ids = sorted(torch.randperm(12, generator=gen)[:5].tolist())  # a mix of new and seen samples
        for i in ids:
            acts[i] = acts[i] + 0.05 * torch.randn(acts[i].shape, generator=gen)
        x = torch.stack([acts[i] for i in ids])
        msg = through_wire(codec.encode(x, sample_ids=ids, state=send))
        want = wire_pb2.GROUP_LAYOUT_CHANNEL if "+ch" in label else wire_pb2.GROUP_LAYOUT_FLAT
        assert msg.group_layout == want
        y = codec.decode(msg, state=recv)
        assert_same_buffers(send, recv)
        assert torch.equal(y.to(recv.buffers.dtype), torch.stack([buffers_of(recv)[i] for i in ids])), r
    assert float((y.float() - x).norm() / x.norm()) < 0.1


def test_aqsgd_channel_with_an_odd_token_count_uses_the_reference_path_and_stays_identical():
    codec, send, recv = aqsgd_ends("aqsgd2+ch")
    x = torch.randn(3, 5, 7)
    for k in range(4):
        msg = codec.encode(x + 0.1 * k, sample_ids=[7, 8, 9], state=send)
        assert msg.quantized.group_size == 5 or k == 0
        codec.decode(through_wire(msg), state=recv)
        assert_same_buffers(send, recv)


def delta_message(label: str = "aqsgd2+ch"):
    """Ends that have exchanged one round, and the next (delta) message, not yet decoded."""
    codec, send, recv = aqsgd_ends(label)
    x = outlier_activation(3, 16, 24)
    codec.decode(codec.encode(x, sample_ids=[1, 2, 3], state=send), state=recv)
    msg = codec.encode(x + 0.1, sample_ids=[1, 2, 3], state=send)
    return codec, recv, msg


@pytest.mark.parametrize(
    "tamper, error",
    [
        (lambda m: setattr(m, "group_layout", 7), WireError),  # an unknown layout
        (lambda m: setattr(m.quantized, "group_size", 8), WireError),  # channel groups that are not the tokens
        (lambda m: setattr(m, "group_layout", wire_pb2.GROUP_LAYOUT_FLAT), BufferMissError),  # drift by digest
    ],
)
def test_a_malformed_layout_is_refused_with_nothing_committed(tamper, error):
    codec, recv, msg = delta_message()
    before = buffers_of(recv)
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    tamper(bad)
    with pytest.raises(error):
        codec.decode(through_wire(bad), state=recv)
    after = buffers_of(recv)
    assert all(torch.equal(before[k], after[k]) for k in before)
    codec.decode(msg, state=recv)  # the genuine message still applies


def test_a_channel_layout_on_a_flat_message_is_refused():
    codec, recv, msg = delta_message("aqsgd2")
    msg.group_layout = wire_pb2.GROUP_LAYOUT_CHANNEL  # group_size is 256, not the 16 tokens
    with pytest.raises(WireError, match="group_layout"):
        codec.decode(msg, state=recv)
    directq = make_codec(CodecConfig.parse("directq2"))
    flat = directq.encode(torch.randn(40, 50))
    flat.group_layout = wire_pb2.GROUP_LAYOUT_CHANNEL  # a 2-D tensor cannot be channel-grouped
    with pytest.raises(WireError, match="group_layout"):
        directq.decode(flat)


def test_labels_round_trip_the_layout():
    cfg = CodecConfig.parse("aqsgd2+ch+nr")
    assert cfg.group_layout == "channel" and not cfg.stochastic and cfg.label == "aqsgd2+ch"
