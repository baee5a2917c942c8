"""acsgd's subspace-coded first sights (`+fslR` with `+sN`): a sample's first sight travels in the top-R eigenbasis
of the message's first-sight rows, its later visits as deltas against what the receiver decoded. Both ends buffer
the same bits; correlated activations cost fewer bytes than 3-bit channel-scaled first sights at a lower error;
the labels and their validation; and a tampered or misplaced factor is refused naming its field, committing
nothing."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, WireError, decoder_for, frame, make_codec, unframe
from swarm.compression.subspace import energy_rank, subspace_basis
from swarm.proto import wire_pb2

SUBSPACE = "acsgd2+ch+nr+fsl8+s20"


def ends(label: str, **kw):
    cfg = CodecConfig.parse(label, seed=7, **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def residual_stream(gen, n: int, tokens: int = 32, hidden: int = 64, rank: int = 6) -> torch.Tensor:
    """[n, T, D] rows in a few loud shared directions, a quiet floor and a shared mean: a residual stream's shape."""
    loud = torch.randn(n * tokens, rank, generator=gen) * torch.linspace(4, 1, rank)
    mixing = torch.Generator().manual_seed(99)  # the directions are the model's: the same for every sample
    rows = loud @ torch.randn(rank, hidden, generator=mixing) + 0.05 * torch.randn(n * tokens, hidden, generator=gen)
    return (rows + torch.randn(hidden, generator=mixing)).view(n, tokens, hidden)


def same_buffers(send: LinkState, recv: LinkState) -> bool:
    a_ids, b_ids = sorted(send.buffers.ids()), sorted(recv.buffers.ids())
    a, b = (s.buffers.gather(s.buffers.lookup(a_ids)) for s in (send, recv))
    return a_ids == b_ids and torch.equal(a.view(torch.int16), b.view(torch.int16))


def rel(out: torch.Tensor, x: torch.Tensor) -> float:
    return float((out.float() - x).norm() / x.norm())


def test_labelled_parsed_and_validated():
    cfg = CodecConfig.parse("acsgd2+ch+nr+fsl32+s20")
    assert (cfg.first_sight_rank, cfg.subspace_step_percent, cfg.first_sight_bits) == (32, 20, 16)
    assert cfg.label == "acsgd2+ch+fsl32+s20" and CodecConfig.parse(cfg.label).first_sight_rank == 32


@pytest.mark.parametrize(
    "bad, match",
    [
        ("acsgd2+ch+fsl32", r"\+sN"),  # the step is never implied
        ("acsgd2+ch+fsl32+s20+fs3", "not both"),
        ("acsgd2+ch+fsl32+s20+fs3+clip", "not both"),
        ("acsgd2+rot+fsl32+s20", "never rotated"),
        ("acsgd2+ch+fsl65+s20", "1..64"),
        ("acsgd2+ch+fsl8+s1001", "1..1000"),
        ("aqsgd2+ch+fsl8+s20", "applies to acsgd"),
        ("gradq2+ef+fsl8+s20", "applies to acsgd"),
        ("acsgd2+s30", "ranked"),  # a step alone is still lowrank's
        # a rank that grows with the width (`+fslwN`)
        ("acsgd2+ch+fslw4", r"\+sN"),
        ("acsgd2+ch+fslw1025+s20", "1..1024"),
        ("aqsgd2+ch+fslw4+s20", "applies to acsgd"),
        # a rank grown to leave out at most a share of the energy (`+fsleN`)
        ("acsgd2+ch+fsle10+s20", r"give their rank"),
        ("acsgd2+ch+fsl8+fsle10000+s20", "1..9999"),
        # subspace-coded deltas (`+dslR`, test_deltas_subspace)
        ("acsgd2+ch+dsl16", r"\+sN"),
        ("acsgd2+ch+dsl65+s20", "1..64"),
        ("tern+ch+dsl16+s20", "delta_rank"),
        ("gradq2+ef+dsl16+s20", "delta_rank"),
    ],
)
def test_a_subspace_label_the_codec_cannot_send_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        CodecConfig.parse(bad)


