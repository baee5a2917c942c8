"""SIGN: AQ-SGD's buffer protocol with a 1-bit delta, `sign(v) * s` with `s` the group's mean |v|.

Why: zstd cannot shrink it (one incompressible bit per element, against 1.35-1.65 bits for acsgd's 2-bit
codes after zstd), so it is the forward codec with the fewest bytes; the error it leaves (about 60% of a
Gaussian delta's norm, against 37% for acsgd2) stays in `x - m` and travels with the sample's next delta:
AQ-SGD's buffer is the error feedback, as in EF-signSGD.

Quantizer (per group, deterministic): `s = mean |v|` in fp16 (the MSE-optimal scale for fixed signs, clamped
to fp16's largest finite value), codes `v >= 0`; decoded `(2 * code - 1) * s`, exact in float32.

On the wire: `Quantized` with `bits` 1, `scale_dtype` FLOAT16, `scales` one per group, `mins` empty, `payload`
ceil(numel / 8) bytes, the codes' bits least significant first (numpy's `packbits(bitorder="little")`),
padding bits zero (a set padding bit is refused). First sights travel as acsgd's do.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm.compression.codec_acsgd import FP16_MAX
from swarm.compression.codec_tern import LowBitDeltaCodec, group_view
from swarm.compression.quantized import group_size
from swarm.compression.wire import WireError
from swarm.proto import wire_pb2


def sign_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, -1 or +1, flattened to `x.numel()`) and fp16 scales: each group's mean |v| (padding
    excluded from the last group's mean)."""
    g = group_view(x, group)
    counts = torch.full((g.shape[0],), float(group))
    if x.numel() % group:
        counts[-1] = x.numel() % group
    scale = (g.abs().sum(1) / counts).clamp(max=FP16_MAX).half()
    codes = torch.where(g >= 0, 1, -1).to(torch.int8)
    return codes.reshape(-1)[: x.numel()], scale


def pack_signs(codes: torch.Tensor) -> bytes:
    return np.packbits(codes.reshape(-1).numpy() > 0, bitorder="little").tobytes()


def unpack_signs(payload: bytes, numel: int, field: str = "quantized.payload") -> torch.Tensor:
    """The inverse of `pack_signs`: `numel` int8 codes (-1, +1); a wrong length or a set padding bit is a
    WireError."""
    expected = math.ceil(numel / 8)
    if len(payload) != expected:
        raise WireError(field, f"{len(payload)} bytes, expected {expected} for {numel} sign codes")
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little")
    if bits[numel:].any():
        raise WireError(field, "padding bits past the last code are set")
    return torch.from_numpy(bits[:numel].astype(np.int8) * 2 - 1)


class SignCodec(LowBitDeltaCodec):
    """AQ-SGD with 1-bit sign deltas scaled by each group's mean |v| (module doc)."""

    name, wire = "sign", wire_pb2.SIGN
    wire_code_bits = 1

    @classmethod
    def wire_bits(cls, config) -> int:
        return 1

    def payload_nbytes(self, numel: int) -> int:
        return math.ceil(numel / 8) + 2 * math.ceil(numel / group_size(self.config))

    def _codes(self, x, group):
        return sign_quantize(x, group)

    def _pack_codes(self, codes):
        return pack_signs(codes)

    def _unpack_codes(self, payload, numel, field):
        return unpack_signs(payload, numel, field)


CODECS = (SignCodec,)
