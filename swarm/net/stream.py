"""The wire side of stage calls: token batches, stream items, reading a stream, and naming failures.

Servicers and the trainer use these so that every stream is read with the same bounds (of size, and of time:
`ReadTimeouts`, enforced by one `StreamWatchdog` thread) and every failure says which stage and peer it came from.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import torch

from swarm.compression import DEFAULT_LIMITS, Unframer, WireError, WireLimits, ZstdPolicy
from swarm.compression.buffers import check_sample_ids
from swarm.compression.framing import decompress_at_most, frame_parts, zstd_compressor
from swarm.peers.shaper import Shaper
from swarm.peers.transport import paced
from swarm.proto import stage_pb2, wire_pb2

MAX_TOKEN_ROWS = 4096
MAX_TOKEN_COLS = 1 << 16
STAGE_ERROR_PREFIX = "stage "
BUFFER_MISS = "buffer-miss:"
PLAN_MISMATCH = "plan-mismatch:"
"""Marks a refusal because caller and stage follow different plan versions: retry on the newer plan."""


TOKEN_WIDTHS = {1: torch.uint8, 2: torch.uint16, 4: torch.int32}
"""Bytes per token id on the wire and the dtype they are read as: the narrowest that holds the batch's ids."""
TOKENS_ZSTD_LEVEL = 3


def tokens_to_wire(tokens: torch.Tensor, sample_ids: torch.Tensor | None = None) -> stage_pb2.TokenBatch:
    """[B, T] token ids in the narrowest width that holds them (a byte-level vocabulary: 1 byte per token, not
    4), zstd-compressed when that shrinks them: input and labels are a step's largest control traffic."""
    batch = stage_pb2.TokenBatch(shape=list(tokens.shape))
    top = int(tokens.max()) if tokens.numel() else 0
    signed = bool(tokens.numel()) and int(tokens.min()) < 0  # sent as they are, for the receiver to refuse
    width = 4 if signed else 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
    raw = tokens.to(TOKEN_WIDTHS[width]).contiguous().view(torch.uint8).numpy().tobytes()
    packed = zstd_compressor(TOKENS_ZSTD_LEVEL).compress(raw)
    batch.width, batch.zstd = width, len(packed) < len(raw)
    batch.tokens = packed if batch.zstd else raw
    if sample_ids is not None:
        batch.sample_ids.extend(int(s) for s in sample_ids)
    return batch


