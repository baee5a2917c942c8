"""The default codecs' CPU time per message, before and after s60's changes, A/B in one process.

    python scripts/measure_codec_cpu.py [--rounds 60] [--forward LABEL] [--backward LABEL] [--json]

Encodes and decodes the throttled experiment's message ([2, 128, 128]: 4 micro-batches of 2 samples, 128 tokens,
hidden 128) with the forward codec on repeat visits (AQ-SGD deltas: every sample buffered) and the backward codec,
alternating per round between two modes so a loaded machine's drift falls on both alike:

- before: acsgd's subspace-coded deltas take their basis by a full float64 eigendecomposition (`iterations=0`),
  whole-tensor finite checks are `isfinite().all()`, bit packing goes bit by bit (`_pack_bits`);
- after: the code as it is (`GRAM_ITERATIONS` subspace iterations, `all_finite`, whole-code packing).

Prints each mode's median milliseconds per encode and decode, and their sum per micro-batch (one forward and one
backward message, each encoded and decoded): what a hop adds to the pipeline's critical path on one core.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch

from swarm.compression import CodecConfig, LinkState, decoder_for, make_codec
from swarm.compression.codec_config import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
from swarm.kernels import all_finite
from swarm.kernels import reference as ref

FINITE_USERS = ("codec_base", "codec_aqsgd", "clipping", "codec_tern")
PACK_USERS = ("factors", "codec_acsgd", "clipping", "quantized")


def _modules(names, package="swarm.compression"):
    return [importlib.import_module(f"{package}.{n}") for n in names]


def set_mode(after: bool) -> None:
    """Points the codecs' module globals at the after (current) or before implementations."""
    acsgd = importlib.import_module("swarm.compression.codec_acsgd")
    subspace = importlib.import_module("swarm.compression.subspace")
    acsgd.GRAM_ITERATIONS = subspace.GRAM_ITERATIONS if after else 0
    isfinite = lambda x: (not x.numel()) or bool(torch.isfinite(x).all())  # noqa: E731
    symmetric = importlib.import_module("swarm.kernels.symmetric")
    for m in [*_modules(FINITE_USERS), symmetric]:
        m.all_finite = all_finite if after else isfinite
    for m in [*_modules(PACK_USERS), symmetric]:
        if hasattr(m, "pack"):
            m.pack = ref.pack if after else ref._pack_bits
        if hasattr(m, "unpack"):
            m.unpack = ref.unpack if after else ref._unpack_bits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="rounds of 4 micro-batches per mode")
    parser.add_argument("--forward", default=DEFAULT_FORWARD_CODEC, help="forward codec label")
    parser.add_argument("--backward", default=DEFAULT_BACKWARD_CODEC, help="backward codec label")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = {"forward": CodecConfig.parse(args.forward), "backward": CodecConfig.parse(args.backward)}
    # each mode its own link states (both ends), so a mode's buffers only ever see its own messages
    ends = {mode: {k: (make_codec(c), LinkState(c), LinkState(c)) for k, c in configs.items()} for mode in (0, 1)}
    gen = torch.Generator().manual_seed(0)
    spectrum = torch.diag(torch.logspace(0, -2, 128))  # a boundary's channels: few loud directions
    samples = torch.randn(8, 128, 128, generator=gen) @ spectrum
    times = {(mode, k, op): [] for mode in (0, 1) for k in configs for op in ("encode", "decode")}
    for rnd in range(args.rounds + 4):
        for mode in (0, 1) if rnd % 2 else (1, 0):
            set_mode(bool(mode))
            noise = torch.Generator().manual_seed(rnd)
            for mb in range(4):
                for kind, (codec, send, recv) in ends[mode].items():
                    ids = [2 * mb, 2 * mb + 1] if kind == "forward" else None
                    step = torch.randn(2, 128, 128, generator=noise)
                    x = samples[ids] + 0.05 * step if ids else 1e-3 * step
                    a = time.perf_counter()
                    msg = codec.encode(x, sample_ids=ids, state=send)
                    b = time.perf_counter()
                    decoder_for(msg).decode(msg, state=recv)
                    c = time.perf_counter()
                    if rnd >= 4:  # the first rounds buffer the samples (first sights)
                        times[(mode, kind, "encode")].append(b - a)
                        times[(mode, kind, "decode")].append(c - b)
    set_mode(True)
    rows = {("after" if mode else "before"): {f"{k} {op}": 1000 * statistics.median(times[(mode, k, op)])
            for k in configs for op in ("encode", "decode")} for mode in (0, 1)}  # fmt: skip
    for row in rows.values():
        row["per micro-batch"] = sum(row.values())
    if args.json:
        print(json.dumps({"forward": args.forward, "backward": args.backward, "ms": rows}))
        return 0
    print(f"forward {args.forward} / backward {args.backward}, median ms over {args.rounds} rounds of 4")
    for name in rows["before"]:
        print(f"  {name:18s} before {rows['before'][name]:6.3f}  after {rows['after'][name]:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
