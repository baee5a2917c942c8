"""Bits per element on the wire and error of backward (activation-gradient) codecs, on real gradients.

Captures the activation gradients that cross the stage boundary of the default convergence model (a 2-stage
`LocalPipeline`, fp32 backward, the convergence experiment's data and batch sizes), then encodes each with
every candidate codec, as the runtime does: one `LinkState` per candidate, error feedback across the
micro-batches of a step (`end_step` after each step), framed with zstd level 1 where it shrinks the message
(`swarm.compression.frame`, the runtime's framing). Bytes are the serialized chunks' sizes, framing included.

`--tensors tied` measures the tied-embedding gradient instead (one per step, stage 0's copy, as the tied sync
sends it), so every step is one message.

Columns: bits/elem = wire bits per gradient element (payload, scales, protobuf and zstd framing);
msg err = mean over messages of ||g - decode|| / ||g||; step err = the same for each step's sum over its
micro-batches (what the weight gradients see: error feedback pays off here).

    python scripts/measure_backward_codecs.py [--steps 24] [--skip 8] [--tensors tied] [--candidates L@G,...] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

import torch

from swarm.compression import CodecConfig, LinkState, make_codec
from swarm.compression.codec_raw import FP32Codec
from swarm.compression.framing import frame

CANDIDATES = (
    ("gradq4", 1024),
    ("gradq4+ef", 1024),
    ("gradq4+ef", 256),
    ("gradq2", 1024),
    ("gradq2+ef", 1024),
    ("gradq2+ef", 256),
    ("gradq2+ef", 4096),
    ("gradq2+ef+nr", 1024),
    ("gradq2+ef+nr", 256),
    ("gradq2+ef+bs", 1024),
    ("gradq2+ef+cs", 1024),
    ("gradq2+ef+rot", 1024),
    ("gradq2+ef+rot", 256),
    ("gradq2+ef+rot", 4096),
    ("gradq2+ef+rot+cs", 256),
    ("gradq2+ef+rot+cs", 1024),
    ("gradq2+ef+rot+cs", 4096),
    ("gradq2+ef+rot+nr", 1024),
    ("gradq2+ef+rot+nr", 256),
    ("gradq2+ef+rot+cs+nr", 256),
    ("gradq2+ef+rot+cs+nr", 1024),
    ("gradq3+ef+rot+cs", 1024),
)
"""(label, group size) pairs measured; stochastic rounding unless `+nr`."""


def capture(steps: int, skip: int, tensors: str = "boundary") -> list[list[torch.Tensor]]:
    """The boundary gradients of `steps` training steps (after `skip` steps), per step, per micro-batch; or,
    with `tensors="tied"`, stage 0's tied-embedding gradient of each step (what the tied sync sends)."""
    from swarm.experiments.convergence import ExperimentConfig
    from swarm.model.data import build_datasets, epoch_batches
    from swarm.runtime.inprocess import LocalPipeline
    from swarm.runtime.worker import StageConfig

    cfg = ExperimentConfig()
    n_keep = cfg.n_micro if tensors == "boundary" else 1
    train, _, _ = build_datasets(cfg.data)
    captured: list[torch.Tensor] = []
    original = FP32Codec.encode

    def recording(self, x, **kwargs):
        captured.append(x.detach().float().clone())
        return original(self, x, **kwargs)

    total = len(train) // cfg.batch_size * cfg.epochs  # the experiment's learning-rate schedule
    optim = replace(cfg.optim, total_steps=total, warmup_steps=max(1, round(total * cfg.warmup_fraction)))
    fw, bw = CodecConfig(name="fp16"), CodecConfig(name="fp32")
    pipe = LocalPipeline(cfg.model, 2, fw, bw, schedule=cfg.schedule, stage_cfg=StageConfig(optim, False))
    per_step: list[list[torch.Tensor]] = []
    FP32Codec.encode = recording
    try:
        done, epoch = 0, 0
        while done < skip + steps:
            for batch in epoch_batches(train, cfg.batch_size, epoch, cfg.data_seed):
                captured.clear()
                pipe.train_step(batch, cfg.n_micro)
                if done >= skip:  # 3-D: the boundary's [B, T, D] gradients; 2-D: the tied embedding's
                    per_step.append([t for t in captured if (t.dim() == 3) == (tensors == "boundary")][:n_keep])
                done += 1
                if done >= skip + steps:
                    break
            epoch += 1
    finally:
        FP32Codec.encode = original
        pipe.close()
    return per_step


def measure(label: str, group: int, steps: list[list[torch.Tensor]]) -> dict:
    config = CodecConfig.parse(label, group_size=group, stochastic=True, zstd_level=1, seed=1)
    codec, state = make_codec(config), LinkState(config)
    decoder = make_codec(CodecConfig(name="gradq"))  # decodes by the message alone
    wire = numel = 0
    msg_err, step_err, seconds = [], [], 0.0
    for grads in steps:
        total = torch.zeros_like(grads[0])
        decoded_total = torch.zeros_like(grads[0])
        for g in grads:
            start = time.perf_counter()
            msg = codec.encode(g, state=state)
            wire += sum(c.ByteSize() for c in frame(msg, zstd_level=1))
            d = decoder.decode(msg)
            seconds += time.perf_counter() - start
            numel += g.numel()
            msg_err.append(float((g - d).norm() / g.norm()))
            total += g
            decoded_total += d
        state.end_step()
        step_err.append(float((total - decoded_total).norm() / total.norm()))
    return {
        "codec": label,
        "group_size": group,
        "bits_per_element": 8 * wire / numel,
        "msg_rel_error": sum(msg_err) / len(msg_err),
        "step_rel_error": sum(step_err) / len(step_err),
        "encode_decode_ms": 1000 * seconds / len(msg_err),
        "messages": len(msg_err),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24, help="training steps whose gradients are measured")
    p.add_argument("--skip", type=int, default=8, help="training steps run before capturing")
    p.add_argument("--tensors", choices=("boundary", "tied"), default="boundary", help="which gradients")
    p.add_argument("--candidates", help="comma-separated LABEL@GROUP to measure instead of the built-in list")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    steps = capture(args.steps, args.skip, args.tensors)
    shape = tuple(steps[0][0].shape)
    print(f"{sum(map(len, steps))} gradients of shape {shape} from {len(steps)} steps", file=sys.stderr)
    candidates = CANDIDATES
    if args.candidates:
        candidates = [(c.split("@")[0], int(c.split("@")[1])) for c in args.candidates.split(",")]
    rows = [measure(label, group, steps) for label, group in candidates]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'codec':<22}{'group':>6}{'bits/elem':>10}{'msg err':>9}{'step err':>9}{'ms/msg':>8}")
    for r in rows:
        print(
            f"{r['codec']:<22}{r['group_size']:>6}{r['bits_per_element']:>10.3f}{r['msg_rel_error']:>9.3f}"
            f"{r['step_rel_error']:>9.3f}{r['encode_decode_ms']:>8.2f}"
        )
    assert all(math.isfinite(r["bits_per_element"]) for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
