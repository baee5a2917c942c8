"""ACSGD: AQ-SGD's buffer protocol with the AQ-SGD paper's own quantizer: one fp16 max-abs scale per group and a
symmetric grid with a zero level (DS3Lab/AC-SGD's `compress/fixpoint.py`, written from its description).

Why: on deltas captured from the default model (`swarm bench codecs --deltas model`, 2 bits) `acsgd2+ch` has
the relative error of `aqsgd2+ch` (0.369 against 0.358) in 15% fewer payload + scale bytes (0.266 against
0.3125 B/element: one 2-byte scale per group instead of a 4-byte min and a 4-byte scale) and 22% fewer zstd-framed
bytes; against the experiment's `aqsgd2` (flat groups of 128) it has 20% less error in 15% fewer bytes.

Codes: `c = clip(round(v / step), -2^(b-1), 2^(b-1) - 1) + 2^(b-1)` with `step = scale / 2^(b-1)`, `scale` the
group's max |v| in fp16 (clamped to fp16's largest finite value); decoded `(c - 2^(b-1)) * step`, exact in
float32 (an fp16 scale over a power of two, times a small integer), so both ends' buffers agree bit for bit.
The top of the grid is one step below +scale, as in the paper: the largest positive value of a group clips.
The groups follow `group_layout` (`+ch`: one per channel of a sample across its tokens, the paper's layout).
On the wire: `Quantized` with `scale_dtype` FLOAT16, `scales` one per group, `mins` empty.

First sights (`first_sight_bits` below 16, label `+fsN`) travel quantized directly with the same quantizer, in
the same groups (channel-wise with `+ch`). With `+rot` they travel instead in token order, one group per token
of a [B, T, D] message (D a power of two), each token's D values rotated by a seeded randomized Hadamard transform
first (`TensorMessage.rotation` 1, `rotation_seed`; `quantized_full.group_size` = D; deltas are never rotated):
the rotation spreads a loud channel over the token's values, TAH-Quant's way. Groups never span tokens, so a
position's decoded value depends on no later position: rotating a channel across its tokens instead measured +2.4%
held-out loss at 2 bits in a single pass (a causal model learns to read the future from the error). Both ends
buffer what the receiver decodes (`rotation.unrotate_grid`, exact integer butterflies then one float32 product
per element), so their buffers stay bit-identical and the next visit's delta is taken against it.

With `+clip` the sender picks each first-sight group's scale by least squared error below its max |x|
(`compression.clipping`): the same wire, the same decoding, only the scales differ.

With `+fslR` (and its step `+sN`) first sights travel subspace-coded instead (`compression.subspace`): the
message's first-sight rows, one row per token ([B' x T, D] for B' new samples of T tokens), in the top-R
eigenbasis of their own Gram matrix. `first_sight_basis` carries the basis Q (D x R) and `quantized_full` the
coefficients P (B'T x R), both as int8 columns with fp32 steps (`compression.factors`), decoded as P Q^T in the
sample's own layout. The residual stream's channels are strongly correlated (10 of 128 directions hold 90% of its
energy at hidden 128), so this has a third of 3-bit channel-scaled first sights' error in about half their bytes.
A sample's later visits are 2-bit deltas against what the receiver decoded, as for any first sight.

With `+dslR` (on the same step `+sN`) those later visits are subspace-coded too: the change of the message's delta
samples against the buffers, a row per token, in the top-R eigenbasis of its own Gram matrix (`delta_basis` the
basis, `quantized` the coefficients), added to both ends' buffers in fp32 and cast to the buffer dtype. A change
between visits is a step of training, concentrated in few directions as the activations are: captured from the
8-epoch run of the default model, rank 16 took 0.99 bits an element where 2-bit channel deltas took 1.76, at a
lower error of the decoded activation (docs/reports/single-pass.md).
"""

from __future__ import annotations

import math

import torch

