"""First sights in the deltas' own sub-2-bit code (`tern+fsd`, `bilevel+fsd`): both ends buffer what the
receiver decoded, bit for bit; the error and the bytes stay within stated bounds; a later visit is a delta against
it; a malformed first sight is refused whole, by the codec and, on a stage, naming the peer that sent it."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.codec_aqsgd import BufferDriftError
from swarm.net.stream import tensor_items
from swarm.proto import wire_pb2
from swarm.runtime.budget import StageBudget
from tests.unit.runtime.test_admission import Stages, refused

LABELS = ["tern+ch+fsd", "tern+ch+r50+fsd", "bilevel+ch+fsd", "tern+fsd"]


def ends(label: str, **kw):
    cfg = CodecConfig.parse(label, seed=5, **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def snapshot(state):
    ids = sorted(state.buffers.ids())
    return ids, state.buffers.gather(state.buffers.lookup(ids)).clone()


def activations(gen, n: int, tokens: int = 32, hidden: int = 16) -> torch.Tensor:
    """Residual-stream-like rows: two loud channels."""
    x = torch.randn(n, tokens, hidden, generator=gen)
    x[:, :, :2] *= 8
    return x


def wire_bytes(msg) -> int:
    return sum(len(c.data) for c in frame(msg))


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("tokens, hidden", [(32, 16), (15, 7), (1, 1)])  # 7 x 15: padding in the last code byte
def test_buffers_stay_bit_identical_and_first_sights_travel_in_the_deltas_code(label, tokens, hidden):
    codec, send, recv = ends(label, group_size=32)
    gen = torch.Generator().manual_seed(0)
    acts = {i: activations(gen, 1, tokens, hidden)[0] for i in range(12)}
    firsts = 0
    for _ in range(12):
        ids = sorted(torch.randperm(12, generator=gen)[:4].tolist())
        x = torch.stack([acts[i] for i in ids])
        msg = unframe(list(frame(codec.encode(x, sample_ids=ids, state=send), chunk_bytes=300)))
        if not all(msg.sample_is_delta):
            firsts += 1
            assert not msg.raw and msg.quantized_full.bits == codec.wire_code_bits  # never the 16-bit buffer dtype
        out = decoder_for(msg).decode(msg, state=recv)
        (a_ids, a), (b_ids, b) = snapshot(send), snapshot(recv)
        assert a_ids == b_ids and torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert torch.equal(out, recv.buffers.gather(recv.buffers.lookup(ids)).float())
    assert firsts > 0


@pytest.mark.parametrize(
    "label, bound, smaller_than",
    # relative error of one first sight (the MSE-optimal ternary code of a Gaussian is 0.44; 1 bit on two levels
    # 0.60), and fewer zstd-framed bytes than acsgd's 2-bit grid sends for it
    [("tern+ch+fsd", 0.50, "acsgd2+ch+nr+fs2"), ("bilevel+ch+fsd", 0.65, "tern+ch+fsd")],
)
def test_a_first_sights_error_and_bytes_are_bounded(label, bound, smaller_than):
    x = activations(torch.Generator().manual_seed(2), 4, 128, 64)
    got = {}
    for name in (label, smaller_than):
        codec, send, recv = ends(name)
        msg = codec.encode(x, sample_ids=[1, 2, 3, 4], state=send)
        y = codec.decode(msg, state=recv)
        got[name] = float((y - x).norm() / x.norm()), wire_bytes(msg)
    assert got[label][0] < bound, got
    assert got[label][1] < got[smaller_than][1], got


def test_zeros_and_a_lone_loud_value_decode_exactly_enough():
    codec, send, recv = ends("tern+ch+fsd")
    x = torch.zeros(2, 8, 4)
    assert torch.equal(codec.decode(codec.encode(x, sample_ids=[1, 2], state=send), state=recv), x)
    x = torch.zeros(1, 8, 4)
    x[0, 3, 1] = 60000.0  # one nonzero value in its channel group: ternary sends it exactly (fp16 scale)
    y = codec.decode(codec.encode(x, sample_ids=[3], state=send), state=recv)
    assert torch.equal(y, x)


def test_the_encoder_refuses_nan_and_inf():
    codec, send, _ = ends("tern+ch+fsd")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            codec.encode(torch.full((1, 4, 4), bad), sample_ids=[0], state=send)
    assert len(send.buffers) == 0


def test_a_revisit_is_a_delta_against_what_the_receiver_decoded():
    codec, send, recv = ends("tern+ch+fsd")
    x = activations(torch.Generator().manual_seed(1), 3)
    first = codec.decode(codec.encode(x, sample_ids=[4, 5, 6], state=send), state=recv)
    assert torch.equal(send.buffers.gather(send.buffers.lookup([4, 5, 6])), first.half())
    again = codec.encode(x, sample_ids=[4, 5, 6], state=send)
    assert list(again.sample_is_delta) == [True] * 3 and not again.HasField("quantized_full")
    second = codec.decode(again, state=recv)
    assert float((second - x).norm()) < float((first - x).norm())  # the delta carries the first sight's error


def test_a_receiver_without_fsd_decodes_either_kind_of_first_sight():
    """The message says how its first sights travel (`quantized_full.bits`): a link end configured `tern+ch`
    decodes a `+fsd` neighbour's, and a `+fsd` end decodes acsgd-grid first sights (`+fs4`)."""
    x = activations(torch.Generator().manual_seed(4), 2)
    for sender, receiver in (("tern+ch+fsd", "tern+ch"), ("tern+ch+fs4", "tern+ch+fsd")):
        codec, send, _ = ends(sender)
        _, _, recv = ends(receiver)
        msg = codec.encode(x, sample_ids=[1, 2], state=send)
        out = make_codec(CodecConfig.parse(receiver)).decode(msg, state=recv)
        assert torch.equal(out.half(), snapshot(send)[1])