def tokens_from_wire(batch: stage_pb2.TokenBatch, vocab_size: int, max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked [B, T] int64 tokens and [B] sample ids from the wire (a zstd body may not inflate past its shape)."""
    shape = list(batch.shape)
    if len(shape) != 2 or not (1 <= shape[0] <= MAX_TOKEN_ROWS) or not (1 <= shape[1] <= min(max_seq, MAX_TOKEN_COLS)):
        raise WireError("tokens.shape", f"{shape} is not [batch <= {MAX_TOKEN_ROWS}, seq <= {max_seq}]")
    width = batch.width or 4
    if width not in TOKEN_WIDTHS:
        raise WireError("tokens.width", f"{batch.width} is not a token width ({sorted(TOKEN_WIDTHS)} bytes)")
    size = shape[0] * shape[1] * width
    body = batch.tokens
    if batch.zstd:
        body = decompress_at_most(body, size, "tokens.tokens")
    if len(body) != size:
        raise WireError("tokens.tokens", f"{len(body)} bytes for shape {shape} of {width}-byte ids")
    if batch.sample_ids and len(batch.sample_ids) != shape[0]:
        raise WireError("tokens.sample_ids", f"{len(batch.sample_ids)} ids for {shape[0]} rows")
    tokens = torch.frombuffer(bytearray(body), dtype=TOKEN_WIDTHS[width]).view(*shape).long()
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise WireError("tokens.tokens", f"token ids must lie in [0, {vocab_size})")
    check_sample_ids(batch.sample_ids, "tokens.sample_ids")
    ids = torch.tensor(list(batch.sample_ids) or range(shape[0]), dtype=torch.long)
    return tokens, ids


def tensor_items(
    info: stage_pb2.CallInfo,
    msg: wire_pb2.TensorMessage,
    zstd_level: int,
    shaper: Shaper | None,
    policy: ZstdPolicy | None = None,
) -> Iterator[bytes]:
    """The stream of one call as serialized `StreamItem`s, produced as the transport pulls them: frame -> stream
    items (the call info with the first chunk, the one that carries the frame header) -> pace. Send them with
    a `TensorStreams` call (or a `StageClient`'s Forward/Backward/Sink).

    With a zstd `policy`, the level is chosen per message from the link's known rate (`Shaper.known_rate`: its
    shape's, or what the peer measured), so zstd goes only where it pays.
    """
    if policy is not None:
        zstd_level = policy.level_for(shaper.known_rate() if shaper is not None else None)
    parts = frame_parts(msg, zstd_level=zstd_level, policy=policy)
    whole: list[bool] = []  # once the first chunk is framed: whether it holds the whole body

    def items() -> Iterator[bytes]:
        for header, data in parts:
            if header is not None:  # the call info rides with the first chunk, the one that carries the header
                whole.append(len(data) == header.body_bytes)
            yield serialize_chunk_item(data, None if header is None else info, header)

    return ItemStream(paced(items(), shaper), whole)


class ItemStream:
    """A call's serialized stream items as the transport pulls them (`tensor_items`). Once the first is out,
    `one_item()` says whether it holds the whole message: a client then sends it as the method's unary twin
    (`ONE_ITEM`, `swarm.net.connect`)."""

    def __init__(self, items: Iterator[bytes], whole: list[bool]):
        self._items, self._whole = items, whole

    def __iter__(self) -> Iterator[bytes]:
        return self._items

    def __next__(self) -> bytes:
        return next(self._items)

    def one_item(self) -> bool:
        return bool(self._whole) and self._whole[0]


def serialize_chunk_item(
    data: bytes, info: stage_pb2.CallInfo | None = None, header: wire_pb2.FrameHeader | None = None
) -> bytes:
    """`StreamItem(info=info, chunk=Chunk(header=header, data=data)).SerializeToString()`, byte for byte, with
    one copy of `data` instead of three (into the Chunk, into the item, out of the item).

    protobuf writes fields in number order, a length-delimited field as tag, varint length, bytes: info
    (field 1), then chunk (field 3) holding header (its field 1) and data (its field 2), which is last in
    both messages, so everything but `data` is serialized by protobuf itself. A test checks the equality.
    """
    head = stage_pb2.StreamItem(info=info).SerializeToString() if info is not None else b""
    header_field = wire_pb2.Chunk(header=header).SerializeToString() if header is not None else b""
    data_field = b"".join((_DATA_TAG, varint(len(data)))) if data else b""
    chunk_len = len(header_field) + len(data_field) + len(data)
    return b"".join((head, _CHUNK_TAG, varint(chunk_len), header_field, data_field, data))


_CHUNK_TAG = bytes([3 << 3 | 2])  # StreamItem.chunk: field 3, length-delimited
_DATA_TAG = bytes([2 << 3 | 2])  # Chunk.data: field 2, length-delimited


def varint(n: int) -> bytes:
    """protobuf's base-128 varint of `n`."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_nbytes(length: int) -> int:
    """Bytes of a length-delimited field with a one-byte tag (field numbers below 16) and `length` bytes."""
    return 1 + max(1, (length.bit_length() + 6) // 7) + length


def item_nbytes(item: stage_pb2.StreamItem, data_len: int) -> int:
    """`item.ByteSize()` given its chunk's data length, without encoding the data again (upb's ByteSize
    serializes the whole message to count it)."""
    n = _field_nbytes(item.info.ByteSize()) if item.HasField("info") else 0
    if item.HasField("tokens"):
        n += _field_nbytes(item.tokens.ByteSize())
    if item.HasField("chunk"):
        chunk = _field_nbytes(item.chunk.header.ByteSize()) if item.chunk.HasField("header") else 0
        n += _field_nbytes(chunk + (_field_nbytes(data_len) if data_len else 0))
    return n


STAGE_SERVICE = stage_pb2.DESCRIPTOR.services_by_name["Stage"]
"""The stage service as `stage.proto` declares it: every client's methods are bound from it (`bind_method`)."""
METHODS = {method.name: method for method in STAGE_SERVICE.methods}
"""The stage service's methods by name (their request and reply types, and which side streams)."""


ONE_ITEM = {"Forward": "ForwardItem", "Backward": "BackwardItem"}
"""Client streams whose calls of one item go as a unary twin, which the stage serves as that one-item stream (the
twin's request is the item). gRPC's Python client consumes a client stream's requests on a thread it starts for
the call; a unary call needs none: 0.4 against 3 ms a call of one 8 KiB item on a busy 2-core machine (s60)."""


def message_type(descriptor) -> type:
    """The generated class of a `stage.proto` message."""
    return getattr(stage_pb2, descriptor.name)


def bind_method(channel: grpc.Channel, method) -> Callable:
    """`method` (of `METHODS`) on `channel`: a client-streaming call takes already serialized stream items
    (`tensor_items`; the generated stub would take `StreamItem` objects and serialize each again), a unary call
    takes its request message. Replies are parsed as the generated stub does."""
    path = f"/{STAGE_SERVICE.full_name}/{method.name}"
    reply = message_type(method.output_type).FromString
    if method.client_streaming:
        factory = channel.stream_stream if method.server_streaming else channel.stream_unary
        return factory(path, request_serializer=None, response_deserializer=reply)
    factory = channel.unary_stream if method.server_streaming else channel.unary_unary
    # a one-item stream's unary twin (`ONE_ITEM`) takes its item serialized already, as the stream would
    request = None if method.input_type.name == "StreamItem" else message_type(method.input_type).SerializeToString
    return factory(path, request_serializer=request, response_deserializer=reply)


class TensorStreams:
    """The stage service's tensor-carrying calls on a raw channel, for streams of already serialized items
    (`tensor_items`), bound as every stage client binds them (`bind_method`)."""

    def __init__(self, channel: grpc.Channel):
        self.Forward = bind_method(channel, METHODS["Forward"])
        self.Backward = bind_method(channel, METHODS["Backward"])
        self.ForwardItem = bind_method(channel, METHODS["ForwardItem"])
        self.BackwardItem = bind_method(channel, METHODS["BackwardItem"])
        self.Sink = bind_method(channel, METHODS["Sink"])


@dataclass
class Incoming:
    """One call's stream, read and checked: its info, and a tensor message or a token batch."""

    info: stage_pb2.CallInfo
    message: wire_pb2.TensorMessage | None = None
    tokens: stage_pb2.TokenBatch | None = None
    wire_bytes: int = 0


@dataclass(frozen=True)
class ReadTimeouts:
    """How long a stream may take to arrive, derived from the slowest link a caller may stream over: any item
    and any message the wire limits admit gets the time its bytes take at `min_rate_bytes_per_s`, plus a slack.

    A stream whose next item is later than `item_deadline_s`, or that is still arriving `read_deadline_s`
    after its call began, is cancelled: a caller that stops sending holds its slot for that long at most."""

    item_s: float
    """slack for each item beyond its bytes at the minimum rate"""
    read_s: float
    """slack for the whole stream beyond its declared body at the minimum rate"""
    min_rate_bytes_per_s: float
    """the slowest link a caller may use (1 Mbit/s: 125,000 bytes/s)"""

    def item_deadline_s(self, limits: WireLimits) -> float:
        """Longest wait for one item: the largest chunk `limits` admit, at the minimum rate, plus the slack."""
        return self.item_s + limits.max_chunk_bytes / self.min_rate_bytes_per_s

    def read_deadline_s(self, body_bytes: int) -> float:
        """Longest a stream of `body_bytes` (its frame header's declaration, bounded by the limits) may take."""
        return self.read_s + body_bytes / self.min_rate_bytes_per_s


class StreamTimeout(Exception):
    """A stream that stalled past its read deadline; the call was cancelled and its slot is free."""


class _Watch:
    """One stream's deadlines (monotonic seconds; inf: not waiting on the caller now)."""

    __slots__ = ("cancel", "expired", "item_due", "item_s", "paused_s", "read_due", "read_s", "started")

    def __init__(self, cancel: Callable[[], None], item_s: float, read_s: float):
        self.cancel, self.item_s, self.read_s = cancel, item_s, read_s
        self.started = time.monotonic()
        self.paused_s = 0.0
        """time the server itself spent mid-read (checks, waiting for a large-stream slot): not the caller's"""
        self.item_due = float("inf")
        self.read_due = self.started + read_s
        self.expired: str | None = None

    def check(self, now: float) -> None:
        if self.expired is not None or now < min(self.item_due, self.read_due):
            return
        if now >= self.item_due:
            self.expired = f"no stream item for {self.item_s:.1f} s"
        else:
            self.expired = f"the stream took longer than {self.read_s:.1f} s to arrive"
        try:
            self.cancel()
        except Exception:  # a call that ended meanwhile: nothing to cancel
            pass


class StreamWatchdog:
    """One thread that cancels the streams past their read deadlines (checked every `tick_s`), so a stalled
    caller cannot hold a server thread and its slot: the blocked read then fails at once. It runs only while
    streams are being read; a stream's deadlines cost two float writes per item."""

    def __init__(self, tick_s: float = 0.25):
        self.tick_s = tick_s
        self._watches: set[_Watch] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], None], item_s: float, read_s: float) -> _Watch:
        """Watches a stream from now on; `cancel` ends its call. `release` it when the read is over."""
        w = _Watch(cancel, item_s, read_s)
        with self._cond:
            self._watches.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return w

    def release(self, w: _Watch) -> None:
        with self._cond:
            self._watches.discard(w)

    def watched(self) -> int:
        """Streams being watched now."""
        return len(self._watches)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._watches:
                    self._cond.wait()
                self._cond.wait(self.tick_s)
                watches = list(self._watches)
            now = time.monotonic()
            for w in watches:
                w.check(now)

    def _forked(self) -> None:
        """In a forked child: the parent's thread and streams are not this process's."""
        self._watches, self._cond, self._thread = set(), threading.Condition(), None


