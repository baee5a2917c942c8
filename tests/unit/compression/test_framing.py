"""zstd framing and chunking: round trips, the per-message zstd decision, and every bound on the way in."""

from __future__ import annotations

import os
import resource
import threading

import pytest
import torch
import zstandard

from swarm.compression import (
    CodecConfig,
    Unframer,
    WireError,
    WireLimits,
    ZstdPolicy,
    frame,
    framing,
    make_codec,
    unframe,
)
from swarm.compression.framing import decompress_at_most, split_float_bytes, zstd_compressor, zstd_decompressor
from swarm.net.stream import tensor_items, tokens_from_wire, tokens_to_wire
from swarm.peers.shaper import LinkShape, Shaper
from swarm.proto import stage_pb2, wire_pb2


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
    assert next(frame(compressible, zstd_level=3)).header.compression == wire_pb2.ZSTD_SPLIT  # a float payload
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
    bad.header.compression = wire_pb2.ZSTD  # (zeros travel split: one frame of the whole body here)
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
    # fp32 split on a 1000 Mbit/s link: 0.23 ms of link saved a 128 KiB message against 0.21 ms of both ends' CPU;
    # that CPU is the compute's, so zstd must save twice its CPU in link time (`margin`)
    fp32 = ZstdPolicy(level=1, probe_every=1000, saved_fraction=0.156, zstd_bytes_per_s=615e6)
    assert fp32.level_for(112e6) == 0 and fp32.level_for(12.5e6) == 1
    assert ZstdPolicy(level=1, probe_every=1000, saved_fraction=0.156, zstd_bytes_per_s=615e6, margin=1).level_for(90e6)


def test_zstd_policy_probes_while_off():
    policy = ZstdPolicy(level=3, probe_every=4)
    levels = [policy.level_for(None) for _ in range(8)]
    assert levels.count(3) == 2 and levels.count(0) == 6


# ---- float payloads split by byte significance (ZSTD_SPLIT) ----


def _activations(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values spread like the boundary's: a few orders of magnitude, both signs."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 128, 128, generator=g) * torch.rand(2, 128, 1, generator=g).mul(8).exp2()).to(dtype)


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_float_payload_travels_split_bit_for_bit_in_fewer_bytes_than_one_zstd_frame(name, dtype):
    msg = message(_activations(dtype).float(), name)
    chunks = list(frame(msg, zstd_level=1, chunk_bytes=16 << 10))
    assert chunks[0].header.compression == wire_pb2.ZSTD_SPLIT
    assert unframe(chunks) == msg  # lossless, and the receiver sees no raw_split
    split_bytes = sum(len(c.data) for c in chunks)
    whole = len(zstandard.ZstdCompressor(level=1).compress(msg.SerializeToString()))
    assert split_bytes < 0.95 * whole, (split_bytes, whole)


def test_special_floats_and_zeros_survive_the_split():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.4e38] * 1000)
    msg = wire_pb2.TensorMessage(
        shape=[x.numel()],
        codec=wire_pb2.FP32,
        dtype=wire_pb2.FLOAT32,
        raw_dtype=wire_pb2.FLOAT32,
        raw=x.numpy().tobytes(),
    )  # fmt: skip  (the fp32 codec itself refuses non-finite values; the framing must not care)
    chunks = list(frame(msg, zstd_level=1))
    assert chunks[0].header.compression == wire_pb2.ZSTD_SPLIT
    assert unframe(chunks).raw == msg.raw
    sparse = torch.zeros(20_000)
    sparse[:1000] = torch.randn(1000)
    msg = message(sparse)
    chunks = list(frame(msg, zstd_level=1))
    assert chunks[0].header.compression == wire_pb2.ZSTD_SPLIT
    assert sum(len(c.data) for c in chunks) < 0.1 * len(msg.raw)  # the low planes' zeros shrink too
    assert unframe(chunks) == msg


