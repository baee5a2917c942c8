"""Crafting hostile calls for `swarm bench hostile`: token batches, AQ-SGD activations, hand-made frames and
streams too large to hold, zstd bombs, bursts of calls, and a foreign server posing as a stage."""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from swarm.bench.hostile import Harness, Outcome, lazy
from swarm.net.stream import serialize_chunk_item, tensor_items, tokens_to_wire, varint
from swarm.proto import stage_pb2, wire_pb2

MIB = 1 << 20
_fresh, _fresh_lock = itertools.count(10**9), threading.Lock()


def fresh_ids(n: int) -> list[int]:
    """Sample ids no stage has seen (distinct across the threads of a burst)."""
    with _fresh_lock:
        first = next(_fresh)
        for _ in range(n - 1):
            next(_fresh)
    return list(range(first, first + n))


def tokens_item(h: Harness, info=None, values: torch.Tensor | None = None, **batch_fields) -> list[bytes]:
    """A stream into stage 0: the call info and a token batch (valid unless told otherwise)."""
    if values is None:
        values = torch.randint(0, h.model.vocab_size, (2, h.model.seq_len_tokens))
    batch = tokens_to_wire(values, torch.tensor(fresh_ids(values.shape[0])))
    for name, value in batch_fields.items():
        if isinstance(value, list):
            del getattr(batch, name)[:]
            getattr(batch, name).extend(value)
        else:
            setattr(batch, name, value)
    return [stage_pb2.StreamItem(info=info or h.info(0), tokens=batch).SerializeToString()]


def put_labels(h: Harness, **info) -> None:
    """The trainer's labels for micro-batch 0 of the current step (or as `info` overrides say), so that a
    forward that gets through the pipeline is served, not refused for want of labels."""
    labels = tokens_to_wire(torch.randint(0, h.model.vocab_size, (2, h.model.seq_len_tokens)))
    h.call(2, "PutLabels", stage_pb2.LabelsRequest(info=h.info(2, **info), labels=labels))