from swarm.compression import rotation as rot
from swarm.compression.clipping import clipped_quantize
from swarm.compression.codec_aqsgd import AQSGDCodec, _check_bounded
from swarm.compression.factors import MAX_RANK
from swarm.compression.layout import FLAT, from_groups, read_layout, to_groups
from swarm.compression.quantized import group_size
from swarm.compression.subspace import GRAM_ITERATIONS, decode_subspace, encode_subspace
from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, wire_dtype
from swarm.kernels import SymQuantized, packed_nbytes, sym_apply_delta, sym_update, symmetric
from swarm.kernels import sym_dequantize as sym_dequantize_packed
from swarm.kernels import sym_quantize as sym_quantize_packed
from swarm.kernels.host_copy import to_host
from swarm.kernels.reference import unpack
from swarm.proto import wire_pb2

FP16_MAX = symmetric.FP16_MAX


class ACSGDCodec(AQSGDCodec):
    """AQ-SGD with the paper's quantizer: fp16 max-abs scale per group, symmetric grid with zero (module doc)."""

    name, wire = "acsgd", wire_pb2.ACSGD
    device_encoded = True  # the symmetric quantizer and the fused update have CUDA kernels
    rotates = True  # first sights only (module doc)
    clipped_first_sights = True  # `+clip`: the sender searches each first-sight group's scale (module doc)
    subspace_first_sights = True  # `+fslR`: first sights in their own eigenbasis (module doc)
    subspace_deltas = True  # `+dslR`: later visits' changes in their own eigenbasis too (module doc)

    def payload_nbytes(self, numel: int) -> int:
        return packed_nbytes(numel, self.config.bits) + 2 * math.ceil(numel / group_size(self.config))

    def _pack(self, x: torch.Tensor, bits: int, group: int, state, out: wire_pb2.Quantized) -> torch.Tensor:
        q = sym_quantize_packed(x, bits, group, stochastic=self.config.stochastic, seed=_seed(state))
        _write(q, out)
        return sym_dequantize_packed(q)

    def _unpack(self, msg: wire_pb2.Quantized, numel: int, field: str, bound: float) -> SymQuantized:
        """The checked codes and scales of `msg`: every length and bound before a byte is interpreted."""
        if msg.bits not in (2, 3, 4, 8):
            raise WireError(f"{field}.bits", f"unsupported bit width {msg.bits}")
        if not 1 <= msg.group_size <= 65536:
            raise WireError(f"{field}.group_size", f"{msg.group_size} is outside 1..65536")
        if msg.numel != numel:
            raise WireError(f"{field}.numel", f"{msg.numel} does not match the {numel} elements the shape implies")
        if msg.scale_dtype != wire_pb2.FLOAT16 or msg.mins:
            raise WireError(f"{field}.scale_dtype", "acsgd carries fp16 scales and no mins")
        if len(msg.payload) != packed_nbytes(numel, msg.bits):
            raise WireError(f"{field}.payload", f"{len(msg.payload)} bytes for {numel} x {msg.bits} bits")
        scales = bytes_to_tensor(msg.scales, torch.float16, math.ceil(numel / msg.group_size), f"{field}.scales")
        if scales.numel() and not bool(torch.isfinite(scales).all() and (scales >= 0).all()):
            raise WireError(f"{field}.scales", "contains NaN, Inf or a negative scale")
        if scales.numel() and float(scales.float().max()) > bound:
            raise WireError(f"{field}.scales", f"a group's values would exceed {bound:.6g} in magnitude")
        packed = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8) if msg.payload else _EMPTY
        return SymQuantized(packed, scales, msg.bits, msg.group_size, numel)

    def _send_delta(self, rows, m, group, state, msg):
        cfg = self.config
        if cfg.delta_rank:  # rows and m in the sample's own layout: a row per token
            width = _width(list(msg.shape), m.numel())
            change = rows.reshape(-1, width).float() - m.view(-1, width).float()  # coded on the host
            r = min(cfg.delta_rank, *change.shape)
            sent = encode_subspace(  # the basis by subspace iteration: a third of eigh's time
                change, r, cfg.subspace_step_percent, msg.quantized, msg.delta_basis, iterations=GRAM_ITERATIONS
            )
            m.copy_(_moved(m, sent))
            return
        # one fused pass: delta = rows - m, its codes, m += deQ(codes), on the kernels of m's device
        q = sym_update(rows, m, cfg.bits, group, stochastic=cfg.stochastic, seed=_seed(state))
        _write(q, msg.quantized)

    def _receive_delta(self, msg, m, bound):
        if not msg.HasField("delta_basis"):
            return sym_apply_delta(m, self._unpack(msg.quantized, m.numel(), "quantized", bound))
        width = _width(list(msg.shape), m.numel())
        decoded = decode_subspace(
            msg.quantized, msg.delta_basis, m.numel() // width, width, MAX_RANK, ("quantized", "delta_basis")
        )  # fmt: skip
        _check_bounded(decoded, bound, "quantized.scales")  # a change at most twice what the buffers hold
        return _moved(m, decoded)

    def _first_sight(self, x, state, msg, layout, group):
        cfg = self.config
        if not (cfg.first_sight_rank or cfg.first_sight_width_divisor) or state.exact_first_sights:
            return super()._first_sight(x, state, msg, layout, group)
        width = x.shape[-1] if x.dim() >= 2 else x.numel()
        grown = width // cfg.first_sight_width_divisor if cfg.first_sight_width_divisor else 0
        rank = min(MAX_RANK, max(1, cfg.first_sight_rank, grown))  # `+fslR` the least, `+fslwN` grows with the width
        rows = x.numel() // width if width else 0
        msg.raw_dtype = wire_dtype(state.buffers.dtype)
        if not rows:
            return x.to(state.buffers.dtype)
        r = min(rank, rows, width)
        mat = x.reshape(rows, width)
        sent = encode_subspace(
            mat, r, cfg.subspace_step_percent, msg.quantized_full, msg.first_sight_basis,
            most=min(MAX_RANK, rows, width), leave_out=cfg.first_sight_energy / 10_000,
        )  # fmt: skip
        return sent.view(x.shape).to(device=x.device, dtype=state.buffers.dtype)

    def _first_layout(self, msg, layout):
        return FLAT if msg.HasField("first_sight_basis") else super()._first_layout(msg, layout)

    def _decode_first(self, msg, n, dtype, bound):
        if not msg.HasField("first_sight_basis"):
            return super()._decode_first(msg, n, dtype, bound)
        shape = list(msg.shape)
        width = shape[-1] if len(shape) >= 2 else n
        if not msg.HasField("quantized_full") or not width or n % width:
            raise WireError("first_sight_basis", f"subspace-coded first sights of {n} elements in rows of {width}")
        decoded = decode_subspace(
            msg.quantized_full, msg.first_sight_basis, n // width, width, MAX_RANK,
            ("quantized_full", "first_sight_basis"),
        ).reshape(-1)  # fmt: skip
        _check_bounded(decoded, bound, "quantized_full.scales")  # in fp32, before the cast to the buffers' dtype
        return decoded.to(dtype)

    def _send_full(self, x, group, state, msg):
        cfg, bits, shape = self.config, self.config.first_sight_bits, list(msg.shape)
        width = _token_width(cfg.rotation == "hadamard", shape)
        if width is None:
            if cfg.first_sight_clip:
                q = clipped_quantize(x, bits, group)
                _write(q, msg.quantized_full)
                return sym_dequantize_packed(q)
            return self._pack(x, bits, group, state, msg.quantized_full)
        # rotated first sights travel in token order, one group per token: never mixing tokens, so a position's
        # decoded value depends on no later position (a causal model could learn to read the future from it)
        layout = read_layout(msg, shape)
        tokens = from_groups(x, layout, [x.numel() // (shape[1] * width), shape[1], width]).view(-1)
        seed = cfg.seed % (1 << 62)  # the rotation need not change per message: it only spreads outliers
        rotated = rot.rotate(tokens, width, seed)
        if cfg.first_sight_clip:
            q = clipped_quantize(rotated, bits, width)
        else:
            q = sym_quantize_packed(rotated, bits, width, stochastic=cfg.stochastic, seed=_seed(state))
        _write(q, msg.quantized_full)
        msg.rotation, msg.rotation_seed = ROTATION_HADAMARD, seed
        decoded = _unrotate(q, seed).view(-1, shape[1], width)  # what the receiver decodes, bit for bit
        return to_groups(decoded, layout).view(-1)

    def _receive_full(self, msg, n, bound):
        if msg.rotation == ROTATION_NONE:
            return sym_dequantize_packed(self._unpack(msg.quantized_full, n, "quantized_full", bound))
        shape = list(msg.shape)
        width = _token_width(True, shape)
        if width is None or msg.quantized_full.group_size != width:
            raise WireError("rotation", f"rotated first sights are groups of one token's values, shape {shape}")
        # rotated values reach sqrt(group) times the largest decoded one: the decoded values are checked after
        q = self._unpack(msg.quantized_full, n, "quantized_full", FP16_MAX)
        decoded = _unrotate(q, msg.rotation_seed).view(-1, shape[1], width)
        return to_groups(decoded, read_layout(msg, shape)).view(-1)

    def _decode_body(self, msg, numel, state):
        if msg.HasField("first_sight_basis") and msg.rotation:
            raise WireError("rotation", "subspace-coded first sights are never rotated")
        if msg.rotation not in (ROTATION_NONE, ROTATION_HADAMARD):
            raise WireError("rotation", f"unknown rotation {msg.rotation}")
        if msg.rotation == ROTATION_NONE and msg.rotation_seed:
            raise WireError("rotation_seed", "set on a message without rotation")
        if msg.rotation and not msg.HasField("quantized_full"):
            raise WireError("rotation", "only quantized first sights are rotated, and this message has none")
        return super()._decode_body(msg, numel, state)


_EMPTY = torch.empty(0, dtype=torch.uint8)
ROTATION_NONE, ROTATION_HADAMARD = 0, 1
"""`TensorMessage.rotation` values (gradq's)."""


def _token_width(asked: bool, shape: list[int]) -> int | None:
    """The group of rotated first sights, one token's values (the last dim of a [B, T, D] message), or None where
    they travel unrotated: not asked, not 3-D, or D not a power of two the rotation takes (the message says so)."""
    if not asked or len(shape) != 3 or not shape[1]:
        return None
    width = shape[2]
    return width if 2 <= width <= rot.MAX_ROTATION_GROUP and rot.is_power_of_two(width) else None


def _unrotate(q: SymQuantized, seed: int) -> torch.Tensor:
    """The un-rotated first sights of `q`, float32, the same bits on every device (`rotation.unrotate_grid`)."""
    half = 1 << (q.bits - 1)
    codes = unpack(q.packed, q.bits, q.numel).to(torch.int32) - half
    return rot.unrotate_grid(codes, q.scales.float() / half, q.group_size, seed)


def _width(shape: list[int], numel: int) -> int:
    """A subspace-coded message's row width: the tensor's last dimension (a token's values); checked to divide
    `numel`, the delta samples' elements."""
    width = shape[-1] if len(shape) >= 2 else 0
    if not width or numel % width:
        raise WireError("delta_basis", f"subspace-coded deltas of {numel} elements in rows of {width}, shape {shape}")
    return width


def _moved(m: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
    """`m` (the buffers' dtype, on its device) plus a decoded subspace change (fp32, on the host), in float32 then
    cast: the same bits on both ends of a link."""
    return (m.float() + change.reshape(m.shape).to(m.device)).to(m.dtype)


def _seed(state) -> int | None:
    return state.next_seed() if state is not None else None


def _write(q: SymQuantized, out: wire_pb2.Quantized) -> None:
    """Only the packed codes and scales leave the device (one copy each)."""
    out.bits, out.group_size, out.numel = q.bits, q.group_size, q.numel
    out.scale_dtype = wire_dtype(torch.float16)
    packed, scales = to_host(q.packed, q.scales)
    out.scales = tensor_to_bytes(scales)
    out.payload = packed.numpy().tobytes()


CODECS = (ACSGDCodec,)
