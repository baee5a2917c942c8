"""AQ-SGD: per sample, the quantized change of its activation against a message buffer both ends hold."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch

from swarm.compression.buffers import check_sample_ids
from swarm.compression.codec_base import Codec, decoded_bound
from swarm.compression.layout import FLAT, from_groups, group_for, layout_for, read_layout, to_groups, write_layout
from swarm.compression.quantized import group_size, pack_quantized, quantized_nbytes, unpack_quantized
from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, wire_dtype
from swarm.kernels import all_finite, apply_delta, aqsgd_update, dequantize, quantize
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.state import LinkState


class BufferMissError(LookupError):
    """The receiver holds no message buffer for these sample ids (e.g. it restarted): resend them in full."""

    def __init__(self, sample_ids: list[int], problem: str = "no AQ-SGD buffer"):
        shown = f"{sample_ids[:8]}{'...' if len(sample_ids) > 8 else ''}"
        super().__init__(f"{problem} for sample ids {shown}")
        self.sample_ids = sample_ids


class BufferDriftError(BufferMissError):
    """The receiver's buffers for these samples differ from the sender's (the digests of what both ends would
    write disagree): nothing was committed; the sender forgets them and resends them in full, as for a miss."""

    def __init__(self, sample_ids: list[int], sent: int, computed: int):
        super().__init__(sample_ids, f"AQ-SGD buffers drifted (digest {computed:08x}, sender's {sent:08x})")
        self.sent, self.computed = sent, computed


def buffer_digest(*parts: torch.Tensor | None) -> int:
    """CRC-32 of the tensors' bytes, in order: what one end writes into its message buffers for a message."""
    crc = 0
    for t in parts:
        if t is not None and t.numel():
            crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