WATCHDOG = StreamWatchdog()
"""The process's stream watchdog (one thread, started by the first watched stream)."""
os.register_at_fork(after_in_child=WATCHDOG._forked)


def read_stream(
    items: Iterable[stage_pb2.StreamItem],
    limits: WireLimits = DEFAULT_LIMITS,
    on_info: Callable[[stage_pb2.CallInfo], None] | None = None,
    on_header: Callable[[wire_pb2.FrameHeader], None] | None = None,
    timeouts: ReadTimeouts | None = None,
    cancel: Callable[[], None] | None = None,
) -> Incoming:
    """Reads a whole stream; raises WireError naming the field on anything malformed or out of bounds.

    `on_info` sees the call info as soon as the first item is in, before any more of the stream is read: it
    raises to refuse the call, so a call the stage would refuse costs one item, not the whole stream.
    `on_header` likewise sees the frame header (checked against `limits`) before any body byte is kept.
    With `timeouts` and `cancel` (the call's `context.cancel`), a stream that stalls past its deadlines is
    cancelled and StreamTimeout raised; the time `on_info` and `on_header` take (the server's own waits) does
    not count. Sample ids are checked (`check_sample_ids`) before the message is returned.
    """
    if timeouts is None or cancel is None:
        return _read(iter(items), limits, on_info, on_header, None)
    watch = WATCHDOG.watch(cancel, timeouts.item_deadline_s(limits), timeouts.read_deadline_s(limits.max_message_bytes))
    try:
        incoming = _read(iter(items), limits, on_info, on_header, (watch, timeouts))
    except (grpc.RpcError, WireError):
        if watch.expired is not None:
            raise StreamTimeout(watch.expired) from None
        raise
    finally:
        WATCHDOG.release(watch)
    if watch.expired is not None:  # gRPC may end a cancelled stream as if its caller had closed it
        raise StreamTimeout(watch.expired)
    return incoming


