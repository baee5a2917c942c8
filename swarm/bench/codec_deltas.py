"""`swarm bench codecs --deltas`: the forward codecs' group layouts and the AQ-SGD paper's compressor on the same
AQ-SGD deltas, with the entropy of the 2-bit codes against what zstd makes of them.

Deltas come from two sources:
- "model": the default convergence model trained with the swarm's runtime (LocalPipeline, two stages, the
  experiment's `aqsgd2/gradq4+ef` setting); every forward message's delta samples are captured as
  `x - m` (the stage-0 output minus the message buffer the sample travels against), a subsample per step.
- "synthetic": N(0, 1) changes of `[B, T, D]` activations whose first few channels are 10x the rest.

Schemes, each at 2 and 4 bits: ours (per-group min and scale, float32 pair) flat with stochastic rounding (the
swarm's codec default, group 256), flat with round-to-nearest (group 256 and the experiment's 128), channel
groups (one per channel of a sample across its tokens, `+ch`) with either rounding; and the AQ-SGD paper's
compressor as its description states it (DS3Lab/AC-SGD, `compress/fixpoint.py`, rewritten here): one fp16
max-abs scale per channel of a sample across its tokens, codes `round(v / scale * 2^(b-1))` clipped to
`[-2^(b-1), 2^(b-1) - 1]`, decoded as `code / 2^(b-1) * scale`.

Per scheme: the relative error `||deQ(Q(d)) - d|| / ||d||` pooled over all deltas, bytes per element of payload +
scales (+ mins), of the zstd-1 framed message, the codes' order-0 empirical entropy (what an ideal static
entropy coder would reach on the codes), and zstd on the codes split into bit planes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
import zstandard

from swarm.compression import CodecConfig, frame, make_codec
from swarm.compression.layout import CHANNEL, FLAT
from swarm.kernels.reference import pack, unpack

SCHEMES = {
    # name: (layout, stochastic, group size)
    "ours-flat-sr": (FLAT, True, 256),
    "ours-flat-nr": (FLAT, False, 256),
    "ours-flat128-nr": (FLAT, False, 128),
    "ours-channel-nr": (CHANNEL, False, None),
    "ours-channel-sr": (CHANNEL, True, None),
    "paper": (None, False, None),
}
DELTA_COLUMNS = [
    "source",
    "scheme",
    "bits",
    "rel_error",
    "payload_scales_bytes_per_element",
    "wire_bytes_per_element",
    "code_entropy_bits",
    "zstd_payload_bits",
    "zstd_planes_bits",
]


def paper_quantize(d: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The AQ-SGD paper's compressor on `[B, T, D]`: codes in 0..2^bits-1 (uint8, offset by 2^(bits-1)) and one
    fp16 max-abs scale per (sample, channel)."""
    half = 1 << (bits - 1)
    scale = d.abs().amax(1, keepdim=True).half()
    safe = scale.float().clamp_min(1e-30)
    codes = torch.round(d / safe * half).clamp(-half, half - 1)
    return (codes + half).to(torch.uint8), scale


def paper_dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    half = 1 << (bits - 1)
    return (codes.float() - half) / half * scale.float()


def pack_codes(codes: np.ndarray | torch.Tensor, bits: int) -> bytes:
    """Codes (uint8, < 2^bits) packed as the swarm's kernels pack them (`kernels.reference.pack`)."""
    return pack(torch.as_tensor(codes).reshape(-1), bits).numpy().tobytes()


def unpack_codes(payload: bytes, bits: int, numel: int) -> np.ndarray:
    return unpack(torch.frombuffer(bytearray(payload), dtype=torch.uint8), bits, numel).numpy()


def entropy_bits(codes: np.ndarray, bits: int) -> float:
    """Order-0 empirical entropy of the codes, bits per code."""
    p = np.bincount(codes.ravel(), minlength=1 << bits) / max(1, codes.size)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def plane_bytes(codes: np.ndarray, bits: int) -> int:
    """zstd-1 bytes of the codes split into bit planes (each plane packed 8 codes a byte, compressed apart)."""
    zc = zstandard.ZstdCompressor(level=1)
    return sum(len(zc.compress(np.packbits((codes.ravel() >> k) & 1).tobytes())) for k in range(bits))


