"""`swarm bench codecs --first-sights`: how a sample's first sight (its activation sent without a reference, every
sample of a single pass) is best quantized, on activations captured from training the default model.

Each scheme quantizes the stage-0 outputs `[B, T, D]` in channel groups (one group per channel of a sample across
its T tokens, `+ch`), or rotated in token groups, and reports the relative error `||deQ(Q(x)) - x|| / ||x||`
pooled over all messages, the bytes per element of payload + scales and of the zstd-1 framed message, and, for
the codes, their order-0 empirical entropy (what an ideal static entropy coder would reach) beside zstd-1 on the
packed payload:

- `acsgdN` / `acsgdN+rot`: the codec's own first sights (`acsgd2+ch+nr+fsN`; `+rot` sends them in token groups,
  each token's hidden values rotated by a seeded Hadamard transform first), encoded, framed and decoded by the codec.
- `tern`: the ternary quantizer of `codec_tern` (MSE-optimal `{-s, 0, +s}` per group, 5 codes a byte), and `+rot`.
- `bilevel`: the 1-bit two-level quantizer of `codec_bilevel` (8 codes a byte, two fp16 levels a group), and `+rot`.
- `adaptive-B`: TAH-Quant's idea, tile-wise adaptive bits: rotated token groups, each at 2 or 4 bits (plus 1 bit
  a group saying which), the 4-bit groups those with the largest scales (the largest absolute error at 2 bits)
  up to a mean of B bits an element; compare with fixed bits at the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import zstandard

from swarm.bench.codec_deltas import DELTA_COLUMNS, CodeTally
from swarm.compression import CodecConfig, LinkState, frame, make_codec
from swarm.compression import rotation as rot
from swarm.compression.codec_bilevel import bilevel_dequantize, bilevel_quantize, pack_bits
from swarm.compression.codec_tern import pack_trits, ternary_dequantize, ternary_quantize
from swarm.compression.layout import CHANNEL, to_groups
from swarm.kernels.reference import pack
from swarm.kernels.symmetric import dequantize_codes, quantize_codes

FIRST_SIGHT_COLUMNS = [c for c in DELTA_COLUMNS if c != "zstd_planes_bits"]
"""as the deltas bench, without bit planes (first sights are not compressed by planes)"""
SEED = 0
_FRAME_SLACK = 16
"""bytes a message's wire figure may exceed its payload and scales (a stored frame's header)"""


def _zstd(data: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=1).compress(data))


def _codec_first_sights(acts: list[torch.Tensor], bits: int, rotate: bool) -> CodeTally:
    """The acsgd codec's own first sights: encode, frame, decode, as the runtime does."""
    tally = CodeTally(planes=False)
    label = f"acsgd2+ch+nr+fs{bits}" + ("+rot" if rotate else "")
    for x in acts:
        cfg = CodecConfig.parse(label)
        codec = make_codec(cfg)
        msg = codec.encode(x, sample_ids=list(range(x.shape[0])), state=LinkState(cfg))
        y = codec.decode(msg, state=LinkState(cfg))
        q = msg.quantized_full
        codes = np.frombuffer(q.payload, dtype=np.uint8)
        codes = np.unpackbits(codes, bitorder="little").reshape(-1, bits)[: x.numel()]
        codes = (codes * (1 << np.arange(bits, dtype=np.uint8))).sum(1)
        wire = sum(c.ByteSize() for c in frame(msg, zstd_level=1))
        plain = len(q.payload) + len(q.scales)
        tally.add(x, y, codes, plain, min(wire, plain + _FRAME_SLACK), q.payload)
    return tally


def _grouped(x: torch.Tensor, rotate: bool) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """`x` in channel groups `[groups, T]`, or rotated in token groups `[groups, D]` (as the codec rotates first
    sights: never across tokens), and the map of decoded groups back to `x`'s shape."""
    b, t, d = x.shape
    if rotate:
        g = rot.rotate(x, d, SEED).view(-1, d)
        return g, lambda y: rot.unrotate(y.reshape(-1), d, SEED, x.numel()).view(b, t, d)
    g = to_groups(x, CHANNEL).view(-1, t)
    return g, lambda y: y.reshape(b, d, t).transpose(1, 2)


