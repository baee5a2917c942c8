"""BILEVEL: AQ-SGD's buffer protocol with 1-bit deltas on two levels per group, Lloyd's 1-bit quantizer.

Why: in AQ-SGD deltas captured from the default model (`swarm bench codecs --deltas model`, channel groups),
a group's mean carries 39% of its energy: a channel of a sample shifts as a whole between epochs. A sign code
around zero (`sign(v) * mean|v|`) cannot follow the shift (relative error 0.48, and +3.4% held-out loss in the
convergence run); two levels per group split at the group's own centre can: relative error 0.35 at 0.88 bits
per element after zstd, against 0.33 at 1.57 bits for acsgd2 and 0.33 at 1.39 for tern. In `swarm experiment
convergence` (`bilevel+ch`, the default backward): 41 KB of forward bytes a step after epoch 1 (acsgd2: 60),
18.7x fewer total bytes than fp32, held-out +2.17% / +2.21% vs fp32 (seeds 0 / 1). Its two fp16 levels cost
32 bits a group: it pays with groups of ~128 elements and more (at 32 tokens a sample it sends more than acsgd2).

Quantizer (per group, deterministic): Lloyd's algorithm for two levels, `LLOYD_ROUNDS` rounds starting from a
split at the group's mean: `hi` = the mean of the values at or above the threshold, `lo` = the mean of those
below (a side left empty takes the other's level), the next threshold their midpoint. The levels travel in
fp16 (clamped to its finite range); each code then picks the nearer of the two fp16 levels (`v >= (lo + hi) /
2`), so decoding is exact in float32 and both ends' buffers agree bit for bit. What the code leaves out stays in
`x - m` and travels with the sample's next delta.

On the wire: `Quantized` with `bits` 1, `scale_dtype` FLOAT16, `mins` the `lo` level and `scales` the `hi` level
of each group (`lo <= hi`, both finite), `payload` ceil(numel / 8) bytes, codes least significant bit first
(numpy's `packbits(bitorder="little")`), padding bits zero (a set padding bit is refused). First sights travel
as acsgd's do, or with `+fsd` (`CodecConfig.first_sight_delta_code`) in this same 1-bit code in `quantized_full`
(`bits` 1).

On a GPU (`device_encoded`): the quantizer, the decoded delta and the buffers' update are torch ops on the sending
end's device and the codes are packed there (`pack_bits_torch`), so only the packed bits and the levels are copied
to the host. The GPU may sum a group's levels in another order than a CPU, so its messages may differ from a CPU
sender's; both ends' buffers still agree bit for bit, since the receiver applies exactly the levels and codes sent.
Not measured on a GPU (none was lent when this was written).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm.compression.codec_acsgd import FP16_MAX
from swarm.compression.codec_tern import LowBitDeltaCodec, check_levels, group_view
from swarm.compression.quantized import group_size
from swarm.compression.wire import WireError, tensor_to_bytes
from swarm.kernels.host_copy import to_host
from swarm.proto import wire_pb2

LLOYD_ROUNDS = 2


def bilevel_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (bool, flattened to `x.numel()`: True = `hi`), and the fp16 `lo` and `hi` levels of each `group`
    consecutive elements (the last group's padding takes no part)."""
    g = group_view(x, group)
    valid = torch.ones_like(g, dtype=torch.bool).view(-1)
    valid[x.numel() :] = False
    valid = valid.view(g.shape)
    n = valid.sum(1)
    t = (g * valid).sum(1) / n
    for _ in range(LLOYD_ROUNDS):
        up = (g >= t[:, None]) & valid
        down = valid & ~up
        n_up, n_down = up.sum(1), down.sum(1)
        hi = (g * up).sum(1) / n_up.clamp_min(1)
        lo = (g * down).sum(1) / n_down.clamp_min(1)
        hi, lo = torch.where(n_up > 0, hi, lo), torch.where(n_down > 0, lo, hi)
        t = (lo + hi) / 2
    lo16, hi16 = (v.clamp(-FP16_MAX, FP16_MAX).half() for v in (lo, hi))
    codes = g >= ((lo16.float() + hi16.float()) / 2)[:, None]
    return codes.reshape(-1)[: x.numel()], lo16, hi16


def bilevel_dequantize(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, group: int) -> torch.Tensor:
    """`hi` where the code is set, `lo` elsewhere, per group; float32, exact."""
    n = codes.numel()
    return torch.where(codes, hi.float().repeat_interleave(group)[:n], lo.float().repeat_interleave(group)[:n])


def pack_bits(codes: torch.Tensor) -> bytes:
    """Bool codes eight to a byte, the first least significant, the last byte's padding zero; codes on a device
    are packed there (`pack_bits_torch`), so only the packed bytes leave it."""
    if codes.device.type != "cpu":
        return pack_bits_torch(codes)
    return np.packbits(codes.reshape(-1).numpy(), bitorder="little").tobytes()


def pack_bits_torch(codes: torch.Tensor) -> bytes:
    """`pack_bits` in torch ops on the codes' own device (30x slower than numpy's on a CPU, hence only for a
    device): one copy of the packed bytes to the host."""
    flat = codes.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    (packed,) = to_host((flat.view(-1, 8) << shifts).sum(1, dtype=torch.uint8))
    return packed.numpy().tobytes()


def unpack_bits(payload: bytes, numel: int, field: str = "quantized.payload") -> torch.Tensor:
    """The inverse of `pack_bits`: `numel` bool codes; a wrong length or a set padding bit is a WireError."""
    expected = math.ceil(numel / 8)
    if len(payload) != expected:
        raise WireError(field, f"{len(payload)} bytes, expected {expected} for {numel} 1-bit codes")
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little")
    if bits[numel:].any():
        raise WireError(field, "padding bits past the last code are set")
    return torch.from_numpy(bits[:numel].astype(bool))


class BilevelCodec(LowBitDeltaCodec):
    """AQ-SGD with 1-bit deltas on two fp16 levels per group, Lloyd's 1-bit quantizer (module doc)."""

    name, wire = "bilevel", wire_pb2.BILEVEL
    wire_code_bits = 1
    device_encoded = True  # its quantizer and its update are torch ops on the buffers' device; codes packed there

    @classmethod
    def wire_bits(cls, config) -> int:
        return 1

    @classmethod
    def nominal_bits(cls, config) -> float:
        return 1

    def payload_nbytes(self, numel: int) -> int:
        return math.ceil(numel / 8) + 4 * math.ceil(numel / group_size(self.config))

    def _encode_delta(self, d, group, out):
        codes, lo, hi = bilevel_quantize(d, group)
        out.mins, out.scales = tensor_to_bytes(lo), tensor_to_bytes(hi)
        out.payload = pack_bits(codes)
        return bilevel_dequantize(codes, lo, hi, group)

    def _decode_delta(self, msg, numel, groups, field, bound):
        lo = check_levels(msg.mins, groups, f"{field}.mins", bound)
        hi = check_levels(msg.scales, groups, f"{field}.scales", bound)
        if bool((lo > hi).any()):
            raise WireError(f"{field}.mins", "a group's low level is above its high level")
        return bilevel_dequantize(unpack_bits(msg.payload, numel, f"{field}.payload"), lo, hi, msg.group_size)


CODECS = (BilevelCodec,)
