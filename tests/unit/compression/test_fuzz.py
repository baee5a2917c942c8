"""Property-based fuzzing of everything that reads bytes from the network: the unframer and every codec's decode.

Property: a finite tensor of the declared shape, or WireError / BufferMissError; never another exception,
never a hang, and a decode that raises leaves its LinkState as it was.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.compression import (
    REGISTRY,
    BufferMissError,
    CodecConfig,
    LinkState,
    Unframer,
    WireError,
    decoder_for,
    frame,
    make_codec,
)
from swarm.compression.codecs import BY_NAME
from swarm.proto import wire_pb2

FUZZ = settings(
    max_examples=int(os.environ.get("SWARM_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
ALLOWED = (WireError, BufferMissError)
SAMPLE_SHAPE = (3, 40)
"""every aqsgd message here buffers samples of this shape"""

U64 = st.one_of(
    st.sampled_from([0, 1, 2, 255, 1 << 20, 1 << 31, 1 << 32, (1 << 63) - 1, (1 << 64) - 1]),
    st.integers(0, (1 << 64) - 1),
)
ENUM = st.one_of(st.integers(-3, 10), st.sampled_from([-(1 << 31), (1 << 31) - 1]))
DTYPE = st.one_of(st.sampled_from([wire_pb2.FLOAT32, wire_pb2.FLOAT16, wire_pb2.BFLOAT16]), ENUM)
"""mostly a valid dtype, so that decoding goes past the first check"""


def config(name: str, **kw) -> CodecConfig:
    cls = BY_NAME[name]
    return CodecConfig(name=name, bits=2 if cls.quantized else 4, group_size=16, seed=1, **kw)


def aqsgd_states() -> tuple[LinkState, LinkState]:
    """A sender and a receiver that have both seen samples 0..5 once."""
    cfg = config("aqsgd")
    send, recv = LinkState(cfg), LinkState(cfg)
    codec = make_codec(cfg)
    codec.decode(codec.encode(torch.randn(6, *SAMPLE_SHAPE), sample_ids=list(range(6)), state=send), state=recv)
    return send, recv


def real_messages() -> list[wire_pb2.TensorMessage]:
    """One genuine message per codec (aqsgd: deltas and first sights, every first-sight encoding)."""
    gen = torch.Generator().manual_seed(0)
    msgs = []
    for name in BY_NAME:
        if BY_NAME[name].uses_buffers:  # aqsgd and acsgd: the same buffer protocol
            for bits in (16, 8):
                send, _ = aqsgd_states()
                cfg = config(name, first_sight_bits=bits)
                x = torch.randn(4, *SAMPLE_SHAPE, generator=gen)
                msgs.append(make_codec(cfg).encode(x, sample_ids=[4, 9, 1, 7], state=send))
            if BY_NAME[name].subspace_first_sights:  # acsgd's `+fslR`: first sights as two factors
                send, _ = aqsgd_states()
                cfg = config(name, first_sight_rank=4, subspace_step_percent=20)
                x = torch.randn(4, *SAMPLE_SHAPE, generator=gen)
                msgs.append(make_codec(cfg).encode(x, sample_ids=[4, 9, 1, 7], state=send))
        else:
            msgs.append(make_codec(config(name)).encode(torch.randn(4, *SAMPLE_SHAPE, generator=gen)))
        if BY_NAME[name].ranked:  # lowrank, mlowrank: the factors in int8 and in 4-bit nibbles too
            for factor_bits in (8, 4):
                cfg = config(name, factor_bits=factor_bits)
                msgs.append(make_codec(cfg).encode(torch.randn(4, *SAMPLE_SHAPE, generator=gen)))
    return msgs


REAL = real_messages()


def state_snapshot(state: LinkState | None):
    if state is None:
        return None
    store = state.buffers
    held = {} if store is None else {s: store.get(s).clone() for s in store.ids()}
    return held, None if state.residual is None else state.residual.clone(), state._draws


def same_snapshot(a, b) -> bool:
    if a is None:
        return b is None
    (ha, ra, da), (hb, rb, db) = a, b
    return (
        ha.keys() == hb.keys()
        and all(torch.equal(ha[k], hb[k]) for k in ha)
        and da == db
        and ((ra is None and rb is None) or (ra is not None and rb is not None and torch.equal(ra, rb)))
    )


def check_decode(msg: wire_pb2.TensorMessage, with_state: bool) -> None:
    """The property, for one message."""
    try:
        codec = decoder_for(msg)
    except WireError:
        return
    state = None
    if with_state or codec.uses_buffers:
        state = aqsgd_states()[1] if codec.uses_buffers else LinkState(codec.config)
    before = state_snapshot(state)
    try:
        y = codec.decode(msg, state=state)
    except ALLOWED:
        assert same_snapshot(before, state_snapshot(state)), "a refused message changed the LinkState"
        return
    assert list(y.shape) == list(msg.shape)
    assert y.numel() == 0 or bool(torch.isfinite(y).all())


def quantized_strategy() -> st.SearchStrategy[wire_pb2.Quantized]:
    return st.builds(
        wire_pb2.Quantized,
        bits=st.sampled_from([0, 1, 2, 3, 4, 5, 8, 9, 1 << 31]),
        group_size=st.sampled_from([0, 1, 2, 16, 64, 65536, 65537, (1 << 32) - 1]),
        numel=st.one_of(st.integers(0, 600), U64),
        scales=st.binary(max_size=256),
        mins=st.binary(max_size=256),
        payload=st.binary(max_size=512),
        scale_dtype=DTYPE,
    )


def message_strategy() -> st.SearchStrategy[wire_pb2.TensorMessage]:
    dims = st.one_of(st.integers(0, 8), st.sampled_from([40, 120, 1 << 30, (1 << 64) - 1]))
    return st.builds(
        _message,
        shape=st.lists(dims, max_size=4),
        dtype=DTYPE,
        codec=st.one_of(st.sampled_from(sorted(REGISTRY)), st.sampled_from(sorted(REGISTRY)), ENUM),
        sample_ids=st.lists(st.integers(-3, 12) | st.sampled_from([-(1 << 63), (1 << 63) - 1]), max_size=6),
        sample_is_delta=st.lists(st.booleans(), max_size=6),
        quantized=st.none() | quantized_strategy(),
        raw_dtype=DTYPE,
        raw=st.binary(max_size=1024),
        quantized_full=st.none() | quantized_strategy(),
        digest=st.none() | st.integers(0, (1 << 32) - 1),
    )


def _message(shape, dtype, codec, sample_ids, sample_is_delta, quantized, raw_dtype, raw, quantized_full, digest):
    msg = wire_pb2.TensorMessage(
        shape=shape, dtype=dtype, codec=codec, sample_ids=sample_ids, sample_is_delta=sample_is_delta,
        raw_dtype=raw_dtype, raw=raw,
    )  # fmt: skip
    if quantized is not None:
        msg.quantized.CopyFrom(quantized)
    if quantized_full is not None:
        msg.quantized_full.CopyFrom(quantized_full)
    if digest is not None:
        msg.buffer_digest = digest
    return msg


@FUZZ
@given(msg=message_strategy(), with_state=st.booleans())
def test_every_codec_decodes_random_messages_or_refuses_them(msg, with_state):
    check_decode(msg, with_state)


def flip(data: bytes, position: int, bit: int) -> bytes:
    if not data:
        return data
    i = position % len(data)
    return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :]


@st.composite
def mutated_messages(draw) -> wire_pb2.TensorMessage:
    msg = wire_pb2.TensorMessage()
    msg.CopyFrom(draw(st.sampled_from(REAL)))
    for _ in range(draw(st.integers(1, 3))):
        what = draw(
            st.sampled_from(["bytes", "random", "truncate", "shape", "ids", "flags", "quantized", "dtype", "digest"])
        )
        sub = draw(st.sampled_from(["quantized", "quantized_full"]))
        q = getattr(msg, sub)
        if what == "bytes":  # a bit flip in one of the byte fields
            field = draw(st.sampled_from(["raw", "scales", "mins", "payload"]))
            target = msg if field == "raw" else q
            setattr(target, field, flip(getattr(target, field), draw(st.integers(0, 1 << 16)), draw(st.integers(0, 7))))
        elif what == "random":  # random content of the right length: past every length check
            field = draw(st.sampled_from(["raw", "scales", "mins", "payload"]))
            target = msg if field == "raw" else q
            n = len(getattr(target, field))
            setattr(target, field, draw(st.binary(min_size=n, max_size=n)))
        elif what == "truncate":
            field = draw(st.sampled_from(["raw", "scales", "mins", "payload"]))
            target = msg if field == "raw" else q
            setattr(target, field, getattr(target, field)[: draw(st.integers(0, 64))])
        elif what == "shape":
            i = draw(st.integers(0, max(0, len(msg.shape) - 1)))
            shape = list(msg.shape) or [1]
            shape[min(i, len(shape) - 1)] = draw(st.integers(0, 9) | U64)
            msg.shape[:] = shape
        elif what == "ids":
            ids = list(msg.sample_ids)
            if ids:
                ids[draw(st.integers(0, len(ids) - 1))] = draw(st.integers(-2, 12))
            msg.sample_ids[:] = ids
        elif what == "flags":
            msg.sample_is_delta[:] = draw(st.lists(st.booleans(), max_size=5))
        elif what == "quantized":
            field = draw(st.sampled_from(["bits", "group_size", "numel", "scale_dtype"]))
            value = draw(st.integers(0, 1 << 16) | U64) if field != "scale_dtype" else draw(ENUM)
            try:
                setattr(q, field, value)
            except ValueError:  # out of the field's integer range: a sender could not have sent it
                pass
        elif what == "dtype":
            setattr(msg, draw(st.sampled_from(["dtype", "raw_dtype", "codec"])), draw(ENUM))
        else:
            scale = draw(st.sampled_from([1e30, 1e38, 65504.0, 1e5, -1e30, float("nan"), float("inf")]))
            n = len(q.scales) // 4
            if draw(st.booleans()):
                q.scales = torch.full((n,), scale).numpy().tobytes()
            else:
                q.mins = torch.full((n,), scale).numpy().tobytes()
    return msg


@FUZZ
@given(msg=mutated_messages(), with_state=st.booleans())
def test_every_codec_decodes_mutated_real_messages_or_refuses_them(msg, with_state):
    check_decode(msg, with_state)


def test_the_real_messages_decode():
    for msg in REAL:
        check_decode(msg, True)
    assert {m.codec for m in REAL} == set(REGISTRY)


def test_an_empty_tensor_with_a_huge_dimension_is_refused():  # found by the fuzzer: torch.view overflowed
    msg = wire_pb2.TensorMessage(shape=[0, (1 << 64) - 1], dtype=wire_pb2.FLOAT32, codec=wire_pb2.FP32)
    msg.raw_dtype = wire_pb2.FLOAT32
    with pytest.raises(WireError, match="shape"):
        decoder_for(msg).decode(msg)
    header = wire_pb2.FrameHeader(codec=wire_pb2.FP32, shape=[0, 1 << 40])
    with pytest.raises(WireError, match="header.shape"):
        Unframer().feed(wire_pb2.Chunk(header=header))


def test_a_scalar_message_decodes_to_a_scalar():  # found by the fuzzer in CI: view(*[]) is a TypeError
    msg = wire_pb2.TensorMessage(shape=[], dtype=wire_pb2.FLOAT32, codec=wire_pb2.FP16)
    msg.raw_dtype, msg.raw = wire_pb2.FLOAT16, torch.tensor([1.5], dtype=torch.float16).numpy().tobytes()
    out = decoder_for(msg).decode(msg)
    assert out.shape == () and out.dtype == torch.float32 and float(out) == 1.5


def test_aqsgd_without_a_link_state_is_a_caller_error():
    msg = next(m for m in REAL if m.codec == wire_pb2.AQSGD)
    with pytest.raises(ValueError, match="LinkState"):
        decoder_for(msg).decode(msg)


# ---- the unframer -----------------------------------------------------------------------------------------


def feed_all(chunks: list[wire_pb2.Chunk]) -> None:
    """Feeds chunks until the message completes or is refused; a completed message is then decoded."""
    unframer = Unframer()
    for chunk in chunks:
        try:
            msg = unframer.feed(chunk)
        except WireError:
            return
        if msg is not None:
            check_decode(msg, with_state=True)
            return


header_strategy = st.builds(
    wire_pb2.FrameHeader,
    compression=ENUM,
    body_bytes=st.integers(0, 2048) | U64,
    raw_body_bytes=st.integers(0, 1 << 16) | U64,
    codec=ENUM,
    shape=st.lists(st.integers(0, 64) | U64, max_size=9),
    dtype=ENUM,
)


@FUZZ
@given(
    chunks=st.lists(
        st.builds(
            lambda header, data: wire_pb2.Chunk(header=header, data=data) if header else wire_pb2.Chunk(data=data),
            header=st.none() | header_strategy,
            data=st.binary(max_size=2048),
        ),
        max_size=5,
    )
)
def test_the_unframer_takes_random_chunks_or_refuses_them(chunks):
    feed_all(chunks)


# float payloads of at least SPLIT_MIN_BYTES travel split by byte significance (ZSTD_SPLIT): two of those too
SPLIT = [make_codec(config(name)).encode(torch.randn(24, *SAMPLE_SHAPE)) for name in ("fp32", "bf16")]
FRAMED = [list(frame(m, zstd_level=level, chunk_bytes=200)) for m in REAL + SPLIT for level in (0, 3)]
assert sum(f[0].header.compression == wire_pb2.ZSTD_SPLIT for f in FRAMED) == 2


@st.composite
def mutated_streams(draw) -> list[wire_pb2.Chunk]:
    chunks = []
    for c in draw(st.sampled_from(FRAMED)):
        copy = wire_pb2.Chunk()
        copy.CopyFrom(c)
        chunks.append(copy)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(chunks) - 1))
        what = draw(st.sampled_from(["flip", "truncate", "drop", "repeat", "header", "swap"]))
        if what == "flip":
            chunks[i].data = flip(chunks[i].data, draw(st.integers(0, 1 << 16)), draw(st.integers(0, 7)))
        elif what == "truncate":
            chunks[i].data = chunks[i].data[: draw(st.integers(0, len(chunks[i].data)))]
        elif what == "drop" and len(chunks) > 1:
            del chunks[i]
        elif what == "repeat":
            chunks.insert(i, chunks[i])
        elif what == "swap" and len(chunks) > 1:
            j = draw(st.integers(0, len(chunks) - 1))
            chunks[i], chunks[j] = chunks[j], chunks[i]
        elif what == "header":
            header = chunks[0].header
            field = draw(st.sampled_from(["compression", "body_bytes", "raw_body_bytes", "codec", "dtype", "shape"]))
            if field == "shape":
                header.shape[:] = draw(st.lists(st.integers(0, 64) | U64, max_size=9))
            elif field in ("compression", "codec", "dtype"):
                setattr(header, field, draw(ENUM))
            else:
                setattr(header, field, draw(st.integers(0, 1 << 20) | U64))
    return chunks


@FUZZ
@given(chunks=mutated_streams())
def test_the_unframer_takes_mutated_real_streams_or_refuses_them(chunks):
    feed_all(chunks)