def test_small_or_non_float_payloads_go_as_one_zstd_frame():
    small = message(torch.randn(100))  # 400 bytes: two frames' headers would eat the saving
    assert next(frame(small, zstd_level=1)).header.compression in (wire_pb2.ZSTD, wire_pb2.COMPRESSION_NONE)
    codes = make_codec(CodecConfig.parse("directq4")).encode(torch.randn(64, 64))
    assert not codes.raw and next(frame(codes, zstd_level=1)).header.compression != wire_pb2.ZSTD_SPLIT
    assert next(frame(message(torch.randn(10_000)), zstd_level=0)).header.compression == wire_pb2.COMPRESSION_NONE


def _split_frame(msg: wire_pb2.TensorMessage, edit=None, header_edit=None) -> list[wire_pb2.Chunk]:
    """`msg` framed split, its split message edited by `edit` and its header by `header_edit`, as one chunk."""
    split = split_float_bytes(msg, 1)
    if edit is not None:
        edit(split)
    body = split.SerializeToString()
    header = wire_pb2.FrameHeader(
        compression=wire_pb2.ZSTD_SPLIT, body_bytes=len(body), raw_body_bytes=len(msg.SerializeToString()),
        codec=msg.codec, shape=msg.shape, dtype=msg.dtype,
    )  # fmt: skip
    if header_edit is not None:
        header_edit(header)
    return [wire_pb2.Chunk(header=header, data=body)]


def test_a_forged_split_is_refused_naming_its_field():
    msg = message(torch.randn(10_000))
    assert unframe(_split_frame(msg)) == msg

    def count(n):
        return lambda s: setattr(s.raw_split, "count", n)

    def bomb(s):  # a top byte plane that expands far beyond its count
        s.raw_split.top = zstandard.ZstdCompressor(level=3).compress(bytes(16 << 20))

    def not_zstd(s):
        s.raw_split.top = b"\x28\xb5\x2f\xfd garbage"

    def short_low(s):
        s.raw_split.low = s.raw_split.low[:-3]

    def packed_low_lie(s):
        s.raw_split.low_zstd = True

    def raw_beside(s):
        s.raw = b"\x00" * 8

    def no_float(s):
        s.raw_dtype = wire_pb2.DTYPE_UNSPECIFIED

    cases = {
        "raw_split.count": [count(0), count(1 << 40)],
        "raw_split.top": [count(10_001), bomb, not_zstd],  # count(10_001): more elements than the top plane holds
        "raw_split.low": [short_low, packed_low_lie],
        "raw": [raw_beside],
        "raw_split": [no_float, lambda s: s.ClearField("raw_split")],
    }
    for field, edits in cases.items():
        for edit in edits:
            with pytest.raises(WireError) as e:
                unframe(_split_frame(msg, edit))
            assert e.value.field.startswith(field), (field, edit, str(e.value))


def _plain(header: wire_pb2.FrameHeader) -> None:
    header.compression, header.raw_body_bytes = wire_pb2.COMPRESSION_NONE, header.body_bytes


def test_a_split_only_comes_with_its_header_and_within_the_ratio():
    msg = message(torch.randn(10_000))
    with pytest.raises(WireError, match="raw_split"):  # a split body under a plain header
        unframe(_split_frame(msg, header_edit=_plain))
    # a header claiming more raw bytes than the ratio allows is refused before the body, as for ZSTD
    limits = WireLimits(max_zstd_ratio=1, zstd_slack_bytes=0)
    chunk = _split_frame(msg)[0]
    with pytest.raises(WireError, match="ratio"):
        Unframer(limits).feed(chunk)


def test_the_zstd_decision_reads_a_measured_rate_where_nothing_shapes_the_link():
    msg = message(_activations())

    def compressed(shaper: Shaper) -> bool:
        policy = ZstdPolicy(level=1, probe_every=1 << 20)
        items = list(tensor_items(stage_pb2.CallInfo(), msg, 1, shaper, policy))
        return stage_pb2.StreamItem.FromString(items[0]).chunk.header.compression != wire_pb2.COMPRESSION_NONE

    kernel_shaped = Shaper(LinkShape())  # the kernel (or the ISP) shapes it: the application sees no rate
    assert kernel_shaped.known_rate() is None and not compressed(kernel_shaped)
    kernel_shaped.measured_bytes_per_s = 12.5e6  # the prober measured 100 Mbit/s
    assert kernel_shaped.known_rate() == 12.5e6 and compressed(kernel_shaped)
    fast = Shaper(LinkShape())
    fast.measured_bytes_per_s = 1.25e9  # 10 Gbit/s: compressing costs more than it saves
    assert not compressed(fast)
    # shaped by the application and measured slower than that: the slower one is what the link carries
    both = Shaper(LinkShape(rate_bytes_per_s=1.25e9))
    both.measured_bytes_per_s = 12.5e6
    assert both.known_rate() == 12.5e6 and compressed(both)