def _server_side(watch: _Watch | None, fn: Callable, arg) -> None:
    """Runs `fn(arg)`, the server's own work mid-read: its time is added to the stream's read deadline."""
    if watch is None:
        fn(arg)
        return
    begun = time.monotonic()
    watch.read_due = float("inf")
    try:
        fn(arg)
    finally:
        watch.paused_s += time.monotonic() - begun
        watch.read_due = watch.started + watch.read_s + watch.paused_s


def _read(items: Iterator, limits: WireLimits, on_info, on_header, watched) -> Incoming:
    incoming: Incoming | None = None
    unframer = Unframer(limits)
    watch, timeouts = watched if watched is not None else (None, None)
    while True:
        if watch is not None:
            watch.item_due = time.monotonic() + watch.item_s
        try:
            item = next(items)
        except StopIteration:
            break
        if watch is not None:
            watch.item_due = float("inf")
        if incoming is None:
            if not item.HasField("info"):
                raise WireError("info", "the first item of a stream must carry the call info")
            incoming = Incoming(info=item.info)
            if on_info is not None:
                _server_side(watch, on_info, item.info)
        elif item.HasField("info"):
            raise WireError("info", "call info repeated within a stream")
        if item.HasField("tokens"):
            if incoming.tokens is not None or incoming.message is not None:
                raise WireError("tokens", "a stream carries one token batch and nothing else")
            incoming.tokens = item.tokens
        data_len = 0
        if item.HasField("chunk"):
            if incoming.message is not None or incoming.tokens is not None:
                raise WireError("chunk", "data after the end of the message")
            before = unframer.received_bytes
            if (
                (on_header is not None or watch is not None)
                and unframer.header is None
                and item.chunk.HasField("header")
            ):
                header = unframer.check_header(item.chunk.header)
                if watch is not None:  # the declared body sets the read deadline
                    watch.read_s = timeouts.read_deadline_s(header.body_bytes)
                    watch.read_due = watch.started + watch.read_s + watch.paused_s
                if on_header is not None:
                    _server_side(watch, on_header, header)
            incoming.message = unframer.feed(item.chunk)  # checks the header's sizes before the body arrives
            data_len = unframer.received_bytes - before  # len(item.chunk.data) would copy the data once more
        incoming.wire_bytes += item_nbytes(item, data_len)
        if incoming.wire_bytes > limits.max_message_bytes + limits.max_chunk_bytes:
            raise WireError("stream", f"more than {limits.max_message_bytes} bytes in one call")
    if incoming is None:
        raise WireError("stream", "empty stream")
    if unframer.header is not None and incoming.message is None:
        raise WireError("chunk", "the stream ended before the message was complete")
    if incoming.message is not None:
        check_sample_ids(incoming.message.sample_ids, "sample_ids")
    if incoming.tokens is not None:
        check_sample_ids(incoming.tokens.sample_ids, "tokens.sample_ids")
    return incoming


class CallRefused(Exception):
    """A call a stage refuses, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class StageCallError(RuntimeError):
    """A call to a stage failed; `str()` says which stage and peer, and why."""

    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(details)
        self.code = code


def name_failure(error: grpc.RpcError, stage: int, peer: str, address: str) -> StageCallError:
    """Blames `stage` for a failed call to it, unless the error already names a stage further along."""
    details = error.details() or str(error.code())
    if details.startswith(STAGE_ERROR_PREFIX):
        return StageCallError(details, error.code())
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        details = f"unreachable or too slow ({code.name}): {details}"
    return StageCallError(f"stage {stage} (peer {peer} at {address}): {details}", code)
