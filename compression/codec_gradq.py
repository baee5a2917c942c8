"""GradQ: quantized activation gradients, optionally with error feedback on the sender.

Two options cut its bits (measured in scripts/measure_backward_codecs.py):
- `rotation="hadamard"` (`+rot`): each group is rotated by a seeded randomized Hadamard transform before
  quantizing (`swarm.compression.rotation`); the message carries `rotation` and `rotation_seed`, and the receiver
  un-rotates by them, whatever its own config says. Error feedback is computed in the original domain.
- `scale_dtype` "bfloat16" / "auto": the per-group (min, scale) pairs travel as 16-bit floats (32 bits a group
  instead of 64), stated per message in `Quantized.scale_dtype`.

Measured (session 21, default convergence model, 8 epochs, aqsgd2 forward, backward bits per gradient element
on the wire with scales, framing and zstd; held-out loss vs fp32): gradq4+ef@1024 3.62 bits +1.01%;
gradq2+ef@1024 1.63 bits +4.12%; gradq2+ef+nr@1024 1.40 +2.85%; gradq2+ef+rot+cs+nr@1024 1.44 +1.89%;
gradq2+ef+rot+nr@256 1.87 +0.97%; gradq2+ef+rot+cs+nr@256 1.70 +1.10% (+0.97% with 2 threads: the
run-to-run spread is about 0.1%). zstd takes 2-bit codes to ~1.3-1.5 bits; round-to-nearest beats stochastic
rounding once error feedback carries the bias; rotation helps with round-to-nearest, not with stochastic.
"""

from __future__ import annotations

import math

from swarm.compression import rotation as rot
from swarm.compression.codec_base import check_wire_finite, decoded_bound
from swarm.compression.codec_directq import DirectQCodec
from swarm.compression.quantized import (
    group_size,
    pack_quantized,
    quantize_compact,
    quantized_nbytes,
    unpack_quantized,
)
from swarm.compression.wire import WireError
from swarm.kernels import dequantize, packed_nbytes, quantize
from swarm.proto import wire_pb2

ROTATION_NONE, ROTATION_HADAMARD = 0, 1
"""`TensorMessage.rotation` values."""


class GradQCodec(DirectQCodec):
    """Quantized activation gradients; with error feedback, each micro-batch's quantization error is added to
    the next micro-batch's gradient within the same step (Optimus-CC's lazy error propagation)."""

    name, wire, error_feedback, rotates, compact_scales = "gradq", wire_pb2.GRADQ, True, True, True

    def payload_nbytes(self, numel: int) -> int:
        group = group_size(self.config)
        if self.config.rotation == "hadamard":
            numel = rot.padded_numel(numel, group)
        if self.config.scale_dtype == "float32":
            return quantized_nbytes(numel, self.config.bits, group)
        return packed_nbytes(numel, self.config.bits) + 4 * math.ceil(numel / group)

    def _encode_body(self, x, msg, state):
        use_feedback = self.config.error_feedback and state is not None
        if use_feedback and state.residual is not None and state.residual.shape == x.shape:
            x = x.float() + state.residual
        group = group_size(self.config)
        values, seed = x, None
        if self.config.rotation == "hadamard":
            seed = state.next_seed() if state is not None else None
            seed = seed if seed is not None else self.config.seed % (1 << 62)
            values = rot.rotate(x, group, seed)
            msg.rotation, msg.rotation_seed = ROTATION_HADAMARD, seed
        q, scale_dtype = self._quantize_values(values, group, state)
        if use_feedback:
            sent = dequantize(q)
            if seed is not None:
                sent = rot.unrotate(sent, group, seed, x.numel())
            state.residual = x.float() - sent.view(x.shape)
        pack_quantized(q, msg.quantized, scale_dtype)

    def _quantize_values(self, values, group, state):
        cfg = self.config
        seed = state.next_seed() if state is not None else None
        if cfg.scale_dtype == "float32":
            return quantize(values, cfg.bits, group, stochastic=cfg.stochastic, seed=seed), None
        return quantize_compact(values, cfg.bits, group, cfg.scale_dtype, stochastic=cfg.stochastic, seed=seed)

    def _decode_body(self, msg, numel, state):
        if msg.rotation == ROTATION_NONE:
            if msg.rotation_seed:
                raise WireError("rotation_seed", "set on a message without rotation")
            return super()._decode_body(msg, numel, state)
        if msg.rotation != ROTATION_HADAMARD:
            raise WireError("rotation", f"unknown rotation {msg.rotation}")
        group = msg.quantized.group_size
        try:
            rot.check_group(group)
        except ValueError as e:
            raise WireError("quantized.group_size", str(e)) from None
        # each un-rotated value sums `group` rotated ones over sqrt(group): bound the rotated domain accordingly
        bound = decoded_bound(msg) / math.sqrt(group)
        q = unpack_quantized(msg.quantized, rot.padded_numel(numel, group), "quantized", bound)
        out = rot.unrotate(dequantize(q), group, msg.rotation_seed, numel)
        check_wire_finite(out, "quantized.scales")  # float32 rounding at the very edge of the bound
        return out


CODECS = (GradQCodec,)
