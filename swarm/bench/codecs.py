"""`swarm bench codecs`: every codec's wire size, error and speed, beside hivemind's and bitsandbytes' codecs.

All codecs run on the same tensors in the same process. AQ-SGD is measured in its steady state: the sample
was sent once before, and the tensor is the drifted activation of that sample (the change is what travels).
A codec of another library that fails is reported as a row with its error, never hidden.
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass, field, replace

import torch

from swarm.compression import CodecConfig, LinkState, codec_class, frame, make_codec
from swarm.flags import Flags, flag
from swarm.report import emit, median_seconds

OURS = [
    "fp32", "fp16", "bf16", "directq2", "directq2+ch", "directq4", "directq8",
    "aqsgd2", "aqsgd2+ch", "aqsgd4", "aqsgd4+ch", "aqsgd8", "acsgd2+ch", "acsgd4+ch", "tern+ch", "bilevel+ch",
    "gradq4", "gradq8", "gradq2+rot+nr+cs+g1024", "gsign+rot+g1024",
    "gtern+rot+nr+r75+g1024", "gtern+rot+nr+r150+g1024", "lowrank4+g128", "lowrank4+f8+g128",
]  # fmt: skip
"""`lowrank` views the tensor as rows of 128 (the hidden size): on these full-rank activations its error is near
1, the bytes and speed are what the row shows; the tied embedding's gradient, where it is used, is another
matter (`swarm experiment convergence ...@lr4`)."""
HIVEMIND = [
    "Float16Compression",
    "ScaledFloat16Compression",
    "Uniform8BitQuantization",
    "Quantile8BitQuantization",
    "BlockwiseQuantization",
]
COLUMNS = [
    "codec",
    "bits",
    "wire_bytes_per_element",
    "ratio_vs_fp32",
    "ratio_vs_fp32_no_zstd",
    "payload_scales_bytes_per_element",
    "rel_error",
    "encode_decode_gbps",
    "error",
]


@dataclass(frozen=True)
class CodecsBench:
    """`swarm bench codecs`: every codec's wire size, error and speed, beside hivemind's (or, with --deltas,
    group layouts on AQ-SGD deltas)."""

    numel: int = 1 << 22
    """elements per test tensor (4M fp32)"""
    repeats: int = 5
    """timed repeats per codec; the median is reported"""
    zstd_level: int = 1
    """zstd level of our framing (0 turns it off)"""
    drift: float = 0.05
    """AQ-SGD: relative change of the activation"""
    quick: bool = False
    """small tensors and one repeat, for a smoke test"""
    json: bool = False
    """print rows as JSON instead of a table"""
    deltas: str | None = field(default=None, metadata=flag(choices=("synthetic", "model", "all")))
    """instead of the codec table: group layouts and the AQ-SGD paper's compressor on AQ-SGD deltas (synthetic with
    10x channels, and/or captured from training the default model), with code entropy"""
    delta_epochs: int = 4
    """--deltas model: epochs of training to capture"""
    first_sights: str | None = field(default=None, metadata=flag(choices=("synthetic", "model", "all")))
    """instead of the codec table: how first sights (activations without a reference) quantize: acsgd's bits with
    and without rotation, ternary, 1-bit, tile-wise adaptive bits, with code entropy against zstd"""


_FLAGS = Flags(CodecsBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def _rel_error(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.float() - x.float()).norm() / x.float().norm().clamp_min(1e-30))


def _ours(label: str, x: torch.Tensor, prev: torch.Tensor, bench: CodecsBench) -> dict:
    cfg = CodecConfig.parse(label, zstd_level=bench.zstd_level, seed=0)
    codec = make_codec(cfg)
    numel = x.numel()
    ids = list(range(x.shape[0]))
    if codec.uses_buffers:
        send, recv = LinkState(cfg), LinkState(cfg)
        codec.decode(codec.encode(prev, sample_ids=ids, state=send), state=recv)  # first sight
        # fresh copies of both ends for every timed run (made before the clock starts), so that every run
        # measures the same one-step change and none times the copying
        pairs = [(_copy_state(send), _copy_state(recv)) for _ in range(bench.repeats + 2)]

        def encode_decode():
            s, r = pairs.pop()
            return codec.decode(codec.encode(x, sample_ids=ids, state=s), state=r)
    else:
        state = LinkState(cfg)

        def encode_decode():
            return codec.decode(codec.encode(x, sample_ids=ids, state=state), state=state)

    if codec.uses_buffers:
        s, r = pairs.pop()
        msg = codec.encode(x, sample_ids=ids, state=s)
        y = codec.decode(msg, state=r)
    else:
        msg = codec.encode(x, sample_ids=ids, state=LinkState(cfg))
        y = codec.decode(msg, state=LinkState(cfg))
    seconds = median_seconds(encode_decode, repeats=bench.repeats)
    wire = sum(c.ByteSize() for c in frame(msg, zstd_level=bench.zstd_level))
    plain = sum(c.ByteSize() for c in frame(msg, zstd_level=0))
    return {
        "codec": cfg.label,
        "bits": codec_class(cfg.name).nominal_bits(cfg),
        "wire_bytes_per_element": wire / numel,
        "ratio_vs_fp32": 4 * numel / wire,
        "ratio_vs_fp32_no_zstd": 4 * numel / plain,
        # the target counts payload + scales: message metadata (shape, per-sample ids) apart
        "payload_scales_bytes_per_element": _payload_and_scales(msg) / numel,
        "rel_error": _rel_error(y, x),
        "encode_decode_gbps": 4 * numel / seconds / 1e9,
        "group_size": cfg.group_size,
    }


def _payload_and_scales(msg) -> int:
    total = len(msg.raw)
    for q in (msg.quantized, msg.quantized_full):
        total += len(q.payload) + len(q.scales) + len(q.mins)
    return total


def _copy_state(state: LinkState) -> LinkState:
    clone = LinkState(state.config)
    src, dst = state.buffers, clone.buffers
    ids = src.ids()
    dst.admit(ids, src.gather(src.lookup(ids)))
    return clone


def _hivemind(name: str, x: torch.Tensor, bench: CodecsBench) -> dict:
    row = {"codec": f"hivemind.{name}", "bits": 16 if "16" in name else 8}
    try:
        import hivemind.compression as hc

        codec = getattr(hc, name)()
        info = hc.CompressionInfo.from_tensor(x)
        msg = codec.compress(x, info)
        y = codec.extract(msg)
        seconds = median_seconds(lambda: codec.extract(codec.compress(x, info)), repeats=bench.repeats)
        numel = x.numel()
        row.update(
            wire_bytes_per_element=msg.ByteSize() / numel,
            ratio_vs_fp32=4 * numel / msg.ByteSize(),
            ratio_vs_fp32_no_zstd=4 * numel / msg.ByteSize(),
            rel_error=_rel_error(y, x),
            encode_decode_gbps=4 * numel / seconds / 1e9,
        )
    except Exception as e:  # a peer library's failure is a result to report, not to hide
        row.update(encode_decode_gbps=None, error=f"{type(e).__name__}: {e}")
    return row


def _bitsandbytes(x: torch.Tensor, bench: CodecsBench) -> dict:
    row = {"codec": "bitsandbytes.blockwise8", "bits": 8}
    try:
        import bitsandbytes.functional as bnb

        q, qstate = bnb.quantize_blockwise(x)
        y = bnb.dequantize_blockwise(q, qstate)
        wire = q.numel() + qstate.absmax.numel() * qstate.absmax.element_size() + qstate.code.numel() * 4
        seconds = median_seconds(lambda: bnb.dequantize_blockwise(*bnb.quantize_blockwise(x)), repeats=bench.repeats)
        numel = x.numel()
        row.update(
            wire_bytes_per_element=wire / numel,
            ratio_vs_fp32=4 * numel / wire,
            ratio_vs_fp32_no_zstd=4 * numel / wire,
            rel_error=_rel_error(y, x),
            encode_decode_gbps=4 * numel / seconds / 1e9,
        )
    except Exception as e:
        row.update(encode_decode_gbps=None, error=f"{type(e).__name__}: {e}")
    return row


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    if bench.first_sights:
        return _run_first_sights(bench)
    if bench.deltas:
        return _run_deltas(bench)
    if bench.quick:
        bench = replace(bench, numel=min(bench.numel, 1 << 16), repeats=1)
    gen = torch.Generator().manual_seed(0)
    # activations as they cross a stage boundary: [samples, seq 128, hidden 128], the default model's shape
    sample = (128, 128) if bench.numel >= 128 * 128 else (1, bench.numel)
    prev = torch.randn(max(1, bench.numel // (sample[0] * sample[1])), *sample, generator=gen)
    x = prev + bench.drift * torch.randn(prev.shape, generator=gen)
    rows = []
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows += [_ours(label, x, prev, bench) for label in OURS]
        rows += [_hivemind(name, x, bench) for name in HIVEMIND]
        rows.append(_bitsandbytes(x, bench))
    title = f"codecs on {x.numel():,} fp32 elements ({time.perf_counter() - started:.1f} s)"
    emit(rows, COLUMNS, bench.json, title)
    return 0


def _run_deltas(bench: CodecsBench) -> int:
    from swarm.bench.codec_deltas import DELTA_COLUMNS, delta_rows, model_deltas, synthetic_deltas

    started, sources = time.perf_counter(), {}
    if bench.deltas in ("synthetic", "all"):
        sources["synthetic"] = synthetic_deltas(n=1 if bench.quick else 8, shape=(2 if bench.quick else 4, 128, 128))
    if bench.deltas in ("model", "all"):
        say = (lambda _: None) if bench.json else print
        # a delta needs a sample seen twice: two epochs at the least
        sources["model"] = model_deltas(epochs=2 if bench.quick else bench.delta_epochs, say=say)
    rows = delta_rows(sources)
    sizes = ", ".join(f"{k}: {sum(d.numel() for d in v):,} elements" for k, v in sources.items())
    emit(rows, DELTA_COLUMNS, bench.json, f"AQ-SGD deltas ({sizes}; {time.perf_counter() - started:.1f} s)")
    return 0


def _run_first_sights(bench: CodecsBench) -> int:
    from swarm.bench.codec_first_sights import (
        FIRST_SIGHT_COLUMNS,
        first_sight_rows,
        model_activations,
        synthetic_activations,
    )

    started, sources = time.perf_counter(), {}
    if bench.first_sights in ("synthetic", "all"):
        sources["synthetic"] = synthetic_activations(
            n=1 if bench.quick else 4, shape=(2 if bench.quick else 4, 128, 128)
        )
    if bench.first_sights in ("model", "all"):
        say = (lambda _: None) if bench.json else print
        sources["model"] = model_activations(epochs=1 if bench.quick else 2, say=say)
    rows = first_sight_rows(sources)
    sizes = ", ".join(f"{k}: {sum(a.numel() for a in v):,} elements" for k, v in sources.items())
    emit(rows, FIRST_SIGHT_COLUMNS, bench.json, f"first sights ({sizes}; {time.perf_counter() - started:.1f} s)")
    return 0
