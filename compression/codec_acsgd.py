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
"""

from __future__ import annotations

import math

import torch

from swarm.compression.codec_aqsgd import AQSGDCodec
from swarm.compression.quantized import group_size
from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, wire_dtype
from swarm.kernels import SymQuantized, packed_nbytes, sym_apply_delta, sym_update, symmetric
from swarm.kernels import sym_dequantize as sym_dequantize_packed
from swarm.kernels import sym_quantize as sym_quantize_packed
from swarm.kernels.host_copy import to_host
from swarm.proto import wire_pb2

FP16_MAX = symmetric.FP16_MAX


class ACSGDCodec(AQSGDCodec):
    """AQ-SGD with the paper's quantizer: fp16 max-abs scale per group, symmetric grid with zero (module doc)."""

    name, wire = "acsgd", wire_pb2.ACSGD
    device_encoded = True  # the symmetric quantizer and the fused update have CUDA kernels

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

    def _send_delta(self, rows, m, group, state, out):
        # one fused pass: delta = rows - m, its codes, m += deQ(codes), on the kernels of m's device
        q = sym_update(rows, m, self.config.bits, group, stochastic=self.config.stochastic, seed=_seed(state))
        _write(q, out)

    def _receive_delta(self, msg, m, bound):
        return sym_apply_delta(m, self._unpack(msg, m.numel(), "quantized", bound))

    def _send_full(self, x, group, state, out):
        return self._pack(x, self.config.first_sight_bits, group, state, out)

    def _receive_full(self, msg, n, bound):
        return sym_dequantize_packed(self._unpack(msg, n, "quantized_full", bound))


_EMPTY = torch.empty(0, dtype=torch.uint8)


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