class AQSGDCodec(Codec):
    """AQ-SGD: per sample, the quantized change since the sample was last seen, against a message buffer `m`
    held identically by sender and receiver; a sample's first sight travels in full and initialises `m`.
    The receiver computes on `m`, not on the true activation.

    Both ends compute everything a message writes into their buffers first, check it (finite in the buffer
    dtype, the digests agree) and only then commit it, so a refused message leaves the buffers as they were.
    Quantized parts use the config's group layout (`compression.layout`); the buffers and the digest stay in
    the sample's own layout, so both ends' buffers are the same bits whichever layout a message uses.
    """

    name, wire, quantized, uses_buffers = "aqsgd", wire_pb2.AQSGD, True, True

    def payload_nbytes(self, numel: int) -> int:  # steady state: every sample is a delta
        return quantized_nbytes(numel, self.config.bits, group_size(self.config))

    def _encode_body(self, x, msg, state):
        if state is None or state.buffers is None:
            raise ValueError("the aqsgd codec needs a LinkState with message buffers")
        if len(msg.sample_ids) != x.shape[0]:
            raise ValueError(f"aqsgd needs one sample id per row: {len(msg.sample_ids)} ids for {x.shape[0]} rows")
        ids = list(msg.sample_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("aqsgd needs distinct sample ids within a message")
        store, cfg = state.buffers, self.config
        if store.sample_shape is not None and tuple(x.shape[1:]) != store.sample_shape:
            raise ValueError(
                f"samples of shape {list(x.shape[1:])}, this link buffers {list(store.sample_shape)}: a link's "
                "message buffers hold one sample shape (give each shape its own link)"
            )
        layout = layout_for(cfg, x.shape)
        write_layout(msg, layout)
        group = group_for(cfg, layout, x.shape)
        slots = store.lookup(ids)
        is_delta = [s >= 0 for s in slots]
        msg.sample_is_delta.extend(is_delta)
        delta_rows = [i for i, d in enumerate(is_delta) if d]
        full_rows = [i for i, d in enumerate(is_delta) if not d]
        m = first = None
        if delta_rows:
            # communication: only the quantized change of each seen sample; m moves by exactly what was sent
            at = FLAT if cfg.delta_rank else layout  # subspace-coded deltas: rows of the sample's own layout
            m = to_groups(store.gather([slots[i] for i in delta_rows]), at)
            self._send_delta(to_groups(x[delta_rows], at), m, group, state, msg)
            m = from_groups(m, at, [len(delta_rows), *x.shape[1:]])
        if full_rows:
            first = self._first_sight(x[full_rows], state, msg, layout, group)
        for written in (m, first):
            if written is not None and not all_finite(written):
                raise ValueError(f"the activation overflows the {store.dtype} message buffers; use bfloat16 buffers")
        msg.buffer_digest = buffer_digest(m, first)
        # commit only now: a failure above leaves the sender's buffers as they were
        if m is not None:
            store.scatter([slots[i] for i in delta_rows], m)
            store.touch([ids[i] for i in delta_rows])  # the receiver touches the same ids in the same order
        if first is not None:
            store.admit([ids[i] for i in full_rows], first)

    def _first_sight(
        self, x: torch.Tensor, state: LinkState, msg: wire_pb2.TensorMessage, layout: str, group: int
    ) -> torch.Tensor:
        """Sends new samples in full (buffer dtype; always where `state.exact_first_sights`) or directly quantized
        (`+fsN`, `+fsd`); returns what both ends buffer."""
        cfg, buffer_dtype = self.config, state.buffers.dtype
        msg.raw_dtype = wire_dtype(buffer_dtype)
        if (cfg.first_sight_bits == 16 and not cfg.first_sight_delta_code) or state.exact_first_sights:
            first = x.to(buffer_dtype)
            msg.raw = tensor_to_bytes(first)
            return first
        sent = self._send_full(to_groups(x, layout), group, state, msg)
        return from_groups(sent, layout, x.shape).to(buffer_dtype)

    # the quantizer: AQ-SGD's per-group (min, scale) kernels; a subclass may bring its own

    def _send_delta(self, rows: torch.Tensor, m: torch.Tensor, group: int, state, msg: wire_pb2.TensorMessage) -> None:
        """Quantizes `rows - m` (group order, contiguous) into `msg.quantized`, moving `m` in place by exactly what
        is sent."""
        cfg = self.config
        q = aqsgd_update(rows, m, cfg.bits, group, stochastic=cfg.stochastic, seed=state.next_seed())
        pack_quantized(q, msg.quantized)

    def _receive_delta(self, msg: wire_pb2.TensorMessage, m: torch.Tensor, bound: float) -> torch.Tensor:
        """`m` (group order, contiguous) moved by the checked delta in `msg.quantized`, as the sender moved its own."""
        return apply_delta(m, unpack_quantized(msg.quantized, m.numel(), "quantized", bound))

    def _send_full(self, x: torch.Tensor, group: int, state, msg: wire_pb2.TensorMessage) -> torch.Tensor:
        """`x` (group order) quantized at `first_sight_bits` into `msg.quantized_full`; returns what the receiver
        decodes (fp32), which the sender buffers: later deltas are taken against it, not against `x`."""
        cfg = self.config
        q = quantize(x, cfg.first_sight_bits, group, stochastic=cfg.stochastic, seed=state.next_seed())
        pack_quantized(q, msg.quantized_full)
        return dequantize(q)

    def _receive_full(self, msg: wire_pb2.TensorMessage, n: int, bound: float) -> torch.Tensor:
        """The checked first sights of `msg` (its `quantized_full`), fp32, group order."""
        return dequantize(unpack_quantized(msg.quantized_full, n, "quantized_full", bound))

    def _decode_body(self, msg, numel, state):
        if state is None or state.buffers is None:
            raise ValueError("the aqsgd codec needs a LinkState with message buffers")
        store, shape = state.buffers, list(msg.shape)
        ids, delta_rows, full_rows = _check_rows(msg, shape, store.sample_shape)
        # rotated first sights are token groups whatever the layout (codec_acsgd): only the deltas' is checked
        subspace = msg.HasField("first_sight_basis")  # acsgd's `+fslR`: first sights as factors, not groups
        coded = msg.HasField("delta_basis")  # acsgd's `+dslR`: deltas as factors, in the sample's own layout
        if coded and not delta_rows:
            raise WireError("delta_basis", "set on a message without a delta sample")
        layout = read_layout(
            msg, shape, *([] if coded else [msg.quantized]), *([] if msg.rotation or subspace else [msg.quantized_full])
        )
        per_sample = numel // shape[0] if shape[0] else 0
        slots = store.lookup(ids)
        missing = [ids[i] for i in delta_rows if slots[i] < 0]
        if missing:
            raise BufferMissError(missing)
        bound = decoded_bound(msg, store.dtype)
        # everything this message would write, computed on copies: the store does not change yet
        m = first = None
        if delta_rows:
            # a delta moves m by at most its own size: bounded by twice what the buffer holds, m checked after
            at = FLAT if coded else layout
            m = to_groups(store.gather([slots[i] for i in delta_rows]), at)
            m = self._receive_delta(msg, m, 2 * bound)
            m = from_groups(m, at, [len(delta_rows), *shape[1:]])
            _check_bounded(m, bound, "quantized.scales")
        if full_rows:
            first = self._decode_first(msg, len(full_rows) * per_sample, store.dtype, bound)
            first = from_groups(first, self._first_layout(msg, layout), [len(full_rows), *shape[1:]])
        if msg.HasField("buffer_digest"):
            computed = buffer_digest(m, first)
            if computed != msg.buffer_digest:
                raise BufferDriftError(ids, msg.buffer_digest, computed)
        # commit: nothing below depends on the message any more
        out = torch.empty(shape, dtype=store.dtype)
        if m is not None:
            store.scatter([slots[i] for i in delta_rows], m)
            store.touch([ids[i] for i in delta_rows])
            out[delta_rows] = m
        if first is not None:
            store.admit([ids[i] for i in full_rows], first)
            out[full_rows] = first
        return out

    def _first_layout(self, msg: wire_pb2.TensorMessage, layout: str) -> str:
        """The layout of a message's decoded first sights: the deltas' when quantized in groups, the sample's own
        (flat) when they travel raw."""
        return layout if msg.HasField("quantized_full") else FLAT

    def _decode_first(self, msg: wire_pb2.TensorMessage, n: int, dtype: torch.dtype, bound: float) -> torch.Tensor:
        """The first sights of a message, checked, in the buffer dtype."""
        if msg.HasField("quantized_full"):
            first = self._receive_full(msg, n, bound).to(dtype)
            _check_bounded(first, bound, "quantized_full.scales")
            return first
        if msg.raw_dtype != wire_dtype(dtype):
            raise WireError("raw_dtype", f"expected the buffer dtype {dtype}")
        first = bytes_to_tensor(msg.raw, dtype, n, "raw")
        _check_bounded(first, bound, "raw")
        return first


def _check_rows(
    msg: wire_pb2.TensorMessage, shape: list[int], sample_shape: tuple[int, ...] | None
) -> tuple[list[int], list[int], list[int]]:
    """The message's sample ids, its delta rows and its first-sight rows, each checked against the shape."""
    if not shape or len(msg.sample_ids) != shape[0]:
        raise WireError("sample_ids", f"{len(msg.sample_ids)} ids for a tensor of shape {shape}")
    if len(msg.sample_is_delta) != len(msg.sample_ids):
        raise WireError("sample_is_delta", f"{len(msg.sample_is_delta)} flags for {len(msg.sample_ids)} ids")
    ids = list(msg.sample_ids)
    check_sample_ids(ids)
    if len(set(ids)) != len(ids):
        raise WireError("sample_ids", "ids repeat within one message")
    if sample_shape is not None and ids and tuple(shape[1:]) != sample_shape:
        raise WireError("shape", f"samples of shape {shape[1:]}, this link buffers {list(sample_shape)}")
    delta_rows = [i for i, d in enumerate(msg.sample_is_delta) if d]
    full_rows = [i for i, d in enumerate(msg.sample_is_delta) if not d]
    return ids, delta_rows, full_rows


def _check_bounded(x: torch.Tensor, bound: float, field: str) -> None:
    """Refuses values that are not finite in the buffer dtype or exceed `bound` (a narrower decoded dtype)."""
    if not x.numel():
        return
    if not all_finite(x):
        raise WireError(field, f"decodes to NaN or Inf in {x.dtype}")
    if bound < torch.finfo(x.dtype).max and float(x.abs().max()) > bound:
        raise WireError(field, f"decodes to values beyond {bound:.6g}, what the declared dtype holds")


CODECS = (AQSGDCodec,)