class CodeTally:
    """A codec's error and bytes over many messages, and the order-0 entropy of their codes (pooled): what the
    codec benches report per scheme (`measure` here, `codec_first_sights`). With `planes`, every message's codes
    are also compressed as bit planes (`plane_bytes`; `add` then needs their `bits`)."""

    def __init__(self, planes: bool = True):
        self.planes = planes
        self.err2 = self.ref2 = 0.0
        self.numel = self.plain = self.wire = self.zpay = self.zplanes = 0
        self.hist: dict[int, int] = {}
        """how often each code value occurred (codes of every message pooled)"""

    def add(self, x, y, codes, plain: int, wire: int, payload: bytes, bits: int | None = None) -> None:
        """One message: `x` sent, `y` decoded, its `codes` (None: no codes to count), `plain` bytes of payload
        and scales, `wire` bytes as framed."""
        self.err2 += float((y.float() - x.float()).pow(2).sum())
        self.ref2 += float(x.float().pow(2).sum())
        self.numel += x.numel()
        self.plain += plain
        self.wire += wire
        self.zpay += len(zstandard.ZstdCompressor(level=1).compress(payload))
        if codes is None:
            return
        if self.planes:
            self.zplanes += plane_bytes(codes, bits)
        values, counts = np.unique(codes.ravel(), return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist(), strict=True):
            self.hist[v] = self.hist.get(v, 0) + c

    def entropy_bits(self) -> float:
        """Order-0 empirical entropy of the pooled codes, bits per code (NaN without codes)."""
        if not self.hist:
            return float("nan")
        counts = np.array([self.hist[v] for v in sorted(self.hist)], dtype=np.float64)
        p = counts / counts.sum()
        return float(-(p * np.log2(p)).sum())

    def row(self, **keys) -> dict:
        n = max(1, self.numel)
        row = {
            **keys,
            "rel_error": math.sqrt(self.err2 / max(self.ref2, 1e-30)),
            "payload_scales_bytes_per_element": self.plain / n,
            "wire_bytes_per_element": self.wire / n,
            "code_entropy_bits": self.entropy_bits(),
            "zstd_payload_bits": 8 * self.zpay / n,
        }
        if self.planes:
            row["zstd_planes_bits"] = 8 * self.zplanes / n
        return row


def measure(deltas: list[torch.Tensor], scheme: str, bits: int, seed: int = 0) -> CodeTally:
    """Every delta `[B, T, D]` through one scheme; sums what `CodeTally.row` reports."""
    tally, (layout, stochastic, group) = CodeTally(), SCHEMES[scheme]
    zc = zstandard.ZstdCompressor(level=1)
    for i, d in enumerate(deltas):
        d = d.float()
        if layout is None:
            codes, scale = paper_quantize(d, bits)
            y = paper_dequantize(codes, scale, bits)
            payload = pack_codes(codes, bits)
            scale_bytes = scale.numpy().tobytes()
            plain = len(payload) + len(scale_bytes)
            wire = len(zc.compress(payload + scale_bytes))
            tally.add(d, y, codes.numpy(), plain, min(wire, plain), payload, bits)
            continue
        cfg = CodecConfig(
            name="directq", bits=bits, group_size=group, stochastic=stochastic, seed=seed + i, group_layout=layout
        )
        codec = make_codec(cfg)
        msg = codec.encode(d)
        y = codec.decode(msg)
        q = msg.quantized
        plain = len(q.payload) + len(q.scales) + len(q.mins)
        wire = sum(c.ByteSize() for c in frame(msg, zstd_level=1))
        codes = unpack_codes(q.payload, bits, d.numel())
        tally.add(d, y, codes, plain, wire, q.payload, bits)
    return tally