def fp16_bytes(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float16).numpy().tobytes()


TAMPERS = {
    "nan scale": lambda q: setattr(q, "scales", fp16_bytes(float("nan")) + q.scales[2:]),
    "negative scale": lambda q: setattr(q, "scales", fp16_bytes(-1.0) + q.scales[2:]),
    "short scales": lambda q: setattr(q, "scales", q.scales[:-2]),
    "short payload": lambda q: setattr(q, "payload", q.payload[:-1]),
    "oversized payload": lambda q: setattr(q, "payload", q.payload * 1000),
    "bad code byte": lambda q: setattr(q, "payload", b"\xff" + q.payload[1:]),
    "mins": lambda q: setattr(q, "mins", b"\0" * 8),
    "fp32 scales": lambda q: setattr(q, "scale_dtype", wire_pb2.FLOAT32),
    "numel": lambda q: setattr(q, "numel", q.numel + 1),
    "group": lambda q: setattr(q, "group_size", 0),
    "huge group": lambda q: setattr(q, "group_size", 1 << 20),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_malformed_first_sight_is_refused_whole(tamper):
    codec, send, recv = ends("tern+ch+fsd", buffer_dtype="float16")
    x = activations(torch.Generator().manual_seed(5), 3, 15, 7)
    msg = codec.encode(x, sample_ids=[1, 2, 3], state=send)
    bad = wire_pb2.TensorMessage()
    bad.CopyFrom(msg)
    TAMPERS[tamper](bad.quantized_full)
    with pytest.raises(WireError, match="quantized_full|group_layout"):  # a channel group is a sample's tokens
        codec.decode(bad, state=recv)
    assert len(recv.buffers) == 0  # nothing committed
    codec.decode(msg, state=recv)  # the genuine message still lands
    assert torch.equal(snapshot(recv)[1], snapshot(send)[1])


def test_a_first_sight_altered_within_bounds_is_drift_and_commits_nothing():
    codec, send, recv = ends("tern+ch+fsd")
    msg = codec.encode(activations(torch.Generator().manual_seed(7), 2), sample_ids=[1, 2], state=send)
    q = msg.quantized_full
    q.scales = fp16_bytes(65504.0) * (len(q.scales) // 2)  # finite in fp16: only the digest tells
    with pytest.raises(BufferDriftError):
        codec.decode(msg, state=recv)
    assert len(recv.buffers) == 0
    msg.ClearField("buffer_digest")  # without the digest the bound still holds: every decoded value is finite
    out = codec.decode(msg, state=recv)
    assert bool(torch.isfinite(out).all())


def test_a_rotated_first_sight_in_the_deltas_code_is_refused():
    codec, send, recv = ends("tern+ch+fsd")
    msg = codec.encode(activations(torch.Generator().manual_seed(6), 2), sample_ids=[1, 2], state=send)
    msg.rotation, msg.rotation_seed = 1, 3
    with pytest.raises(WireError, match="never rotated"):
        codec.decode(msg, state=recv)
    assert len(recv.buffers) == 0


def test_labels_and_validation():
    cfg = CodecConfig.parse("tern+ch+r75+fsd")
    assert cfg.first_sight_delta_code and cfg.rate_percent == 75 and cfg.first_sight_bits == 16
    assert cfg.label == "tern+ch+r75+fsd" and CodecConfig.parse(cfg.label) == cfg
    assert CodecConfig.parse("bilevel+fsd").label == "bilevel+fsd"
    for bad, words in [
        ("acsgd2+ch+fsd", "first_sight_delta_code"),  # acsgd's deltas are 2+ bits: use +fsN
        ("gradq2+fsd", "first_sight_delta_code"),
        ("tern+ch+fs2+fsd", "not both"),
        ("tern+rot+fsd", "never rotated"),
    ]:
        with pytest.raises(ValueError, match=words):
            CodecConfig.parse(bad)


def test_a_neighbours_malformed_first_sight_is_refused_naming_it_and_changes_nothing():
    fw = CodecConfig.parse("tern+ch+fsd", seed=1)
    s = Stages(3, StageBudget(), fw=fw)
    assert s.legit_step() > 0
    buffers = s.hosts[1].links.forward_recv.buffers
    before = len(buffers)
    msg = make_codec(fw).encode(torch.randn(2, 16, 32), sample_ids=[1000, 1001], state=LinkState(fw))
    msg.quantized_full.payload = b"\xff" + msg.quantized_full.payload[1:]  # not five ternary codes
    error = refused(
        s.client(1).Forward,
        list(tensor_items(s.info(1, step=1), msg, 0, None)),
        code=grpc.StatusCode.INVALID_ARGUMENT,
        words=["quantized_full.payload", "invalid message from"],
    )
    assert "(not authenticated)" in error.details()  # no verifier here: the sender is named by its address
    assert "243" in error.details()
    assert s.hosts[1].open_step is None and len(buffers) == before
    assert s.legit_step() > 0  # the stage still trains