@pytest.mark.parametrize("buffer_dtype", ["float16", "bfloat16"])
def test_buffers_stay_bit_identical_and_deltas_refine_the_first_sight(buffer_dtype):
    codec, send, recv = ends(SUBSPACE, buffer_dtype=buffer_dtype)
    gen = torch.Generator().manual_seed(0)
    acts = dict(enumerate(residual_stream(gen, 10)))
    first_err, later_err = {}, {}
    for step in range(16):
        ids = sorted(torch.randperm(10, generator=gen)[:4].tolist())
        x = torch.stack([acts[i] for i in ids])
        msg = unframe(list(frame(codec.encode(x, sample_ids=ids, state=send), chunk_bytes=700)))
        out = decoder_for(msg).decode(msg, state=recv)
        assert same_buffers(send, recv), f"step {step}"
        for row, (sid, is_delta) in enumerate(zip(ids, msg.sample_is_delta, strict=True)):
            (later_err if is_delta else first_err)[sid] = rel(out[row], acts[sid])
        if not all(msg.sample_is_delta):  # first sights present: they travel as factors, never raw
            assert msg.HasField("first_sight_basis") and not msg.raw
    assert len(first_err) == 10 and max(first_err.values()) < 0.05
    seen_twice = [s for s in later_err if s in first_err]
    assert seen_twice and sum(later_err[s] for s in seen_twice) < sum(first_err[s] for s in seen_twice)


def test_fewer_bytes_than_three_bit_first_sights_at_less_error():
    x = residual_stream(torch.Generator().manual_seed(1), 8)
    results = {}
    for label in (SUBSPACE, "acsgd2+ch+nr+fs3"):
        codec, send, recv = ends(label)
        chunks = list(frame(codec.encode(x, sample_ids=list(range(8)), state=send)))
        out = decoder_for(unframe(chunks)).decode(unframe(chunks), state=recv)
        results[label] = (sum(c.ByteSize() for c in chunks), rel(out, x))
    (sub_bytes, sub_err), (fs3_bytes, fs3_err) = results[SUBSPACE], results["acsgd2+ch+nr+fs3"]
    assert sub_bytes < fs3_bytes and sub_err < fs3_err / 2


