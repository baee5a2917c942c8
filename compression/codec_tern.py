"""TERN: AQ-SGD's buffer protocol with a ternary delta, `{-s, 0, +s}` per group, packed 5 trits to a byte.

Why: the forward boundary is the largest share of a step's bytes after the first epoch, and zstd already
brings the 2-bit acsgd codes to their order-0 entropy, so only a smaller alphabet (or a worse error) shrinks
them further. A ternary code is log2(3) = 1.58 bits of alphabet, 1.6 bits packed, one fp16 scale per group.
Measured: on AQ-SGD deltas captured from the default model (channel groups, zstd-1) relative error 0.326 at
1.39 bits an element against acsgd2's 0.329 at 1.57; in `swarm experiment convergence` (`tern+ch` forward,
the default backward) 55 KB of forward bytes a step after epoch 1 against 60 KB, 16.7x fewer total bytes than
fp32 against 15.9x, held-out +1.02% / +0.79% vs fp32 (seeds 0 / 1; the default +0.83% / +0.61%). With a rate
weight (`+rN`, `CodecConfig.rate_percent`) the encoder zeroes the codes that buy least: `tern+ch+r25` 52 KB,
17.1x, +1.21% / +0.97%; `tern+ch+r50` 49 KB, 17.5x, +1.49% / +0.86%; `tern+ch+r75` 46 KB, 18.1x,
+1.66% / +1.20%.

Quantizer (per group, deterministic): the MSE-optimal ternary code. Keeping the k largest |v| of a group at
`+-s` and zeroing the rest costs `sum v^2 - (sum of the k largest |v|)^2 / k` at the best `s` (their mean
|v|), so `k` is the argmax of `c_k^2 / k` over the sorted cumulative sums `c_k`, and `s = c_k / k` in fp16
(clamped to fp16's largest finite value). Decoded `trit * s`, exact in float32, so both ends' buffers agree
bit for bit. What the code leaves out stays in `x - m` and travels with the sample's next delta (AQ-SGD's
buffer is the error feedback).

On the wire: `Quantized` with `bits` 0 (unset), `scale_dtype` FLOAT16, `scales` one per group, `mins` empty,
`payload` ceil(numel / 5) bytes, each byte `sum_i (t_i + 1) * 3^i` of five consecutive codes (< 243; a byte
of 243 or more is refused), the last byte's padding codes zero (refused otherwise). First sights travel as acsgd's do,
or with `+fsd` (`CodecConfig.first_sight_delta_code`) in this same ternary code in `quantized_full` (`bits` 0), a
delta against zero with the rate weight of the deltas: on activations captured from the default model, channel
groups, relative error 0.337 at 0.170 wire bytes an element against acsgd2's 0.338 at 0.209 (docs/reports/codecs.md).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm.compression.codec_acsgd import FP16_MAX, ACSGDCodec
from swarm.compression.quantized import group_size
from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, wire_dtype
from swarm.kernels import all_finite
from swarm.proto import wire_pb2

TRITS_PER_BYTE = 5
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_TRITS = np.array([[(b // 3**i) % 3 for i in range(TRITS_PER_BYTE)] for b in range(243)], dtype=np.int8) - 1
"""The five codes (-1, 0, 1) of each valid byte value, the decoder's lookup table."""