def _lowbit(acts: list[torch.Tensor], scheme: str, rotate: bool) -> CodeTally:
    tally = CodeTally(planes=False)
    for x in acts:
        g, back = _grouped(x, rotate)
        t = g.shape[1]
        if scheme == "tern":
            codes, scales = ternary_quantize(g, t)
            y = ternary_dequantize(codes, scales, t)
            payload, side = pack_trits(codes), scales.numpy().tobytes()
        else:
            codes, lo, hi = bilevel_quantize(g, t)
            y = bilevel_dequantize(codes, lo, hi, t)
            payload, side = pack_bits(codes), lo.numpy().tobytes() + hi.numpy().tobytes()
        plain = len(payload) + len(side)
        tally.add(
            x, back(y), codes.numpy().astype(np.int8), plain, min(_zstd(payload + side), plain + _FRAME_SLACK), payload
        )
    return tally


def adaptive_quantize(g: torch.Tensor, mean_bits: float) -> tuple[torch.Tensor, torch.Tensor, list[bytes]]:
    """Rows of `g` ([groups, T]) at 2 or 4 bits, the 4-bit rows those with the largest max-abs scale, as many as
    keep the mean at `mean_bits` (2..4): decoded rows, the bits of each row, the packed payload of each class."""
    t = g.shape[1]
    scales = g.abs().amax(1)
    n4 = int(round((mean_bits - 2) / 2 * g.shape[0]))
    wide = torch.zeros(g.shape[0], dtype=torch.bool)
    wide[scales.argsort(descending=True)[:n4]] = True
    y = torch.empty_like(g)
    payloads = []
    for bits, rows in ((2, ~wide), (4, wide)):
        if rows.any():
            codes, s = quantize_codes(g[rows], bits, t)
            y[rows] = dequantize_codes(codes, s, bits, t).view(-1, t)
            payloads.append(pack(codes, bits).numpy().tobytes())
    return y, torch.where(wide, 4, 2), payloads


def _adaptive(acts: list[torch.Tensor], mean_bits: float) -> CodeTally:
    tally = CodeTally(planes=False)
    for x in acts:
        g, back = _grouped(x, True)
        y, bits, payloads = adaptive_quantize(g, mean_bits)
        side = 2 * g.shape[0] + math.ceil(g.shape[0] / 8)  # an fp16 scale and one width bit a group
        payload = b"".join(payloads)
        plain = len(payload) + side
        tally.add(x, back(y), None, plain, min(_zstd(payload) + side, plain + _FRAME_SLACK), payload)
    return tally


def first_sight_rows(sources: dict[str, list[torch.Tensor]]) -> list[dict]:
    """Every scheme of the module doc on every source's activations."""
    rows = []
    for source, acts in sources.items():
        elements = sum(a.numel() for a in acts)
        tallies: list[tuple[CodeTally, str, float]] = []
        for bits in (2, 3, 4, 8):
            for rotate in (False, True):
                tallies.append((_codec_first_sights(acts, bits, rotate), f"acsgd{bits}" + "+rot" * rotate, bits))
        for scheme, bits in (("tern", 1.58), ("bilevel", 1)):
            for rotate in (False, True):
                tallies.append((_lowbit(acts, scheme, rotate), scheme + "+rot" * rotate, bits))
        for mean_bits in (2.5, 3.0):
            tallies.append((_adaptive(acts, mean_bits), f"adaptive-{mean_bits:g}", mean_bits))
        rows += [{**t.row(source=source, scheme=s, bits=b), "elements": elements} for t, s, b in tallies]
    return rows


def model_activations(epochs: int = 2, every: int = 3, say: Callable[[str], None] = print) -> list[torch.Tensor]:
    """Stage-0 outputs of the default convergence model trained `epochs` epochs under the default setting (acsgd2
    forward), every forward message's activation captured every `every` steps: what first sights carry."""
    from swarm.bench.codec_deltas import capture_forward_messages
    from swarm.experiments.convergence import DEFAULT_TARGET_SETTING

    def activation(x, msg, state):
        return x.detach().float().clone()

    return capture_forward_messages(DEFAULT_TARGET_SETTING, activation, epochs, every, "messages", say)


def synthetic_activations(n: int = 4, shape=(4, 128, 128), seed: int = 0) -> list[torch.Tensor]:
    """Residual-stream-like activations: a few channels 10x the rest, the first token 20x."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(shape, generator=gen)
        x[..., :4] *= 10
        x[:, 0] *= 20
        out.append(x)
    return out


__all__ = ["FIRST_SIGHT_COLUMNS", "adaptive_quantize", "first_sight_rows", "model_activations", "synthetic_activations"]