def synthetic_deltas(n: int = 8, shape=(4, 128, 128), outliers: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """Changes whose first `outliers` channels are 10x the rest (a transformer's residual stream has a few)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        d = torch.randn(shape, generator=gen)
        d[..., :outliers] *= 10
        out.append(d)
    return out


def capture_forward_messages(
    label: str,
    pick: Callable,
    epochs: int,
    every: int,
    what: str = "messages",
    say: Callable[[str], None] = print,
    train_samples: int | None = None,
) -> list[torch.Tensor]:
    """Trains the default convergence model `epochs` epochs in process under the setting `label` and returns what
    `pick(x, msg, state)` takes (a tensor, or None for nothing) of every buffered forward message every `every`
    steps: real messages for the codec benches (`model_deltas`, `codec_first_sights.model_activations`).
    `train_samples`: the first that many training samples only (default: the whole training set)."""
    from swarm.compression.codec_aqsgd import AQSGDCodec
    from swarm.experiments.convergence import ExperimentConfig, Setting
    from swarm.model.data import SampleSet, build_datasets, epoch_batches
    from swarm.runtime.inprocess import LocalPipeline
    from swarm.runtime.worker import StageConfig

    cfg = ExperimentConfig()
    forward_defaults = {"group_size": cfg.forward_group_size, "stochastic": cfg.forward_stochastic}
    backward_defaults = {"group_size": cfg.backward_group_size, "stochastic": cfg.backward_stochastic}
    setting = Setting.parse(label, forward_defaults, backward_defaults)
    train, _, _ = build_datasets(cfg.data)
    if train_samples is not None:
        train = SampleSet(train.ids[:train_samples], train.windows[:train_samples])
    captured: list[torch.Tensor] = []
    capture = [False]
    original = AQSGDCodec._encode_body

    def spy(self, x, msg, state):
        if capture[0] and (taken := pick(x, msg, state)) is not None:
            captured.append(taken)
        return original(self, x, msg, state)

    steps = len(train) // cfg.batch_size
    total = steps * epochs
    optim = replace(cfg.optim, total_steps=total, warmup_steps=max(1, round(total * cfg.warmup_fraction)))
    pipe = LocalPipeline(
        cfg.model, cfg.n_stages, setting.forward, setting.backward, schedule=cfg.schedule,
        stage_cfg=StageConfig(optim, cfg.autocast_bf16),
    )  # fmt: skip
    AQSGDCodec._encode_body = spy
    started, step = time.perf_counter(), 0
    try:
        for epoch in range(epochs):
            for batch in epoch_batches(train, cfg.batch_size, epoch, cfg.data_seed):
                capture[0] = step % every == 0
                pipe.train_step(batch, cfg.n_micro)
                step += 1
            say(f"  epoch {epoch + 1}/{epochs}: {len(captured)} {what} ({time.perf_counter() - started:.0f} s)")
    finally:
        AQSGDCodec._encode_body = original
        pipe.close()
    return captured


def model_deltas(
    epochs: int = 4, every: int = 2, say: Callable[[str], None] = print, train_samples: int | None = None
) -> list[torch.Tensor]:
    """Real AQ-SGD deltas: the default convergence model trained `epochs` epochs under `aqsgd2/gradq4+ef` (the
    experiment's defaults), each forward message's delta samples captured as `x - m` every `every` steps
    (`train_samples`: of that many training samples only; default all)."""

    def delta(x, msg, state):
        if state is None or state.buffers is None or len(msg.sample_ids) != x.shape[0]:
            return None
        slots = state.buffers.lookup(list(msg.sample_ids))
        rows = [i for i, s in enumerate(slots) if s >= 0]
        if not rows:
            return None
        m = state.buffers.gather([slots[i] for i in rows])
        return (x[rows].float() - m.float()).detach().clone()

    return capture_forward_messages("aqsgd2/gradq4+ef", delta, epochs, every, "delta messages", say, train_samples)


def delta_rows(sources: dict[str, list[torch.Tensor]], bits_list=(2, 4)) -> list[dict]:
    rows = []
    for source, deltas in sources.items():
        for bits in bits_list:
            for scheme in SCHEMES:
                row = measure(deltas, scheme, bits).row(source=source, scheme=scheme, bits=bits)
                rows.append({**row, "elements": sum(d.numel() for d in deltas)})
    return rows


__all__ = [
    "DELTA_COLUMNS",
    "CodeTally",
    "SCHEMES",
    "capture_forward_messages",
    "delta_rows",
    "model_deltas",
    "paper_quantize",
    "synthetic_deltas",
]
