"""zstd framing and chunking: round trips, the per-message zstd decision, and every bound on the way in."""

from __future__ import annotations

import os

import pytest
import torch
import zstandard

from swarm.compression import CodecConfig, Unframer, WireError, WireLimits, frame, make_codec, unframe
from swarm.proto import wire_pb2


def message(x: torch.Tensor, name: str = "fp32") -> wire_pb2.TensorMessage:
    return make_codec(CodecConfig(name=name)).encode(x)


def test_chunks_are_bounded_and_first_carries_the_header():
    msg = message(torch.randn(100_000))
    chunks = list(frame(msg, zstd_level=0, chunk_bytes=64 * 1024))
    assert len(chunks) > 5
    assert chunks[0].HasField("header") and not any(c.HasField("header") for c in chunks[1:])
    assert all(len(c.data) <= 64 * 1024 for c in chunks)
    assert list(chunks[0].header.shape) == [100_000]
    assert unframe(chunks) == msg


def test_zstd_used_only_when_it_shrinks_within_the_ratio_receivers_accept():
    compressible = message(torch.randn(50_000).half().float())  # fp32 with zero low mantissas: ~1.5x
    random = wire_pb2.TensorMessage(shape=[50_000], codec=wire_pb2.FP16, raw=os.urandom(100_000))
    assert next(frame(compressible, zstd_level=3)).header.compression == wire_pb2.ZSTD
    assert next(frame(random, zstd_level=3)).header.compression == wire_pb2.COMPRESSION_NONE
    assert unframe(frame(compressible, zstd_level=3)) == compressible
    # all zeros shrinks a thousandfold: sent plain, or receivers would refuse it as a decompression bomb
    zeros = message(torch.zeros(500_000))
    assert next(frame(zeros, zstd_level=3)).header.compression == wire_pb2.COMPRESSION_NONE
    assert unframe(frame(zeros, zstd_level=3)) == zeros
    small = message(torch.zeros(1000))  # within the slack: compressed
    assert next(frame(small, zstd_level=3)).header.compression == wire_pb2.ZSTD
    assert unframe(frame(small, zstd_level=3)) == small


def test_a_decompression_bomb_is_refused_from_its_header_before_its_body():
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(16 << 20))  # 16 MiB of zeros in a few hundred bytes
    header = wire_pb2.FrameHeader(
        compression=wire_pb2.ZSTD, body_bytes=len(bomb) + 1, raw_body_bytes=16 << 20, codec=wire_pb2.FP32
    )
    unframer = Unframer()
    with pytest.raises(WireError, match="header.raw_body_bytes"):
        unframer.feed(wire_pb2.Chunk(header=header, data=bomb[:1000]))
    assert unframer.received_bytes == 0
    # the limit is the ratio times the body, plus the slack: just under passes the header check
    limits = WireLimits(max_zstd_ratio=4, zstd_slack_bytes=100)
    ok = wire_pb2.FrameHeader(compression=wire_pb2.ZSTD, body_bytes=1000, raw_body_bytes=4100, codec=wire_pb2.FP32)
    assert Unframer(limits).feed(wire_pb2.Chunk(header=ok, data=b"x" * 10)) is None
    ok.raw_body_bytes += 1
    with pytest.raises(WireError, match="ratio"):
        Unframer(limits).feed(wire_pb2.Chunk(header=ok, data=b"x" * 10))


def test_oversized_message_rejected_from_its_header():
    chunks = frame(message(torch.randn(10_000)), zstd_level=0)
    unframer = Unframer(WireLimits(max_message_bytes=1000))
    with pytest.raises(WireError, match="body_bytes"):
        unframer.feed(next(chunks))


def test_oversized_chunk_and_bad_sequences_rejected():
    chunks = list(frame(message(torch.randn(10_000)), zstd_level=0, chunk_bytes=4096))
    with pytest.raises(WireError, match="chunk limit"):
        Unframer(WireLimits(max_chunk_bytes=100)).feed(chunks[0])
    with pytest.raises(WireError, match="first chunk"):
        Unframer().feed(chunks[1])
    with pytest.raises(WireError, match="ended"):
        unframe(chunks[:-1])
    with pytest.raises(WireError, match="middle"):
        u = Unframer()
        u.feed(chunks[0])
        u.feed(chunks[0])


def test_corrupt_bodies_are_clear_errors():
    msg = message(torch.zeros(10_000))
    chunks = list(frame(msg, zstd_level=3))
    bad = wire_pb2.Chunk()
    bad.CopyFrom(chunks[0])
    bad.data = b"\x28\xb5\x2f\xfd" + b"garbage" * 10
    bad.header.body_bytes = len(bad.data)
    with pytest.raises(WireError, match="zstd"):
        unframe([bad])
    raw = wire_pb2.Chunk(
        header=wire_pb2.FrameHeader(body_bytes=5, raw_body_bytes=5, codec=wire_pb2.FP32), data=b"\xff" * 5
    )
    with pytest.raises(WireError, match="body"):
        unframe([raw])


def test_header_must_match_body():
    msg = message(torch.randn(10))
    chunks = list(frame(msg, zstd_level=0))
    chunks[0].header.shape[:] = [5, 2]
    with pytest.raises(WireError, match="header"):
        unframe(chunks)


def test_unknown_enums_in_header_rejected():
    chunks = list(frame(message(torch.randn(10)), zstd_level=0))
    chunks[0].header.codec = 99
    with pytest.raises(WireError, match="codec"):
        unframe(chunks)


def test_zstd_policy_compresses_only_where_it_pays():
    from swarm.compression import ZstdPolicy

    policy = ZstdPolicy(level=1, probe_every=1000)
    policy.observe(1_000_000, 500_000, 0.005)  # halves the data at ~150 MB/s
    for _ in range(20):
        policy.observe(1_000_000, 500_000, 0.005)
    assert policy.level_for(1.25e6) == 1  # 10 Mbit/s: saving half the bytes saves far more time than zstd costs
    assert policy.level_for(1.25e9) == 0  # 10 Gbit/s: zstd would cost more than it saves
    assert policy.level_for(None) == 0  # unshaped loopback
    for _ in range(40):
        policy.observe(1_000_000, 1_000_100, 0.005)  # incompressible data
    assert policy.level_for(1.25e6) == 0
    assert ZstdPolicy(level=0).level_for(1.0) == 0


def test_zstd_policy_probes_while_off():
    from swarm.compression import ZstdPolicy

    policy = ZstdPolicy(level=3, probe_every=4)
    levels = [policy.level_for(None) for _ in range(8)]
    assert levels.count(3) == 2 and levels.count(0) == 6
