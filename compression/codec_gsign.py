"""GSIGN: 1-bit activation gradients, the scaled sign of each (Hadamard-rotated) group, with error feedback.

Why: after the first epoch the backward boundary was a third of the best setting's bytes, gradq2+ef+rot+nr+cs at
about 1.44 bits an element after zstd. A rotated group of 1024 is close to Gaussian, and on such a group the
min-max 2-bit grid and the scaled sign lose about the same share of its energy (measured on rotated Gaussian
rows with heavy-tailed channel scales: relative squared error 0.39 for gradq2 with round-to-nearest at
groups of 1024, 0.36 for the scaled sign), while the sign takes 1 bit an element plus one fp16 scale per group,
and zstd finds nothing in random signs. The error feedback (1-bit Adam's, EF-signSGD's) carries what the sign
leaves out into the next micro-batch of the same step, as gradq's does. In `swarm experiment convergence` (seed 0,
8 epochs, forward `tern+ch+r75`) `gsign+ef+rot+nr` moved 34 KB a step against gradq2's 44 KB, at +2.42% held-out
against +1.66% (19.8x fewer total bytes after epoch 1 against 18.0x); with fresh rotations (no `+nr`) worse.
`gtern` (this message with ternary codes and a rate weight) is on a better curve and builds on this class.

Quantizer (per group, deterministic): code `b = v < 0`, scale `s = mean |v|` in fp16 (clamped to fp16's
largest finite value): the MSE-optimal scale for a given sign pattern. Decoded `(1 - 2 b) * s`; a group whose
scale is 0 sends all codes 0 (the only canonical encoding of it).

On the wire: `Quantized` with `bits` 1, `group_size` the group, `numel` the coded elements (with `+rot` the
tensor zero-padded to whole groups, as gradq's), `scale_dtype` FLOAT16, `scales` one per group, `mins` empty,
`payload` ceil(numel / 8) bytes, 8 codes a byte, least significant first, padding bits 0. `rotation` and
`rotation_seed` as gradq's. Anything else (a padding bit, a code set in a zero-scale group, a negative, NaN or
out-of-bound scale, mins, another bit width) is refused.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from swarm.compression import rotation as rot
from swarm.compression.codec_base import Codec, check_wire_finite, decoded_bound
from swarm.compression.codec_bilevel import pack_bits, unpack_bits
from swarm.compression.codec_gradq import ROTATION_HADAMARD, ROTATION_NONE
from swarm.compression.codec_tern import check_levels, group_view
from swarm.compression.quantized import group_size
from swarm.compression.wire import WireError, tensor_to_bytes, wire_dtype
from swarm.proto import wire_pb2

FP16_MAX = float(torch.finfo(torch.float16).max)


def sign_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (bool, True = negative, flattened to `x.numel()`) and fp16 scales (mean |v| of each `group`)."""
    g = group_view(x, group)
    count = torch.full((g.shape[0],), float(group))
    tail = x.numel() % group
    if tail:  # the last group's zero padding does not dilute its mean
        count[-1] = tail
    scales = (g.abs().sum(1) / count).clamp(max=FP16_MAX).half()
    codes = (g < 0) & (scales > 0)[:, None]
    return codes.reshape(-1)[: x.numel()], scales


