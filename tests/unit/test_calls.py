"""The wire side of stage calls: serialized stream items are protobuf's own bytes, and sizes are exact."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, make_codec
from swarm.net.stream import item_nbytes, read_stream, serialize_chunk_item, tensor_items
from swarm.proto import stage_pb2, wire_pb2

INFO = stage_pb2.CallInfo(step=7, micro_batch=3, route=["127.0.0.1:1", "127.0.0.1:2"], deadline_s=5.0)
HEADER = wire_pb2.FrameHeader(body_bytes=300, raw_body_bytes=300, codec=wire_pb2.FP32, shape=[5, 15])


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, (1 << 20) + 3])
@pytest.mark.parametrize("with_info", [False, True])
@pytest.mark.parametrize("with_header", [False, True])
def test_serialized_item_is_protobufs_own_encoding(size, with_info, with_header):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    info = INFO if with_info else None
    header = HEADER if with_header else None
    expected = stage_pb2.StreamItem()
    if info is not None:
        expected.info.CopyFrom(info)
    if header is not None:
        expected.chunk.header.CopyFrom(header)
    expected.chunk.data = data
    got = serialize_chunk_item(data, info, header)
    assert got == expected.SerializeToString()
    assert stage_pb2.StreamItem.FromString(got) == expected
    assert item_nbytes(expected, len(data)) == expected.ByteSize() == len(got)


def test_item_size_counts_token_batches_and_empty_info():
    item = stage_pb2.StreamItem(info=stage_pb2.CallInfo(), tokens=stage_pb2.TokenBatch(shape=[2, 3], tokens=bytes(24)))
    assert item_nbytes(item, 0) == item.ByteSize()


def test_a_tensor_stream_reads_back_with_its_exact_wire_size():
    msg = make_codec(CodecConfig("fp32")).encode(torch.randn(3, 100_000))  # 1.2 MB: two chunks
    items = list(tensor_items(INFO, msg, zstd_level=0, shaper=None))
    assert len(items) == 2
    incoming = read_stream(stage_pb2.StreamItem.FromString(b) for b in items)
    assert incoming.info == INFO
    assert incoming.message == msg
    assert incoming.wire_bytes == sum(len(b) for b in items)