def group_view(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x` flattened (float32) as rows of `group` elements, the last zero-padded."""
    v = x.detach().float().reshape(-1)
    pad = (-v.numel()) % group
    return (torch.cat([v, v.new_zeros(pad)]) if pad else v).view(-1, group)


def ternary_quantize(x: torch.Tensor, group: int, rate: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8 in -1..1, flattened to `x.numel()`) and fp16 scales (one per `group` consecutive elements):
    the MSE-optimal ternary code of each group (module doc); with `rate` > 0 each group keeps the k that
    maximizes `c_k^2 / k - rate * mean(x^2) * k` (a group where no k gains anything sends zeros)."""
    g = group_view(x, group)
    mag, order = g.abs().sort(dim=1, descending=True)
    csum = mag.cumsum(1)
    k = torch.arange(1, group + 1, dtype=torch.float32)
    gain = csum.square() / k
    if rate > 0:
        gain = gain - rate * float(x.detach().float().square().mean()) * k
    best = gain.argmax(1)  # keep best + 1 elements
    worthwhile = gain.gather(1, best[:, None])[:, 0] > 0
    scale = (csum.gather(1, best[:, None])[:, 0] / (best + 1).float()).clamp(max=FP16_MAX).half()
    keep_sorted = torch.arange(group)[None, :] <= best[:, None]
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    keep &= ((scale > 0) & worthwhile)[:, None]
    codes = torch.where(keep, torch.sign(g), torch.zeros_like(g)).to(torch.int8)
    return codes.reshape(-1)[: x.numel()], scale


def ternary_dequantize(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """`code * scale` per element, float32, exact."""
    return codes.float() * scales.float().repeat_interleave(group)[: codes.numel()]


def pack_trits(codes: torch.Tensor) -> bytes:
    """Codes in -1..1 packed five to a byte, base 3, the first code least significant."""
    t = (codes.reshape(-1).numpy().astype(np.int16) + 1).astype(np.uint8)
    t = np.concatenate([t, np.ones((-t.size) % TRITS_PER_BYTE, np.uint8)])  # padding decodes to 0
    return (t.reshape(-1, TRITS_PER_BYTE) * _POW3).sum(1, dtype=np.uint8).tobytes()


def unpack_trits(payload: bytes, numel: int, field: str = "quantized.payload") -> torch.Tensor:
    """The inverse of `pack_trits`: `numel` int8 codes; a wrong length, a byte >= 243 or a padding code other
    than zero is a WireError."""
    expected = math.ceil(numel / TRITS_PER_BYTE)
    if len(payload) != expected:
        raise WireError(field, f"{len(payload)} bytes, expected {expected} for {numel} ternary codes")
    b = np.frombuffer(payload, dtype=np.uint8)
    if b.size and int(b.max()) >= 243:
        raise WireError(field, "a byte of 243 or more is not five ternary codes")
    codes = _TRITS[b].reshape(-1)
    if codes[numel:].any():
        raise WireError(field, "padding codes past the last element are not zero")
    return torch.from_numpy(codes[:numel].copy())


class LowBitDeltaCodec(ACSGDCodec):
    """acsgd's protocol and first sights; deltas below 2 bits with fp16 per-group values (in `Quantized.scales`,
    and `mins` when the codec has two). A subclass says how a delta is coded (`_encode_delta`) and how a checked
    message's fields decode (`_decode_delta`); the header checks are shared."""

    quantized = False  # no bit width to choose: the label is the name (`tern+ch`)
    low_bit_first_sights = True  # `+fsd`: first sights in the deltas' code
    subspace_deltas = False  # its deltas are its own code: `+dslR` is acsgd's
    device_encoded = False  # no CUDA kernels for these codes: encoded on the host
    wire_code_bits = 0
    """`Quantized.bits` of a delta message."""

    @classmethod
    def wire_bits(cls, config) -> int:
        return 2  # the planner's integer figure: never below what the codes (1.6 or 1 bits) and scales take

    @classmethod
    def nominal_bits(cls, config) -> float:
        return 8 / TRITS_PER_BYTE  # 5 ternary codes a byte

    def _encode_delta(self, d: torch.Tensor, group: int, out: wire_pb2.Quantized) -> torch.Tensor:
        """Codes `d` (group order, fp32) into `out`'s payload, scales and mins; returns the decoded delta."""
        raise NotImplementedError

    def _decode_delta(self, msg: wire_pb2.Quantized, numel: int, groups: int, field: str, bound: float):
        """The delta of a message whose header is checked: every per-group field and the payload checked first."""
        raise NotImplementedError

    def _send_delta(self, rows, m, group, state, msg):
        out = msg.quantized
        out.bits, out.group_size, out.numel = self.wire_code_bits, group, rows.numel()
        out.scale_dtype = wire_dtype(torch.float16)
        sent = self._encode_delta(rows.float() - m.float(), group, out)
        m.copy_((m.float() + sent.view(m.shape)).to(m.dtype))

    def _receive_delta(self, msg, m, bound):
        delta = self._decode_checked(msg.quantized, m.numel(), "quantized", bound)
        return (m.float() + delta.view(m.shape)).to(m.dtype)

    def _decode_checked(self, msg: wire_pb2.Quantized, numel: int, field: str, bound: float) -> torch.Tensor:
        """The codes of `msg` in this codec's delta code, decoded (fp32) after the header and every field is checked."""
        if msg.bits != self.wire_code_bits:
            raise WireError(f"{field}.bits", f"{msg.bits}, this codec's deltas say {self.wire_code_bits}")
        if not 1 <= msg.group_size <= 65536:
            raise WireError(f"{field}.group_size", f"{msg.group_size} is outside 1..65536")
        if msg.numel != numel:
            raise WireError(f"{field}.numel", f"{msg.numel} does not match the {numel} elements the shape implies")
        if msg.scale_dtype != wire_pb2.FLOAT16:
            raise WireError(f"{field}.scale_dtype", "deltas carry fp16 per-group values")
        return self._decode_delta(msg, numel, math.ceil(numel / msg.group_size), field, bound)

    # first sights in the deltas' own code (`+fsd`): a first sight is a delta against a zero buffer

    def _send_full(self, x, group, state, msg):
        if not self.config.first_sight_delta_code:
            return super()._send_full(x, group, state, msg)  # acsgd's grid at `first_sight_bits`
        out = msg.quantized_full
        out.bits, out.group_size, out.numel = self.wire_code_bits, group, x.numel()
        out.scale_dtype = wire_dtype(torch.float16)
        return self._encode_delta(x.float(), group, out)  # what the receiver decodes, bit for bit

    def _receive_full(self, msg, n, bound):
        # the message says which code its first sights travel in: the deltas' (`+fsd`) or acsgd's grid (2-8 bits)
        if msg.quantized_full.bits != self.wire_code_bits:
            return super()._receive_full(msg, n, bound)
        if msg.rotation:
            raise WireError("rotation", "first sights in the deltas' code are never rotated")
        return self._decode_checked(msg.quantized_full, n, "quantized_full", bound)


def check_levels(data: bytes, groups: int, field: str, bound: float) -> torch.Tensor:
    """One fp16 value per group from `data`, each finite and at most `bound` in magnitude (fp32)."""
    v = bytes_to_tensor(data, torch.float16, groups, field).float()
    if not all_finite(v):
        raise WireError(field, "contains NaN or Inf")
    if v.numel() and float(v.abs().max()) > bound:
        raise WireError(field, f"a group's values would exceed {bound:.6g} in magnitude")
    return v


class TernCodec(LowBitDeltaCodec):
    """AQ-SGD with MSE-optimal ternary deltas, 5 codes a byte and an fp16 scale per group (module doc)."""

    name, wire, rated = "tern", wire_pb2.TERN, True

    def payload_nbytes(self, numel: int) -> int:
        return math.ceil(numel / TRITS_PER_BYTE) + 2 * math.ceil(numel / group_size(self.config))

    def _encode_delta(self, d, group, out):
        codes, scales = ternary_quantize(d, group, self.config.rate_percent / 100)
        out.scales = tensor_to_bytes(scales)
        out.payload = pack_trits(codes)
        return ternary_dequantize(codes, scales, group)

    def _decode_delta(self, msg, numel, groups, field, bound):
        if msg.mins:
            raise WireError(f"{field}.mins", "ternary deltas carry no mins")
        scales = check_levels(msg.scales, groups, f"{field}.scales", bound)
        if bool((scales < 0).any()):
            raise WireError(f"{field}.scales", "a negative scale")
        return ternary_dequantize(unpack_trits(msg.payload, numel, f"{field}.payload"), scales, msg.group_size)


CODECS = (TernCodec,)
