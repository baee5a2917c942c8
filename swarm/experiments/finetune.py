"""`swarm experiment finetune`: a Hugging Face model fine-tuned from a local checkpoint over a local swarm.

End to end, nothing downloaded: train a byte-level BPE tokenizer on the local corpus (the Python standard
library's sources, or `--data`), write the model (`--model`, default `llama-100m`) as a local sharded
safetensors checkpoint with that tokenizer beside it, start a bootstrap node and `--peers` swarm-peer processes
each given only `--model CHECKPOINT_DIR` (each stage reads its own layers' tensors from the shards), and train
`--steps` steps with the swarm's default codecs (AQ-SGD activations, gradq gradients) on tokenized windows.

It prints the loss of every step and, per peer, the layers and parameters it serves (its Status while the swarm
trains, before the first step and after the last) against the model's total, and checks issue 14's target:
the loss decreases over the run and no peer ever holds all layers. `--quick` does the same on `llama-tiny`
in seconds (the integration test). The checkpoint is a seeded initialisation written in the Hugging Face
format (no pretrained weights are available offline); loading it is the same path a real checkpoint takes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
from swarm.flags import Flags, flag

__all__ = ["FinetuneConfig", "add_arguments", "run", "run_finetune", "parameters_by_stage"]

_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")
_FIRST = ("embed_tokens", ".wte.", ".wpe.")


@dataclass(frozen=True)
class FinetuneConfig:
    """`swarm experiment finetune`: a Hugging Face checkpoint written locally, fine-tuned over a local swarm."""

    model: str = "llama-100m"
    """model preset to write and fine-tune (a preset of `swarm.model.hf.PRESETS`)"""
    peers: int = 3
    """swarm-peer processes, one stage each"""
    steps: int = 20
    """optimizer steps"""
    seq_len: int = 128
    """tokens per sample"""
    batch_size: int = 4
    """samples per step"""
    micro_batches: int = 2
    """micro-batches per step"""
    train_samples: int = 40
    """training samples. Two epochs in 20 steps of 4: from step 10 every sample comes back, and AQ-SGD sends
    deltas, not first sights"""
    lr: float = 6e-4
    """peak learning rate"""
    vocab: int | None = field(default=None, metadata=flag(skip=True))
    """Tokenizer vocabulary (None: the model's)."""
    data: str | None = None
    """a text file or folder (none: the Python standard library's sources)"""
    fw_codec: str = DEFAULT_FORWARD_CODEC
    """activation codec"""
    bw_codec: str = DEFAULT_BACKWARD_CODEC
    """gradient codec"""
    shard_mb: int = 200
    """checkpoint shard size, MB (several shards and an index, as real checkpoints have)"""
    seed: int = field(default=0, metadata=flag(skip=True))
    """Seed of the init and the data order."""


_FLAGS = Flags(FinetuneConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/finetune-<time>)")
    parser.add_argument("--quick", action="store_true", help="llama-tiny, 8 steps, 3 peers: the smoke test")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    cfg = _FLAGS.from_args(args)
    if args.quick:  # the smoke test: only the data and the codecs are the flags'
        return FinetuneConfig(
            model="llama-tiny", peers=3, steps=8, seq_len=32, batch_size=4, micro_batches=2, train_samples=16,
            lr=3e-3, data=cfg.data, fw_codec=cfg.fw_codec, bw_codec=cfg.bw_codec, shard_mb=1,
        )  # fmt: skip
    return cfg


def parameters_by_stage(checkpoint: Path, ranges: list[tuple[int, int]]) -> list[int]:
    """Parameters of each stage `ranges[s]` = [start, end) of the checkpoint's model, counted from the tensors'
    shapes in its safetensors files (no data read): a block's tensors go to the stage holding its layer, the
    embeddings to the first stage, the rest (final norm, head) to the last."""
    from math import prod

    from safetensors import safe_open

    from swarm.model.hf_weights import checkpoint_files

    counts = [0] * len(ranges)
    for name, path in checkpoint_files(checkpoint).items():
        with safe_open(str(path), framework="pt") as f:
            n = prod(f.get_slice(name).get_shape())
        layer = _LAYER.search(name)
        if layer is not None:
            i = int(layer.group(1))
            stage = next(s for s, (a, b) in enumerate(ranges) if a <= i < b)
        else:
            stage = 0 if any(k in name for k in _FIRST) else len(ranges) - 1
        counts[stage] += n
    return counts


def _write_checkpoint(cfg: FinetuneConfig, out: Path, say) -> tuple[Path, object]:
    """The tokenizer trained on the local corpus and the model's checkpoint beside it; returns (dir, config)."""
    from swarm.model.data import load_corpus
    from swarm.model.hf import PRESETS, hf_model_config, save_checkpoint, train_tokenizer

    if cfg.model not in PRESETS:
        raise SystemExit(f"--model {cfg.model}: expected a preset ({', '.join(sorted(PRESETS))})")
    model = hf_model_config(cfg.model, seq_len_tokens=cfg.seq_len, init_seed=cfg.seed)
    vocab = cfg.vocab or model.vocab_size
    text, source = load_corpus(cfg.data, 4_000_000)
    started = time.perf_counter()
    tokenizer = out / "tokenizer.json"
    train_tokenizer([text.decode("utf-8", errors="replace")], vocab, tokenizer)
    say(f"tokenizer: {vocab} tokens trained on {len(text):,} bytes of {source} in {time.perf_counter() - started:.1f}s")
    started = time.perf_counter()
    checkpoint = save_checkpoint(model, out / "checkpoint", max_shard_size=cfg.shard_mb << 20, tokenizer=str(tokenizer))
    shards = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    say(f"checkpoint: {len(shards)} safetensors shard(s) in {checkpoint} ({time.perf_counter() - started:.1f}s)")
    return checkpoint, hf_model_config(str(checkpoint), seq_len_tokens=cfg.seq_len, init_seed=cfg.seed)


def _stage_ranges(swarm, signer) -> list[tuple[str, int, int]]:
    """(peer id, layer_start, layer_end) of every stage, from its own Status."""
    from swarm.net.connect import GrpcConnector
    from swarm.proto import stage_pb2

    connector = GrpcConnector(signer=signer)
    try:
        rows = []
        for address, peer in zip(swarm.route, swarm.peers, strict=True):
            reply = connector.stage(address, peer).Status(stage_pb2.Empty(), timeout=30)
            rows.append((reply.peer_id, reply.layer_start, reply.layer_end))
        return rows
    finally:
        connector.close()


def _stop_without_handover(procs) -> None:
    """SIGINT to every peer first: each stops serving and exits without the graceful leave of SIGTERM, whose
    handover would move a leaving peer's layers onto the last one standing (all layers on one peer)."""
    for name, proc in procs.procs.items():
        if name.startswith("peer") and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for name, proc in procs.procs.items():
        if name.startswith("peer"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
    procs.close()


def _peer_flags(cfg: FinetuneConfig, checkpoint: Path) -> list[str]:
    """Every peer's flags: the checkpoint by its --model name (a Hugging Face model is written by its name, not
    its config), the codecs and schedule, and fixed even stages, declared compute and no link probes: the plan
    does not depend on noisy measurements."""
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig, peer_flags
    from swarm.options import MODEL_FLAGS, CodecFlags, ModelFlags
    from swarm.runtime.worker import OptimConfig

    planning = PlanningConfig(
        even_layers=True,
        probe_links=False,
        codec_policy="fixed",  # the flags' codecs on every link
        micro_batch_size=max(1, cfg.batch_size // cfg.micro_batches),
        micro_batches=cfg.micro_batches,
    )
    peer = PeerConfig(
        assign="plan",
        compute_layers_per_s=1.0,
        replicate_every=1000000,
        planning=planning,
        optim=OptimConfig(lr_peak=cfg.lr, total_steps=cfg.steps, warmup_steps=max(1, cfg.steps // 5)),
        **CodecFlags(cfg.fw_codec, cfg.bw_codec).build(),
    )
    model = ModelFlags(model=str(checkpoint), seq_len=cfg.seq_len, model_seed=cfg.seed)
    return [*MODEL_FLAGS.to_argv(model), *peer_flags().to_argv(peer)]


def run_finetune(cfg: FinetuneConfig, out: Path, say=print) -> dict:
    """Runs the experiment and returns its result (also written to `out`/result.json)."""
    from swarm.testbed.local import local_swarm
    from swarm.train.trainer import TrainConfig, train

    out.mkdir(parents=True, exist_ok=True)
    checkpoint, model = _write_checkpoint(cfg, out, say)
    flags = _peer_flags(cfg, checkpoint)
    train_cfg = TrainConfig(
        model=model, data=cfg.data, train_samples=cfg.train_samples, batch_size=cfg.batch_size,
        micro_batches=cfg.micro_batches, steps=cfg.steps, seed=cfg.seed, setting=f"{cfg.fw_codec}/{cfg.bw_codec}",
        deadline_s=600.0, out=str(out),
    )  # fmt: skip
    say(f"starting a bootstrap node and {cfg.peers} peers, each with --model {checkpoint}")
    with local_swarm(out, cfg.peers, flags, say, timeout_s=600.0) as swarm:
        before = _stage_ranges(swarm, swarm.signer)
        summary = train(train_cfg, swarm.path, quiet=True, signer=swarm.signer)
        after = _stage_ranges(swarm, swarm.signer)
        _stop_without_handover(swarm.procs)
    with open(out / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    losses = [float(r["train_loss"]) for r in steps]
    ranges = [(a, b) for _, a, b in after]
    params = parameters_by_stage(checkpoint, ranges)
    total = parameters_by_stage(checkpoint, [(0, model.n_layers)])[0]
    peers = [
        {"peer": p[:12], "layers": [a, b], "parameters": n, "share": n / total}
        for (p, a, b), n in zip(after, params, strict=True)
    ]
    whole = [r for r in before + after if r[1] == 0 and r[2] == model.n_layers]
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    result = {
        "model": cfg.model,
        "total_parameters": total,
        "layers": model.n_layers,
        "steps": len(losses),
        "losses": losses,
        "mean_step_s": summary.mean_step_s,
        "seconds": summary.seconds,
        "replans": summary.replans,
        "peers": peers,
        "first_quarter_loss": first,
        "last_quarter_loss": last,
        "loss_decreased": last < first and losses[-1] < losses[0],
        # before the first step and after the last, each peer its own slice, and no re-plan in between
        "no_peer_holds_all_layers": not whole
        and len({p for p, _, _ in before + after}) == cfg.peers
        and before == after
        and summary.replans == 0,
        "total_wire_bytes": summary.total_wire_bytes,
        "total_ratio_vs_fp32": summary.total_ratio_vs_fp32,
        "config": asdict(cfg),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def format_result(result: dict) -> str:
    lines = [f"{result['model']}: {result['total_parameters']:,} parameters, {result['layers']} layers"]
    lines += [f"  step {i:3d}  loss {loss:.4f}" for i, loss in enumerate(result["losses"])]
    lines.append(
        f"  {result['mean_step_s']:.2f} s/step, {result['seconds']:.0f} s in all, {result['replans']} re-plans"
    )
    for p in result["peers"]:
        a, b = p["layers"]
        lines.append(f"  peer {p['peer']}: layers [{a}, {b}), {p['parameters']:,} parameters ({p['share']:.1%})")
    lines.append(
        f"[{'met' if result['loss_decreased'] else 'MISSED'}] loss decreased over the run "
        f"({result['first_quarter_loss']:.4f} -> {result['last_quarter_loss']:.4f}, first/last quarter means)"
    )
    lines.append(f"[{'met' if result['no_peer_holds_all_layers'] else 'MISSED'}] no peer ever held all layers")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    out = args.out or Path("runs") / f"finetune-{time.strftime('%Y%m%d-%H%M%S')}"
    say = (lambda *_: None) if args.json else (lambda s: print(f"[finetune] {s}", file=sys.stderr))
    result = run_finetune(cfg, out, say)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0 if result["loss_decreased"] and result["no_peer_holds_all_layers"] else 1