def test_the_zstd_decision_counts_compression_by_the_threads_cpu_time(monkeypatch):
    """A sender that waits for a core or for the GIL in the middle of compressing (zstd lets the GIL go) must not
    take zstd for slow: timed by the wall clock, a few-KB message looked far slower to compress than it is on a
    busy 2-core machine, and the policy left zstd off at 100 Mbit/s, where it saves a quarter of the bytes."""

    class Clock:  # every compression: 5 ms of waiting on the wall clock, 20 us of the thread's CPU
        wall = cpu = 0.0

        def perf_counter(self):
            self.wall += 0.0025
            return self.wall

        def thread_time(self):
            self.cpu += 10e-6
            return self.cpu

        monotonic = perf_counter

    monkeypatch.setattr(framing, "time", Clock())
    codes = make_codec(CodecConfig.parse("gradq2+rot+nr+cs+g256")).encode(torch.randn(2, 128, 128))
    policy = ZstdPolicy(level=1, probe_every=1 << 20)
    for _ in range(30):
        list(frame(codes, zstd_level=1, policy=policy))
    assert policy.saved_fraction > 0.1  # 2-bit codes: zstd saves about a quarter
    assert policy.zstd_bytes_per_s > 100e6
    assert policy.level_for(12.5e6) == 1  # 100 Mbit/s: it pays


def test_each_thread_compresses_with_its_own_reused_zstd_contexts():
    """A zstd context costs 19 us to make (a few-KB message 3 to compress), so each thread keeps one per level; two
    threads never share one (python-zstandard's contexts are not safe to use from two threads at once)."""

    assert zstd_compressor(1) is zstd_compressor(1) and zstd_compressor(3) is not zstd_compressor(1)
    assert zstd_decompressor() is zstd_decompressor()
    theirs, failures = [], []
    msgs = [message(torch.randn(4096) * (i + 1)) for i in range(4)]

    def work(i: int) -> None:
        theirs.append((zstd_compressor(1), zstd_decompressor()))
        for _ in range(50):
            if unframe(frame(msgs[i], zstd_level=1, chunk_bytes=4096)) != msgs[i]:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures and len({id(c) for c, _ in theirs}) == 4 and len({id(d) for _, d in theirs}) == 4
    assert zstd_compressor(1) not in [c for c, _ in theirs]


def test_a_zstd_frame_stating_more_than_its_bound_is_refused_before_it_is_decompressed():
    """python-zstandard's max_output_size bounds only a frame that does not state its size; one that states 256 MiB
    got 256 MiB allocated and filled (8 KB of frame) under a header whose raw size passed the ratio check."""

    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(256 << 20))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    header = wire_pb2.FrameHeader(
        compression=wire_pb2.ZSTD, body_bytes=len(bomb), raw_body_bytes=64 * len(bomb), codec=wire_pb2.FP32
    )  # within the ratio: the header alone does not give it away
    with pytest.raises(WireError, match="stating 268435456 bytes"):
        unframe([wire_pb2.Chunk(header=header, data=bomb)])
    batch = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    batch.zstd, batch.tokens = True, bomb
    with pytest.raises(WireError, match="tokens.tokens: a zstd frame stating"):
        tokens_from_wire(batch, 256, 16)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 128, f"the bomb was decompressed ({grown_mib:.0f} MiB)"
    # a frame that does not state its size is bounded as it is decompressed
    unstated = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(bytes(1 << 20))
    with pytest.raises(WireError, match="not a zstd frame of at most 1000"):
        decompress_at_most(unstated, 1000, "x")
    assert decompress_at_most(unstated, 1 << 20, "x") == bytes(1 << 20)