@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 5, 24), (2, 40), (1, 7, 3)])
def test_odd_shapes_round_trip(shape):
    codec, send, recv = ends(SUBSPACE)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    ids = list(range(shape[0]))
    out = decoder_for(msg := codec.encode(x, sample_ids=ids, state=send)).decode(msg, state=recv)
    assert out.shape == x.shape and same_buffers(send, recv)
    width = shape[-1]
    if min(8, x.numel() // width, width) == min(x.numel() // width, width):  # full rank: only rounding's error,
        assert rel(out, x) < 1.5 * 0.20 / 12**0.5  # a uniform step of 20% of the rms errs by step / sqrt(12)


def first_sight_message(seed: int = 4) -> tuple[wire_pb2.TensorMessage, LinkState]:
    codec, send, recv = ends(SUBSPACE)
    x = residual_stream(torch.Generator().manual_seed(seed), 2, tokens=8, hidden=16)
    return codec.encode(x, sample_ids=[1, 2], state=send), recv


def tamper_scale_nan(msg):
    msg.first_sight_basis.scales = torch.full((8,), float("nan")).numpy().tobytes()


def tamper_code_minus_128(msg):
    payload = bytearray(msg.first_sight_basis.payload)
    payload[0] = 0x80
    msg.first_sight_basis.payload = bytes(payload)


def tamper_rank_mismatch(msg):
    msg.first_sight_basis.numel -= msg.first_sight_basis.group_size  # Q one column short of P's rank


def tamper_rows(msg):
    msg.quantized_full.group_size += 1  # P's columns no longer the message's first-sight rows


def tamper_huge(msg):
    msg.quantized_full.scales = torch.full((8,), 1e30).numpy().tobytes()  # decodes beyond fp16


def tamper_rotated(msg):
    msg.rotation, msg.rotation_seed = 1, 5


def tamper_no_coefficients(msg):
    msg.ClearField("quantized_full")


@pytest.mark.parametrize(
    "tamper, field",
    [
        (tamper_scale_nan, "first_sight_basis.scales"),
        (tamper_code_minus_128, "first_sight_basis.payload"),
        (tamper_rank_mismatch, "first_sight_basis.numel"),
        (tamper_rows, "quantized_full.group_size"),
        (tamper_huge, "quantized_full.scales"),
        (tamper_rotated, "rotation"),
        (tamper_no_coefficients, "first_sight_basis"),
    ],
)
def test_a_tampered_factor_is_refused_naming_its_field_and_commits_nothing(tamper, field):
    msg, recv = first_sight_message()
    tamper(msg)
    with pytest.raises(WireError) as refused:
        decoder_for(msg).decode(msg, state=recv)
    assert refused.value.field == field
    assert not list(recv.buffers.ids())


@pytest.mark.parametrize(
    "field, label",
    [  # acsgd's subspace-coded first sights' basis, and its subspace-coded deltas' (`+dslR`, test_deltas_subspace)
        ("first_sight_basis", "aqsgd2+ch+nr"),
        ("first_sight_basis", "directq4"),
        ("delta_basis", "tern+ch"),
        ("delta_basis", "directq4"),
    ],
)
def test_a_basis_on_another_codecs_message_is_refused(field, label):
    codec, send, recv = ends(label)
    x = torch.randn(2, 8, 16)
    msg = codec.encode(x, sample_ids=[1, 2], state=send) if codec.uses_buffers else codec.encode(x)
    getattr(msg, field).bits = 8
    with pytest.raises(WireError) as refused:
        decoder_for(msg).decode(msg, state=recv if codec.uses_buffers else None)
    assert refused.value.field == field


def test_a_receiver_decodes_by_the_message_whatever_its_own_first_sight_config():
    codec, send, _ = ends(SUBSPACE)
    _, _, plain_recv = ends("acsgd2+ch+nr")  # a peer configured with raw first sights still decodes these
    x = residual_stream(torch.Generator().manual_seed(5), 3)
    out = decoder_for(msg := codec.encode(x, sample_ids=[4, 5, 6], state=send)).decode(msg, state=plain_recv)
    assert same_buffers(send, plain_recv) and rel(out, x) < 0.05


@pytest.mark.parametrize("hidden, rank", [(32, 32), (128, 32), (256, 64), (512, 64)])  # 512 / 4: capped at 64
def test_a_rank_that_grows_with_the_width_sends_what_that_rank_sends(hidden, rank):
    grown, fixed = ends("acsgd2+ch+nr+fsl32+fslw4+dsl16+s20"), ends(f"acsgd2+ch+nr+fsl{rank}+dsl16+s20")
    gen = torch.Generator().manual_seed(8)
    x = residual_stream(gen, 2, tokens=16, hidden=hidden)
    for visit in range(2):  # a first sight, then a delta
        y = x + 0.1 * visit * residual_stream(gen, 2, tokens=16, hidden=hidden)
        a = grown[0].encode(y, sample_ids=[1, 2], state=grown[1])
        b = fixed[0].encode(y, sample_ids=[1, 2], state=fixed[1])
        assert a.SerializeToString() == b.SerializeToString()
    assert CodecConfig.parse("acsgd2+ch+nr+fsl32+fslw4+s20").label == "acsgd2+ch+fsl32+fslw4+s20"
    assert CodecConfig.parse("acsgd2+ch+nr+fslw4+s20").first_sight_rank == 0  # the width alone: 8 at hidden 32


def spread_stream(gen, n: int, directions: int, tokens: int = 32, hidden: int = 128) -> torch.Tensor:
    """[n, T, D] rows over `directions` orthogonal directions whose loudness falls linearly to a twentieth: a
    residual stream late in a long pass, whose energy has spread past a rank-8 basis."""
    axes = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(3))).Q[:directions]
    loud = torch.randn(n * tokens, directions, generator=gen) * torch.linspace(1, 0.05, directions)
    return (loud @ axes).view(n, tokens, hidden)


def sent_rank(msg: wire_pb2.TensorMessage) -> int:
    return msg.first_sight_basis.numel // msg.shape[-1]


