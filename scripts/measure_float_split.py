"""What the framing's byte split (`ZSTD_SPLIT`) does to the default model's boundary tensors, against one zstd frame.

    python scripts/measure_float_split.py [--rounds 50] [--json]

Takes the default model's stage-0 output for one micro-batch of the embedded data set ([2, 128, 128]) and the
gradient of the loss with respect to it, as fp32, bf16 and fp16 codec messages; frames each at zstd level 1 as one
frame of the whole message (`ZSTD`) and split by byte significance (`ZSTD_SPLIT`), and prints the bytes on the wire
over the raw message and each way's median encode (frame) and decode (unframe) milliseconds.
"""

from __future__ import annotations

import argparse
import json

import torch

from swarm.compression import CodecConfig, frame, framing, make_codec, unframe
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.model.gpt import ModelConfig, build_stage, lm_loss, split_layers
from swarm.report import median_seconds


def boundary_tensors() -> dict[str, torch.Tensor]:
    """Stage 0's output for one micro-batch of 2 samples, and the gradient of the loss with respect to it."""
    torch.manual_seed(0)
    cfg = ModelConfig()
    (a0, b0), (a1, b1) = split_layers(cfg.n_layers, 2)
    first = build_stage(cfg, a0, b0, is_first=True, is_last=False)
    last = build_stage(cfg, a1, b1, is_first=False, is_last=True)
    train, _, _ = build_datasets(DataConfig(seq_len_tokens=cfg.seq_len_tokens, train_samples=32, eval_samples=0))
    batch = next(iter(epoch_batches(train, 8, 0, 0)))
    out = first(batch.tokens[:2]).detach().requires_grad_(True)
    lm_loss(last(out), batch.targets[:2]).backward()
    return {"activation": out.detach(), "gradient": out.grad.detach()}


def measure(rounds: int) -> list[dict]:
    rows = []
    for what, tensor in boundary_tensors().items():
        for name in ("fp32", "bf16", "fp16"):
            msg = make_codec(CodecConfig(name)).encode(tensor)
            raw = len(msg.SerializeToString())
            row = {"tensor": what, "codec": name, "raw_bytes": raw}
            for way, split in (("one_frame", False), ("split", True)):
                splitter = framing.split_float_bytes
                if not split:  # the framing without the split: one zstd frame of the whole message
                    framing.split_float_bytes = lambda msg, level: None
                try:
                    chunks = list(frame(msg, zstd_level=1))
                    assert unframe(chunks) == msg
                    row[f"{way}_ratio"] = sum(len(c.data) for c in chunks) / raw
                    encode = median_seconds(lambda m=msg: list(frame(m, zstd_level=1)), repeats=rounds)
                    decode = median_seconds(lambda c=chunks: unframe(c), repeats=rounds)
                    row[f"{way}_encode_ms"], row[f"{way}_decode_ms"] = 1e3 * encode, 1e3 * decode
                finally:
                    framing.split_float_bytes = splitter
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50, help="timed repetitions of each encode and decode")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    rows = measure(args.rounds)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| tensor | codec | one frame | split | encode ms (one / split) | decode ms (one / split) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['tensor']} | {r['codec']} | {r['one_frame_ratio']:.3f} | {r['split_ratio']:.3f} | "
            f"{r['one_frame_encode_ms']:.3f} / {r['split_encode_ms']:.3f} | "
            f"{r['one_frame_decode_ms']:.3f} / {r['split_decode_ms']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
