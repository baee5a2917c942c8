"""TOPK: the replicas' gradient sum, sparsified: each group's largest elements, low-bit magnitudes, error feedback.

Why: with replicas the replicas' sum was most of a run's bytes (`swarm experiment churn`, 3 stages x 2 replicas:
about 600 MB of 707 MB at 8 bits an element). Data-parallel systems send one to two orders of magnitude less by
sending only the largest entries of (gradient + what earlier messages left out): Deep Gradient Compression,
SparseLoCo (top-k per chunk of 4096, 2-bit values, error feedback). This codec is that message. Taking the top k
of every group, not of the whole tensor, keeps every layer in every message whatever its gradients' scale (a
global top-k starves the small-gradient layers until their residual grows, which AdamW then replays as a burst)
and keeps each index to log2(group) bits.

Quantizer (per group, deterministic): the `keep` largest |v| (ties: torch.topk's pick, the encoder's own business);
their magnitudes on 2^(bits-1) levels from the smallest kept magnitude `lo` to the largest `hi`, rounded to nearest,
and a sign bit. The error feedback (`+ef`: the caller's `LinkState.residual`, which the averager carries across
steps) keeps what the message left out, so every element is sent once its accumulated value ranks. Decoding is a
pure function of the message in float32, so every replica that decodes the same messages gets the same bits.

On the wire: `TensorMessage.sparse` (proto/wire.proto's `Sparse`): group size, keep, bits, the packed in-group
offsets (ascending within each group), the packed codes, and `lo`/`hi` per group in float32. Everything is checked
before anything is decoded: lengths, padding bits, offsets ascending and inside their group, 0 <= lo <= hi within
the decoded dtype's range.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm.compression.codec_base import Codec, decoded_bound
from swarm.compression.codec_tern import group_view
from swarm.compression.quantized import SUPPORTED_BITS
from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes
from swarm.proto import wire_pb2

SPARSE_SUM_CODEC = "topk2+ef+k64+g4096"
"""The sparsified replicas' sum (opt-in: `GradientAverager.sum_codec`, or a plan's epilogue codec): 64 of every 4096
elements, a sign and a 1-bit magnitude each, error feedback (SparseLoCo's message, without its local steps). Not a
default: summed every step under AdamW it trained far worse (docs/REPLICAS.md#the-replicas-sum-sparsified)."""
DEFAULT_TOPK_GROUP = 4096
"""Elements per group when the config names none (SparseLoCo's chunk): 12-bit offsets."""
DEFAULT_KEEP_SHARE = 64
"""With `keep` 0, a group keeps 1/64 of its elements (SparseLoCo's 64 of 4096)."""


def topk_group(config) -> int:
    """The group size a topk config asks for."""
    return config.group_size or DEFAULT_TOPK_GROUP


def topk_keep(config) -> int:
    """Elements a full group keeps under `config` (its `keep`, else 1/64 of the group, at least 1)."""
    return min(topk_group(config), config.keep or max(1, topk_group(config) // DEFAULT_KEEP_SHARE))


def index_bits(group: int) -> int:
    """Bits of one in-group offset."""
    return max(1, (group - 1).bit_length())


def kept_counts(numel: int, group: int, keep: int) -> np.ndarray:
    """Elements kept in each group of a tensor of `numel` elements: min(keep, the group's length)."""
    groups = math.ceil(numel / group)
    counts = np.full(groups, min(keep, group), dtype=np.int64)
    tail = numel - (groups - 1) * group if groups else 0
    if groups:
        counts[-1] = min(keep, tail)
    return counts


def pack_fields(values: np.ndarray, width: int) -> bytes:
    """Unsigned integers of `width` bits each, least significant bit first, the last byte zero-padded."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    bits = ((values[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_fields(payload: bytes, count: int, width: int, field: str) -> np.ndarray:
    """The inverse of `pack_fields`: `count` integers; a wrong length or a set padding bit is a WireError."""
    expected = math.ceil(count * width / 8)
    if len(payload) != expected:
        raise WireError(field, f"{len(payload)} bytes, expected {expected} for {count} x {width} bits")
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little")
    if bits[count * width :].any():
        raise WireError(field, "padding bits past the last field are set")
    fields = bits[: count * width].reshape(count, width).astype(np.int64)
    return fields @ (np.int64(1) << np.arange(width, dtype=np.int64))


def dequantize_magnitudes(levels: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """The magnitude of each kept element from its level and its group's `lo`/`hi` (already expanded per element):
    the one formula both the encoder's error feedback and every decoder use, so their float32 bits agree."""
    top = (1 << (bits - 1)) - 1
    if top == 0:
        return hi.clone()
    return lo + levels.float() * ((hi - lo) / top)


class TopKCodec(Codec):
    """The `keep` largest elements of each group, sign and (bits - 1)-bit magnitude, with error feedback."""

    name, wire, quantized, error_feedback, sparse = "topk", wire_pb2.TOPK, True, True, True

    @classmethod
    def check(cls, config) -> None:
        if not 1 <= topk_keep(config) <= topk_group(config) or config.keep > topk_group(config):
            raise ValueError(f"topk keeps 1..group_size elements a group, got {config.keep} of {topk_group(config)}")
        if config.group_layout != "flat" or config.rotation != "none":
            raise ValueError("topk takes flat groups and no rotation")

    @classmethod
    def label(cls, config) -> str:
        """`topk2+ef+k64+g4096`: bits of the values, error feedback, and the elements kept and group size where the
        config sets them (its density; without them, 1/64 of groups of 4096)."""
        return (
            f"{cls.name}{config.bits}"
            + ("+ef" if config.error_feedback else "")
            + (f"+k{config.keep}" if config.keep else "")
            + (f"+g{config.group_size}" if config.group_size else "")
        )

    @classmethod
    def wire_bits(cls, config) -> int:
        """The planner's integer figure: at least 1 bit an element (offsets, codes and scales are below it)."""
        return max(1, math.ceil(cls.nominal_bits(config)))

    @classmethod
    def nominal_bits(cls, config) -> float:
        group = topk_group(config)
        return topk_keep(config) * (index_bits(group) + config.bits) / group

    def payload_nbytes(self, numel: int) -> int:
        group = topk_group(self.config)
        kept = int(kept_counts(numel, group, topk_keep(self.config)).sum())
        groups = math.ceil(numel / group)
        return math.ceil(kept * index_bits(group) / 8) + math.ceil(kept * self.config.bits / 8) + 8 * groups

    def _encode_body(self, x, msg, state):
        cfg = self.config
        use_feedback = cfg.error_feedback and state is not None
        if use_feedback and state.residual is not None and state.residual.shape == x.shape:
            x = x.float() + state.residual
        flat = x.detach().float().reshape(-1)
        group, keep = topk_group(cfg), topk_keep(cfg)
        counts = kept_counts(flat.numel(), group, keep)
        out = msg.sparse
        out.group_size, out.keep, out.bits = group, keep, cfg.bits
        if flat.numel() == 0:
            if use_feedback:
                state.residual = flat.view(x.shape).clone()
            return
        rows = group_view(flat, group)
        k = int(counts[0])
        magnitude = rows.abs()
        tail = flat.numel() - (rows.shape[0] - 1) * group
        magnitude[-1, tail:] = -1.0  # the padding is never picked before a real element
        order = magnitude.topk(k, dim=1, sorted=True).indices
        last = int(counts[-1])  # only the last group may keep fewer (a tail shorter than keep)
        index = torch.cat([order[:-1].sort(dim=1).values.reshape(-1), order[-1, :last].sort().values])
        group_of = torch.from_numpy(np.repeat(np.arange(len(counts)), counts))
        values = rows[group_of, index]
        mags = values.abs()
        lo = torch.full((len(counts),), math.inf).scatter_reduce(0, group_of, mags, "amin")
        hi = torch.zeros(len(counts)).scatter_reduce(0, group_of, mags, "amax")
        top = (1 << (cfg.bits - 1)) - 1
        span = (hi - lo)[group_of]
        levels = torch.zeros_like(mags, dtype=torch.int64)
        if top:
            safe = torch.where(span > 0, span, torch.ones_like(span))
            levels = torch.where(span > 0, torch.round((mags - lo[group_of]) / safe * top), 0.0).long()
            levels = levels.clamp(0, top)
        negative = (values < 0).long()
        codes = levels | (negative << (cfg.bits - 1))
        out.index = pack_fields(index.numpy(), index_bits(group))
        out.codes = pack_fields(codes.numpy(), cfg.bits)
        out.lo, out.hi = tensor_to_bytes(lo), tensor_to_bytes(hi)
        if use_feedback:
            sent = torch.zeros(flat.numel())
            sent[group_of * group + index] = _signed(levels, negative, lo[group_of], hi[group_of], cfg.bits)
            state.residual = (flat - sent).view(x.shape)

    def _decode_body(self, msg, numel, state):
        sparse = msg.sparse
        group, keep, bits = sparse.group_size, sparse.keep, sparse.bits
        if not 1 <= group <= 65536:
            raise WireError("sparse.group_size", f"{group} is outside 1..65536")
        if not 1 <= keep <= group:
            raise WireError("sparse.keep", f"{keep} is outside 1..{group}")
        if bits not in SUPPORTED_BITS:
            raise WireError("sparse.bits", f"unsupported bit width {bits}")
        groups = math.ceil(numel / group)
        lo = bytes_to_tensor(sparse.lo, torch.float32, groups, "sparse.lo")  # lengths first: nothing is allocated
        hi = bytes_to_tensor(sparse.hi, torch.float32, groups, "sparse.hi")  # per group before the message has them
        counts = kept_counts(numel, group, keep)
        kept = int(counts.sum())
        index = unpack_fields(sparse.index, kept, index_bits(group), "sparse.index")
        codes = unpack_fields(sparse.codes, kept, bits, "sparse.codes")
        bound = decoded_bound(msg)
        if groups and not bool(((lo >= 0) & (lo <= hi) & (hi <= bound)).all()):  # NaN fails every comparison
            raise WireError("sparse.lo", f"each group needs 0 <= lo <= hi <= {bound:g} (finite)")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if groups else np.zeros(0, dtype=np.int64)
        group_of = np.repeat(np.arange(groups), counts)
        lengths = np.minimum(group, numel - np.arange(groups) * group) if groups else np.zeros(0, dtype=np.int64)
        if kept and (index >= lengths[group_of]).any():
            raise WireError("sparse.index", "an offset lies past its group's end")
        ascending = np.diff(index) > 0
        if kept > 1 and not ascending[np.setdiff1d(np.arange(kept - 1), starts[1:] - 1)].all():
            raise WireError("sparse.index", "offsets within a group must ascend strictly")
        codes_t, where = torch.from_numpy(codes), torch.from_numpy(group_of * group + index)
        levels, negative = codes_t & ((1 << (bits - 1)) - 1), codes_t >> (bits - 1)
        group_t = torch.from_numpy(group_of)
        out = torch.zeros(numel)
        out[where] = _signed(levels, negative, lo[group_t], hi[group_t], bits)
        return out


def _signed(levels, negative, lo, hi, bits) -> torch.Tensor:
    magnitude = dequantize_magnitudes(levels, lo, hi, bits)
    return torch.where(negative.bool(), -magnitude, magnitude)


CODECS = (TopKCodec,)