def test_a_rank_grown_by_energy_leaves_out_at_most_that_share_and_any_receiver_decodes_it():
    gen = torch.Generator().manual_seed(11)
    x = spread_stream(gen, 4, directions=48)
    rows = x.reshape(-1, x.shape[-1]).double()
    values = torch.linalg.eigvalsh(rows.t() @ rows).flip(0)
    rank_8_error = rel(fixed_rank_round_trip(x, 8), x)
    for leave_out in (1, 10, 100, 1000):
        codec, send, _ = ends(f"acsgd2+ch+nr+fsl8+fsle{leave_out}+s20")
        _, _, plain_recv = ends("acsgd2+ch+nr")  # the rank is read from the message, never from the config
        msg = codec.encode(x, sample_ids=[1, 2, 3, 4], state=send)
        r = sent_rank(msg)
        out = decoder_for(msg).decode(msg, state=plain_recv)
        assert same_buffers(send, plain_recv)
        left_out = float(values[r:].sum() / values.sum())
        assert 8 <= r <= 48 and left_out <= leave_out / 10_000  # enough directions ...
        assert r == 8 or float(values[r - 1 :].sum() / values.sum()) > leave_out / 10_000  # ... and no more
        assert rel(out, x) < rank_8_error or r == 8


def fixed_rank_round_trip(x: torch.Tensor, rank: int) -> torch.Tensor:
    """What a receiver decodes of `x` sent as first sights at a fixed rank."""
    codec, send, recv = ends(f"acsgd2+ch+nr+fsl{rank}+s20")
    msg = codec.encode(x, sample_ids=list(range(len(x))), state=send)
    return decoder_for(msg).decode(msg, state=recv)


def test_a_rank_grown_by_energy_stays_at_the_least_where_that_already_holds_the_energy_and_stops_at_64():
    gen = torch.Generator().manual_seed(12)
    few = residual_stream(gen, 3, hidden=128)  # 6 loud directions and a quiet floor
    grown, grown_send, _ = ends("acsgd2+ch+nr+fsl16+fsle100+s20")
    fixed, fixed_send, _ = ends("acsgd2+ch+nr+fsl16+s20")
    a = grown.encode(few, sample_ids=[1, 2, 3], state=grown_send)
    assert a.SerializeToString() == fixed.encode(few, sample_ids=[1, 2, 3], state=fixed_send).SerializeToString()
    wide = spread_stream(gen, 4, directions=128)
    codec, send, recv = ends("acsgd2+ch+nr+fsl8+fsle1+s20")
    msg = codec.encode(wide, sample_ids=[1, 2, 3, 4], state=send)
    assert sent_rank(msg) == 64  # MAX_RANK: what a receiver accepts
    decoder_for(msg).decode(msg, state=recv)


def test_energy_rank_counts_what_each_rank_leaves_out():
    values = torch.tensor([50.0, 30.0, 15.0, 4.0, 1.0], dtype=torch.float64)
    assert energy_rank(values, 100.0, 1, 0.05) == 3  # ranks 1..3 leave out 50, 20, 5
    assert energy_rank(values, 100.0, 4, 0.05) == 4  # never below the least
    assert energy_rank(values, 100.0, 1, 0.001) == 5  # what is kept cannot hold more: all of them
    assert energy_rank(values, 200.0, 1, 0.05) == 5  # energy beyond the values (a randomized basis's tail)


def test_a_wide_message_grows_its_randomized_basis_the_same_way():
    gen = torch.Generator().manual_seed(13)
    x = spread_stream(gen, 1, directions=40, tokens=64, hidden=600)  # wider than EXACT_MAX_COLS
    rows = x.reshape(-1, 600)
    basis = subspace_basis(rows, 8, most=64, leave_out=0.01)
    exact = torch.linalg.eigvalsh(rows.double().t() @ rows.double()).flip(0)
    assert 8 < basis.shape[1] <= 40 and float(exact[basis.shape[1] :].sum() / exact.sum()) <= 0.0101
    torch.testing.assert_close(basis.t() @ basis, torch.eye(basis.shape[1]), atol=1e-4, rtol=0)
