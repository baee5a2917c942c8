"""`swarm experiment freezing` on `swarm-peer` processes: each setting is a local swarm (a bootstrap node and one
peer per stage, found through the DHT) trained by `swarm train`'s trainer, from one pretrained checkpoint.

The pretrained state (`--pretrain-epochs`, trained once in one process, untimed) is written as a local Hugging
Face checkpoint (config.json + model.safetensors) and every peer of every setting loads its own layers from it
(`--model DIR`): every setting fine-tunes from the same weights over the same batches, as in one process.

Settings: `no-freeze` (a trainer without `--freeze`), `freeze` (`--freeze`: the trainer's `FreezePolicy` on the
stages' per-block gradient norms, every stage applying the prefix at the same Step; the peers run with
`--no-repack`, so the plan keeps its stages) and `freeze+repack` (the same, and the elected planner's
`RepackWatch` publishes `repack_plan` once every stage reports the grown prefix: the active layers move onto
fewer stages live and the freed peers become replicas of the remaining ones where they bring compute of their own,
else standbys, `swarm.daemon.repack`: on one machine the peers share its cores, so they stand by).

Figures per setting, from the run itself: samples/s over the steps after the first (steps.csv's completion
times: the swarm's start and the first step's first sights are left out, the same window in every setting),
samples per CPU-second of the whole swarm while it trains (`cpu_s`: peers, bootstrap node, their p2pd daemons
and the trainer's process, user + system; the first step and the final evaluation included, in every setting
alike: on a shared machine wall-clock samples/s measures the neighbours' load as much as the swarm's),
held-out loss (the trainer's evaluation after the last step), wire bytes (the trainer's summary), `stages`
(the newest plan's, after any repack) and `stage_history` (the plans the trainer trained on, in order),
`replicas` (per stage of the newest plan), and `cache_hits`: samples the frozen stages answered from the
activation cache (every peer's `swarm_frozen_cache_hits_total`, read over Status before the swarm stops).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

__all__ = ["live_setting", "write_checkpoint"]

CACHE_METRIC = "swarm_frozen_cache_hits_total"


def write_checkpoint(model, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """`weights` (global parameter names, as the stages name them) as a local Hugging Face checkpoint of `model`
    that every peer loads its own layers from (`--model out`); a tied model's head copy is left out (the
    embedding is the head)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.hf_config().to_json_file(str(out / "config.json"))
    tensors = {k: v.detach().contiguous().clone() for k, v in weights.items()}
    if model.tied_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _peer_flags(setting: str, cfg, checkpoint: Path, total_steps: int, warmup_steps: int) -> list[str]:
    """Every peer's flags: the checkpoint, the fine-tuning's optimizer, the codecs, and a reproducible plan
    (even layers, declared compute, no link probes); the freeze-only setting's planner does not repack."""
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig, peer_flags
    from swarm.options import MODEL_FLAGS, CodecFlags, ModelFlags
    from swarm.runtime.worker import OptimConfig

    planning = PlanningConfig(
        even_layers=True,
        probe_links=False,
        codec_policy="fixed",  # the settings' codecs on every link: freezing is what is compared
        micro_batch_size=max(1, cfg.batch_size // cfg.n_micro),
        micro_batches=cfg.n_micro,
        repack=setting == "freeze+repack",
        heartbeat_s=2.0,  # on a loaded 2-core machine a peer busy computing missed 3 s of heartbeats: a needless
        gone_after_s=60.0,  # re-plan in the timed window; a dead peer is not what this experiment measures
        planner_lease_s=30.0,  # likewise a planner's lease lapsing while its process was descheduled
    )
    peer = PeerConfig(
        assign="plan",
        compute_layers_per_s=40.0,
        replicate_every=1_000_000,
        planning=planning,
        optim=OptimConfig(lr_peak=cfg.lr, warmup_steps=warmup_steps, total_steps=total_steps),
        **CodecFlags(cfg.fw_codec, cfg.bw_codec).build(),
    )
    model = ModelFlags(model=str(checkpoint), seq_len=cfg.seq_len, model_seed=cfg.seed)
    return [*MODEL_FLAGS.to_argv(model), *peer_flags().to_argv(peer)]


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` and their descendants used so far (the DHT's p2pd
    daemons too); a process gone meanwhile counts what was read before it went, or nothing."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
    return total


def _cache_hits(swarm, record) -> int:
    """Samples every peer's frozen stages answered from the activation cache (its Status metrics; a peer that
    does not answer counts 0)."""
    from swarm.net.connect import GrpcConnector
    from swarm.proto import stage_pb2

    addresses = {p.peer_id: p.address for p in swarm.dht.peers()}
    connector = GrpcConnector(signer=swarm.signer)
    hits = 0
    try:
        for stage in record.document.stages:
            for pid in stage.peer_ids:
                if pid not in addresses:
                    continue
                try:
                    reply = connector.stage(addresses[pid], pid).Status(stage_pb2.Empty(), timeout=30)
                except Exception:  # noqa: BLE001 (a peer gone at the end: its hits are not counted, said by 0)
                    continue
                hits += int(dict(reply.metrics).get(CACHE_METRIC, 0.0))
    finally:
        connector.close()
    return hits


def live_setting(setting: str, cfg, checkpoint: Path, out: Path, say) -> dict:
    """Trains `setting` on a fresh local swarm of `cfg.n_stages` peers from `checkpoint`; its row (module doc)."""
    from swarm.model.hf import hf_model_config
    from swarm.testbed.local import local_swarm
    from swarm.train.freezing import FreezeConfig
    from swarm.train.trainer import TrainConfig, train

    steps_per_epoch = cfg.train_samples // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    warmup = max(1, round(total * cfg.warmup_fraction))
    model = hf_model_config(str(checkpoint), seq_len_tokens=cfg.seq_len, init_seed=cfg.seed)
    freeze = None
    if setting != "no-freeze":
        freeze = FreezeConfig(cfg.interval, cfg.tolerance, cfg.max_fraction, cfg.alpha, warmup_steps=warmup)
    run_dir = out / setting
    train_cfg = TrainConfig(
        model=model, train_samples=cfg.train_samples, eval_samples=cfg.eval_samples, batch_size=cfg.batch_size,
        micro_batches=cfg.n_micro, epochs=cfg.epochs, seed=cfg.seed, setting=setting, eval_every=0,
        chain_weights="equal", deadline_s=300.0, heartbeat_s=5.0, verify_fraction=cfg.verify_fraction,
        out=str(run_dir / "train"), freeze=freeze,
    )  # fmt: skip
    flags = _peer_flags(setting, cfg, checkpoint, total, warmup)
    with local_swarm(run_dir, cfg.n_stages, flags, timeout_s=300.0) as swarm:
        # CPU seconds of the whole swarm while it trains (peers, bootstrap node, their p2pd daemons, the trainer):
        # on a shared machine wall-clock samples/s measures the neighbours' load as much as the swarm's
        pids = [os.getpid()]  # the trainer's process, and under it every process the swarm started
        cpu = _cpu_s(pids)
        summary = train(train_cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        cpu = _cpu_s(pids) - cpu
        record = swarm.dht.get_plan(model.n_layers)
        hits = _cache_hits(swarm, record)
    with open(run_dir / "train" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    times = [float(r["time"]) for r in rows]
    seconds = times[-1] - times[0]
    history, versions = [], []
    for r in rows:  # the stage count of every plan the trainer trained on, in order
        if not versions or r["plan_version"] != versions[-1]:
            versions.append(r["plan_version"])
            history.append(int(r["stages"]) if r.get("stages") else None)
    frozen = int(float(rows[-1].get("frozen_layers") or 0)) if rows else 0
    result = {
        "setting": setting,
        "frozen_layers": max(frozen, record.document.frozen),
        "stages": record.document.n_stages,
        "stage_history": history,
        "replicas": list(record.document.replica_counts),
        "cache_hits": hits,
        "throughput_samples_s": (len(rows) - 1) * cfg.batch_size / seconds if seconds > 0 else 0.0,
        "cpu_s": cpu,
        "samples_per_cpu_s": len(rows) * cfg.batch_size / cpu if cpu > 0 else 0.0,
        "final_eval_loss": summary.held_out_loss,
        "total_wire_bytes": summary.total_wire_bytes,
        "train_seconds": seconds,
        "steps": len(rows),
        "plan_versions": len(versions),
        "curve": [
            {"step": i, "seconds": t - times[0], "loss": float(r["train_loss"]), "frozen_layers": _frozen(r)}
            for i, (r, t) in enumerate(zip(rows, times, strict=True))
        ],
    }
    say(
        f"{setting}: {len(rows)} steps, {result['throughput_samples_s']:.1f} samples/s, "
        f"{result['samples_per_cpu_s']:.2f} samples per CPU-second, stages {history} -> "
        f"{result['stages']} (replicas {result['replicas']}), frozen {result['frozen_layers']}, cache hits {hits}, "
        f"held-out {summary.held_out_loss}"
    )
    (run_dir / "row.json").write_text(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=2))
    return result


def _frozen(row: dict) -> int:
    value = row.get("frozen_layers")
    return int(float(value)) if value else 0


def quick_live(cfg):
    """The quick form on processes: 4 peers of one layer each, so freezing 3 layers repacks 4 stages onto 2 of
    2 replicas, the first stage entirely frozen (it answers from the cache)."""
    return replace(cfg, n_stages=4)
