"""`swarm demo`, the main job: a whole local swarm on 127.0.0.1 training the default model, then a summary.

It starts a DHT bootstrap node and `--peers` swarm-peer processes (each serving one stage, links shaped in
the application to `--rate-mbit`), trains with AQ-SGD activations and quantized gradients, prints a
summary (final loss, steps, wire bytes against fp32's, mean step time), writes a plot, and stops every
process it started, also when interrupted. Every call is authenticated and authorized as in any swarm:
the trainer signs with a key generated here (`--no-auth` turns that off, to measure what it costs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from swarm.compression import DEFAULT_BW_CODEC, DEFAULT_FW_CODEC, codec_labels
from swarm.net.stream import StageCallError
from swarm.options import add_model_arguments, add_schedule_argument, model_arguments, model_config
from swarm.runtime.device import DeviceError, add_device_argument, check_device
from swarm.runtime.precision import add_precision_argument
from swarm.testbed.local import local_swarm
from swarm.train.freezing import add_freeze_arguments, freeze_config
from swarm.train.trainer import TrainConfig, format_summary, train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=2, help="swarm-peer processes, one pipeline stage each")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="bandwidth of every link, Mbit/s (0 = unshaped)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of every link, ms")
    parser.add_argument("--fw-codec", default=DEFAULT_FW_CODEC, help=f"activation codec: {codec_labels()}")
    parser.add_argument("--bw-codec", default=DEFAULT_BW_CODEC, help=f"gradient codec: {codec_labels()}")
    parser.add_argument("--epochs", type=int, default=6, help="passes over the training samples")
    parser.add_argument("--train-samples", type=int, default=256, help="training samples")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    add_schedule_argument(parser)
    parser.add_argument("--data", default=None, help="text file or folder (default: Python's own docstrings)")
    parser.add_argument("--out", default=None, help="output folder (default runs/demo-<time>)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="peers serve anonymous calls (measurement only; by default every call is signed and authorized)",
    )
    add_model_arguments(parser)
    add_precision_argument(parser)
    add_device_argument(parser)
    add_freeze_arguments(parser)  # --freeze: the trainer freezes, the swarm's planner repacks


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda *_: None) if args.json else (lambda s: print(f"[demo] {s}", file=sys.stderr))
    model = model_config(args)  # a bad --model fails here, before any process starts
    freeze = freeze_config(args)  # and a bad --freeze-*
    try:
        check_device(args.device)  # and a --device cuda without CUDA
    except DeviceError as e:
        print(f"swarm demo: {e}", file=sys.stderr)
        return 2
    model_flags = model_arguments(args)
    steps = args.epochs * (args.train_samples // args.batch_size)
    started = time.perf_counter()
    peer_flags = [
        "--fw-codec", args.fw_codec, "--bw-codec", args.bw_codec,
        "--rate-mbit", str(args.rate_mbit or 0), "--delay-ms", str(args.delay_ms),
        "--total-steps", str(steps), "--warmup-steps", str(max(1, steps // 5)),  # 10% spiked the loss
        "--checkpoint-dir", str(out / "checkpoints"), "--checkpoint-every", str(max(1, steps)),
        *model_flags, *(["--no-auth"] if args.no_auth else []), "--precision", args.precision,
        "--device", args.device,
        # the planner re-predicts the step from the peers' clocks after the first epoch and republishes the
        # plan; the trainer follows it through the DHT, so the summary's prediction is the calibrated one
        "--calibrate-after-steps", str(max(1, args.train_samples // args.batch_size)),
    ]  # fmt: skip
    say(f"starting a bootstrap node and {args.peers} peers (links shaped to {args.rate_mbit:g} Mbit/s)")
    with local_swarm(out, args.peers, peer_flags, say) as swarm:
        route, procs = swarm.route, swarm.procs
        say(f"plan {swarm.plan_version}: all {args.peers} stages served: {', '.join(route)}")
        train_cfg = TrainConfig(
            model=model, data=args.data, train_samples=args.train_samples,
            batch_size=args.batch_size, micro_batches=args.micro_batches, schedule=args.schedule,
            epochs=args.epochs, setting=f"{args.fw_codec}/{args.bw_codec}", out=str(out), freeze=freeze,
        )  # fmt: skip
        try:
            summary = train(train_cfg, swarm.path, quiet=args.json, signer=swarm.signer, dht=swarm.dht)
        except StageCallError as e:
            print(f"error: training failed: {e}", file=sys.stderr)
            return 1
        codes = procs.close()
    leftovers = {name: code for name, code in codes.items() if code not in (0, -15)}
    result = {**asdict(summary), "total_s": time.perf_counter() - started, "peers": args.peers,
              "auth": not args.no_auth, "rate_mbit": args.rate_mbit or None, "fw_codec": args.fw_codec,
              "bw_codec": args.bw_codec,
              "wire_ratio_vs_fp32": summary.fp32_wire_bytes / max(1, summary.wire_bytes),
              "sync_bytes_per_step": summary.sync_bytes / max(1, summary.steps),
              "peer_exit_codes": codes}  # fmt: skip
    (out / "demo.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        print(format_summary(summary))
        print(f"total:        {result['total_s']:.1f} s including start-up; every process stopped")
    if leftovers:
        print(f"warning: processes exited abnormally: {leftovers} (logs in {out / 'logs'})", file=sys.stderr)
    return 0