def activation(h: Harness, n: int, ids: list[int] | None = None, delta: bool = False, fill: float | None = None):
    """An AQ-SGD activation message for the middle stage, [n, seq, hidden], as a sender with its own buffers
    would encode it: first sights in full, or (delta=True) quantized changes against the sender's buffers."""
    from swarm.compression import LinkState, make_codec

    state, codec = LinkState(h.forward_codec), make_codec(h.forward_codec)
    ids = ids if ids is not None else fresh_ids(n)
    x = torch.randn(n, h.model.seq_len_tokens, h.model.boundary_dim)
    if delta:
        codec.encode(x, sample_ids=ids, state=state)
        x = x + 0.1 * torch.randn_like(x)
    msg = codec.encode(x, sample_ids=ids, state=state)
    if fill is not None:  # values no honest encoder would send (NaN, Inf), written past its checks
        raw = torch.frombuffer(bytearray(msg.raw), dtype=torch.float16).clone()
        raw[:: max(1, raw.numel() // 7)] = fill
        msg.raw = raw.numpy().tobytes()
    return msg


def message_items(info, msg, zstd_level: int = 0) -> list[bytes]:
    return list(tensor_items(info, msg, zstd_level, None))


def forward_to_middle(h: Harness, msg, who: str = "trainer", **info) -> Outcome:
    return h.expect_refusal(1, "Forward", message_items(h.info(1, **info), msg), who)


def fp32_body(shape: list[int]) -> tuple[bytes, int]:
    """The head of a serialized fp32 TensorMessage of `shape` whose raw bytes (zeros) follow, and the body's
    total length: lets a huge message be streamed without ever being held."""
    nbytes = 4 * int(torch.tensor(shape).prod())
    head = wire_pb2.TensorMessage(shape=shape, dtype=wire_pb2.FLOAT32, codec=wire_pb2.FP32, raw_dtype=wire_pb2.FLOAT32)
    prefix = head.SerializeToString() + bytes([8 << 3 | 2]) + varint(nbytes)
    return prefix, len(prefix) + nbytes


def header(shape: list[int], body_bytes: int, raw_body_bytes: int | None = None, zstd: bool = False, **kw):
    return wire_pb2.FrameHeader(
        compression=wire_pb2.ZSTD if zstd else wire_pb2.COMPRESSION_NONE, body_bytes=body_bytes,
        raw_body_bytes=body_bytes if raw_body_bytes is None else raw_body_bytes,
        codec=kw.get("codec", wire_pb2.FP32), shape=shape, dtype=kw.get("dtype", wire_pb2.FLOAT32),
    )  # fmt: skip


def stream(info, head, chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Stream items: the info and header with the first chunk, then one item per chunk, made as pulled."""
    for i, data in enumerate(chunks):
        yield serialize_chunk_item(data, info, head) if i == 0 else serialize_chunk_item(data)


def zeros_after(prefix: bytes, total: int, chunk: int = MIB) -> Iterator[bytes]:
    """`prefix` then zeros, `total` bytes in all, in chunks of `chunk` bytes."""
    yield prefix
    left, zeros = total - len(prefix), bytes(chunk)
    while left > 0:
        yield zeros[: min(chunk, left)]
        left -= chunk


def huge_stream(info, shape: list[int]) -> Iterator[bytes]:
    prefix, total = fp32_body(shape)
    return lazy(stream(info, header(shape, total), zeros_after(prefix, total)))


@functools.lru_cache(maxsize=2)
def zstd_bomb(raw_mib: int) -> tuple[bytes, int, list[int]]:
    """A zstd frame (well under 1 MiB) of a valid fp32 activation message of `raw_mib` MiB: (frame, raw bytes,
    shape)."""
    import zstandard

    shape = [raw_mib * MIB // (16 * 32 * 4), 16, 32]
    prefix, total = fp32_body(shape)
    packer = zstandard.ZstdCompressor(level=3).compressobj()
    frame = b"".join(packer.compress(part) for part in zeros_after(prefix, total)) + packer.flush()
    return frame, total, shape


def bomb_items(h: Harness, claimed_raw: int | None = None) -> list[bytes]:
    frame, raw, shape = zstd_bomb(257)
    head = header(shape, len(frame), raw if claimed_raw is None else claimed_raw, zstd=True)
    return list(stream(h.info(1), head, (frame[i : i + MIB] for i in range(0, len(frame), MIB))))


def all_refused(outcomes: list[Outcome], extra: dict | None = None) -> Outcome:
    """One outcome for a burst: refused when every call was; the errors seen, counted."""
    seen: dict[str, int] = {}
    for o in outcomes:
        seen[o.error[:160]] = seen.get(o.error[:160], 0) + 1
    kinds = sorted(seen.items(), key=lambda kv: -kv[1])
    error = "; ".join(f"{n}x {e}" for e, n in kinds[:3]) + (f"; {len(kinds) - 3} more kinds" if len(kinds) > 3 else "")
    return Outcome(all(o.refused for o in outcomes), error, extra or {})


def burst(fn: Callable[[int], Outcome], n: int, threads: int = 8) -> list[Outcome]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, range(n)))


class Foreign:
    """A gRPC server posing as a stage elsewhere: takes Forward streams and their one-item twins, counts their bytes,
    answers a loss."""

    def __enter__(self):
        self.received = 0

        def forward(items, context):
            for item in items:
                self.received += len(item)
            return stage_pb2.ForwardReply(has_loss=True, loss=1.0).SerializeToString()

        def forward_item(item, context):  # a one-item Forward comes as its unary twin (`ONE_ITEM`)
            return forward(iter((item,)), context)

        handler = grpc.method_handlers_generic_handler(
            "swarm.Stage",
            {
                "Forward": grpc.stream_unary_rpc_method_handler(forward),
                "ForwardItem": grpc.unary_unary_rpc_method_handler(forward_item),
            },
        )
        self.server = grpc.server(ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((handler,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(None)