def sign_dequantize(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """`(1 - 2 code) * scale` per element, float32, exact."""
    return (1.0 - 2.0 * codes.float()) * scales.float().repeat_interleave(group)[: codes.numel()]


class GSignCodec(Codec):
    """Scaled-sign activation gradients, optionally Hadamard-rotated (`+rot`) and with error feedback (`+ef`)."""

    name, wire, error_feedback, rotates = "gsign", wire_pb2.GSIGN, True, True

    @classmethod
    def wire_bits(cls, config) -> int:
        return 1

    @classmethod
    def nominal_bits(cls, config) -> float:
        return 1

    @classmethod
    def sum_config(cls, config):
        """Gradient sums keep gradq's bit floors (`GradientAverager.min_bits`, `tied_min_bits`): the same rotation,
        rounding and groups, 16-bit scales. A sign has no bit width to raise, and the tied sum's error feedback
        carries across steps, where 1 bit was not measured."""
        return dataclasses.replace(config, name="gradq", bits=2, scale_dtype="auto", rate_percent=0)

    code_bits = 1
    """`Quantized.bits` of its messages."""

    def payload_nbytes(self, numel: int) -> int:
        group = group_size(self.config)
        if self.config.rotation == "hadamard":
            numel = rot.padded_numel(numel, group)
        return self._code_nbytes(numel) + 2 * math.ceil(numel / group)

    # the code: a subclass (gtern) swaps these five
    def _code_nbytes(self, numel: int) -> int:
        return math.ceil(numel / 8)

    def _quantize(self, values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sign_quantize(values, group)

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
        return sign_dequantize(codes, scales, group)

    def _pack(self, codes: torch.Tensor) -> bytes:
        return pack_bits(codes.to(torch.uint8))

    def _unpack(self, payload: bytes, numel: int, field: str) -> torch.Tensor:
        return unpack_bits(payload, numel, field)

    def _encode_body(self, x, msg, state):
        use_feedback = self.config.error_feedback and state is not None
        x = x.float()  # one fp32 copy at most (none for an fp32 gradient)
        if use_feedback and state.residual is not None and state.residual.shape == x.shape:
            x = x + state.residual
        group = group_size(self.config)
        values, seed = x.reshape(-1), None
        if self.config.rotation == "hadamard":
            # as gradq's: a fresh seeded rotation per message unless `+nr` (the sign itself draws nothing)
            seed = state.next_seed() if state is not None else None
            seed = seed if seed is not None else self.config.seed % (1 << 62)
            values = rot.rotate(x, group, seed)
            msg.rotation, msg.rotation_seed = ROTATION_HADAMARD, seed
        codes, scales = self._quantize(values, group)
        q = msg.quantized
        q.bits, q.group_size, q.numel = self.code_bits, group, values.numel()
        q.scale_dtype = wire_dtype(torch.float16)
        q.scales = tensor_to_bytes(scales)
        q.payload = self._pack(codes)
        if use_feedback:
            sent = self._dequantize(codes, scales, group)
            if seed is not None:
                sent = rot.unrotate(sent, group, seed, x.numel())
            state.residual = x - sent.view(x.shape)

    def _decode_body(self, msg, numel, state):
        q, field = msg.quantized, "quantized"
        if msg.rotation not in (ROTATION_NONE, ROTATION_HADAMARD):
            raise WireError("rotation", f"unknown rotation {msg.rotation}")
        if msg.rotation == ROTATION_NONE and msg.rotation_seed:
            raise WireError("rotation_seed", "set on a message without rotation")
        if q.bits != self.code_bits:
            raise WireError(f"{field}.bits", f"{q.bits}, this codec's codes say {self.code_bits}")
        if not 1 <= q.group_size <= 65536:
            raise WireError(f"{field}.group_size", f"{q.group_size} is outside 1..65536")
        bound = decoded_bound(msg)
        coded = numel
        if msg.rotation == ROTATION_HADAMARD:
            try:
                rot.check_group(q.group_size)
            except ValueError as e:
                raise WireError(f"{field}.group_size", str(e)) from None
            coded = rot.padded_numel(numel, q.group_size)
            bound = bound / math.sqrt(q.group_size)  # an un-rotated value sums group values over sqrt(group)
        if q.numel != coded:
            raise WireError(f"{field}.numel", f"{q.numel}, expected {coded} coded elements")
        if q.scale_dtype != wire_pb2.FLOAT16:
            raise WireError(f"{field}.scale_dtype", "the codes carry fp16 scales")
        if q.mins:
            raise WireError(f"{field}.mins", "the codes carry no mins")
        groups = math.ceil(coded / q.group_size)
        scales = check_levels(q.scales, groups, f"{field}.scales", bound)
        if bool((scales < 0).any()):
            raise WireError(f"{field}.scales", "a negative scale")
        codes = self._unpack(q.payload, coded, f"{field}.payload")
        zero = (scales == 0).repeat_interleave(q.group_size)[:coded]
        if bool(((codes != 0) & zero).any()):
            raise WireError(f"{field}.payload", "a code set in a group whose scale is 0")
        out = self._dequantize(codes, scales, q.group_size)
        if msg.rotation == ROTATION_HADAMARD:
            out = rot.unrotate(out, q.group_size, msg.rotation_seed, numel)
            check_wire_finite(out, f"{field}.scales")
        return out


CODECS = (GSignCodec,)
