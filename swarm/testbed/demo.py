"""`swarm demo`, the main job: a whole local swarm on 127.0.0.1 training the default model, then a summary.

It starts a DHT bootstrap node and `--peers` swarm-peer processes (each serving one stage, links shaped in
the application to `--rate-mbit`), trains with AQ-SGD activations and quantized gradients, prints a
summary (final loss, steps, wire bytes against fp32's, mean step time), writes a plot, and stops every
process it started, also when interrupted. Every call is authenticated and authorized as in any swarm:
the trainer signs with a key generated here (`--no-auth` turns that off, to measure what it costs).

It runs an owned run, as volunteers would join one: it makes an owner key, a planner key and a trainer key
in `<out>/run` and a manifest (`swarm run init`'s `init_run`) of the model, codecs and schedule the peers are
told; the first peer plans with the planner key, the trainer trains with the trainer key, and no other peer
can plan or train.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.flags import Flag, Flags, flag
from swarm.options import MODEL_FLAGS, MODEL_GROUP, CodecFlags, LinkShaping, ModelFlags
from swarm.runtime.device import DeviceError, check_device

if TYPE_CHECKING:
    from swarm.daemon.peer_config import PeerConfig
    from swarm.train.trainer import TrainConfig

_PEER_FLAGS = Flag(
    group="peers",
    only=("fw_codec", "link_shape", "auth", "precision", "device"),
    fields={
        "fw_codec": Flag(
            via=CodecFlags, covers=("fw_codec", "bw_codec"), only=("fw_codec", "bw_codec"), group="peers' links"
        ),
        "link_shape": Flag(
            via=LinkShaping, covers=("link_shape", "link_shapes"), only=("rate_mbit", "delay_ms"), group="peers' links"
        ),
    },
)
"""The peers' flags the demo takes (the rest are the demo's: stages, steps, checkpoints)."""
_TRAIN_FLAGS = Flag(
    group="training",
    only=(
        "train_samples",
        "batch_size",
        "micro_batches",
        "schedule",
        "epochs",
        "data",
        "freeze",
        "eval_every",
        "eval_max_share",
        "eval_samples",
    ),
    fields={"freeze": Flag(name="--freeze", prefix="freeze-", group="freezing (PipeTransformer)")},
)
"""The trainer's flags the demo takes (its model is `DemoConfig.model`'s)."""


def _peer() -> PeerConfig:
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig
    from swarm.peers.shaper import LinkShape

    # the demo shows its codecs (--fw-codec/--bw-codec, the defaults) at work on every link: fixed, not the
    # peers' default per-link choice (which on its 100 Mbit/s links takes 4-bit activations, docs/PLANNING.md)
    return PeerConfig(link_shape=LinkShape.from_mbit(100.0), planning=PlanningConfig(codec_policy="fixed"))


def _trainer() -> TrainConfig:
    from swarm.train.trainer import TrainConfig

    return TrainConfig(train_samples=256, batch_size=16, epochs=6)


@dataclass(frozen=True)
class DemoConfig:
    """`swarm demo`: how many peers, what they are told, and what the trainer trains."""

    peers: int = 2
    """swarm-peer processes, one pipeline stage each"""
    model: ModelFlags = field(default_factory=ModelFlags, metadata=flag(group=MODEL_GROUP))
    """The model of the peers and the trainer, as its flags name it: the peers get these flags (a Hugging Face
    model is named, not written out) and resolve it themselves, as the trainer does here."""
    out: str | None = None
    """output folder (none: runs/demo-<time>)"""
    peer: PeerConfig = field(default_factory=_peer, metadata={"flag": _PEER_FLAGS})
    """What every peer is told (links shaped to 100 Mbit/s unless --rate-mbit says otherwise)."""
    train: TrainConfig = field(default_factory=_trainer, metadata={"flag": _TRAIN_FLAGS})
    """What the trainer trains (256 samples, 16 a step, 6 epochs unless told otherwise)."""


@cache
def demo_flags() -> Flags[DemoConfig]:
    return Flags(DemoConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    demo_flags().add_to(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--save-model", metavar="DIR", help="at the end, write the model as a Hugging Face directory")


def peer_config(cfg: DemoConfig, out: Path) -> PeerConfig:
    """What the demo tells every peer: its flags, and a schedule and checkpoints that fit the run."""
    from swarm.train.run_length import run_steps

    train = cfg.train
    steps = run_steps(train)  # the peers' cosine ends where the trainer stops
    return replace(
        cfg.peer,
        optim=replace(cfg.peer.optim, total_steps=steps, warmup_steps=max(1, steps // 5)),  # 10% spiked the loss
        checkpoint_dir=str(out / "checkpoints"),
        checkpoint_every=max(1, steps),
        # the planner re-predicts the step from the peers' clocks after the first epoch and republishes the
        # plan; the trainer follows it through the DHT, so the summary's prediction is the calibrated one
        planning=replace(cfg.peer.planning, calibrate_after_steps=max(1, train.train_samples // train.batch_size)),
    )


def owned_run(where: Path, model: ModelFlags, peer: PeerConfig, fw_codec: str, bw_codec: str):
    """A fresh owned run in `where` (an earlier demo's there is replaced) whose manifest says what `peer` is told."""
    import shutil

    from swarm.daemon.run_cli import init_run

    shutil.rmtree(where, ignore_errors=True)
    optim = peer.optim
    return init_run(
        where, name="demo", model=model, fw_codec=fw_codec, bw_codec=bw_codec, lr=optim.lr_peak,
        warmup_steps=optim.warmup_steps, total_steps=optim.total_steps, data="swarm demo's data",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from swarm.daemon.peer_config import peer_flags
    from swarm.net.stream import StageCallError
    from swarm.testbed.local import local_swarm
    from swarm.train.trainer import format_summary, train

    cfg = demo_flags().from_args(args)  # a bad --freeze-* fails here, before any process starts
    model = cfg.model.build()  # and a bad --model
    out = Path(cfg.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda *_: None) if args.json else (lambda s: print(f"[demo] {s}", file=sys.stderr))
    try:
        check_device(cfg.peer.device)  # and a --device cuda without CUDA
    except DeviceError as e:
        print(f"swarm demo: {e}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    peer = peer_config(cfg, out)
    rate = peer.link_shape.rate_bytes_per_s
    rate_mbit = None if rate is None else rate * 8 / 1e6
    labels = CodecFlags.of(peer.fw_codec, peer.bw_codec)
    fw_codec, bw_codec = labels.fw_codec, labels.bw_codec
    shaped = "unshaped" if rate_mbit is None else f"shaped to {rate_mbit:g} Mbit/s"
    owned = owned_run(out / "run", cfg.model, peer, fw_codec, bw_codec)
    say(f"owned run {owned.run_id}: {owned.manifest_path}")
    say(f"starting a bootstrap node and {cfg.peers} peers (links {shaped})")
    argv = [*peer_flags().to_argv(peer), *MODEL_FLAGS.to_argv(cfg.model)]
    with local_swarm(out, cfg.peers, argv, say, run=owned) as swarm:
        route, procs = swarm.route, swarm.procs
        say(f"plan {swarm.plan_version}: all {cfg.peers} stages served: {', '.join(route)}")
        train_cfg = replace(cfg.train, model=model, setting=f"{fw_codec}/{bw_codec}", out=str(out))
        try:
            summary = train(train_cfg, swarm.path, quiet=args.json, signer=swarm.signer, dht=swarm.dht)
        except StageCallError as e:
            print(f"error: training failed: {e}", file=sys.stderr)
            return 1
        if args.save_model:  # from the live stages, as the last step left them (swarm.train.export_cli)
            from swarm.train.export_cli import held_out_of, save_model

            save_model(model, args.save_model, dht=swarm.dht, signer=swarm.signer, **held_out_of(cfg.train), say=say)
        codes = procs.close(sig=signal.SIGINT)  # a stop: each peer saves its own stage, none is handed over
    leftovers = {name: code for name, code in codes.items() if code not in (0, -2, -15)}
    result = {**asdict(summary), "total_s": time.perf_counter() - started, "peers": cfg.peers,
              "auth": peer.auth, "rate_mbit": rate_mbit, "fw_codec": fw_codec, "bw_codec": bw_codec,
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
