"""GTERN: ternary activation gradients, `{-s, 0, +s}` per (Hadamard-rotated) group, with a rate weight and error
feedback: gsign's message with TERN's quantizer and packing.

Why: at the bytes that matter the 2-bit min-max grid wastes its codes. On rotated Gaussian rows with heavy-tailed
channel scales (groups of 1024, zstd-1; `swarm bench codecs` has the row) gradq2+rot+nr moves 1.44 bits an
element at a relative squared error of 0.39, the scaled sign (gsign) 1.02 bits at 0.36, while ternary codes that
zero what buys least (`+rN`, TERN's rate weight: keep the k of each group that maximize
`c_k^2 / k - rate * mean(v^2) * k`) sit on a better curve: r0 1.54 bits at 0.19, r75 1.23 at 0.26, r100 1.11 at
0.31, r150 0.96 at 0.40. zstd takes the base-3 bytes to within 2% of their order-0 entropy: the zeros are what
shrink. The error feedback carries what a code leaves out into the next micro-batch of the step, as gradq's.
In `swarm experiment convergence` (8 epochs, forward `tern+ch+r75`, seeds 0 / 1) the backward moved 37.6 KB a step
at r100 (+1.70% / +1.86% held-out, 19.0x fewer total bytes after epoch 1) and 32.4 KB at r150 (+2.30% / +1.67%,
20.05x), against gradq2's 43.9 KB (+1.66%, 18.0x); r200 27 KB at +7.35%.

On the wire: as gsign's, with `bits` 0 and `payload` ceil(numel / 5) bytes, five codes a byte, base 3, the
first code least significant (`codec_tern.pack_trits`; a byte >= 243 or a nonzero padding code is refused), one
fp16 scale (the kept codes' mean |v|) per group; a group whose scale is 0 sends only zero codes.
"""

from __future__ import annotations

import math

from swarm.compression.codec_gsign import GSignCodec
from swarm.compression.codec_tern import (
    TRITS_PER_BYTE,
    pack_trits,
    ternary_dequantize,
    ternary_quantize,
    unpack_trits,
)
from swarm.proto import wire_pb2


class GTernCodec(GSignCodec):
    """Ternary activation gradients with a rate weight (`+rN`), rotation (`+rot`), error feedback (`+ef`)."""

    name, wire, rated = "gtern", wire_pb2.GTERN, True
    code_bits = 0

    @classmethod
    def wire_bits(cls, config) -> int:
        return 2  # the planner's integer figure: never below what the codes (1.6 bits packed) and scales take

    @classmethod
    def nominal_bits(cls, config) -> float:
        return 8 / TRITS_PER_BYTE  # 5 ternary codes a byte

    def _code_nbytes(self, numel: int) -> int:
        return math.ceil(numel / TRITS_PER_BYTE)

    def _quantize(self, values, group):
        return ternary_quantize(values, group, self.config.rate_percent / 100)

    def _dequantize(self, codes, scales, group):
        return ternary_dequantize(codes, scales, group)

    def _pack(self, codes):
        return pack_trits(codes)

    def _unpack(self, payload, numel, field):
        return unpack_trits(payload, numel, field)


CODECS = (GTernCodec,)
