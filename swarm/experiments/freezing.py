"""`swarm experiment freezing`: PipeTransformer's freezing, activation cache and elastic repack.

By default every setting runs on `swarm-peer` processes, a local swarm per setting trained by `swarm train`'s
trainer, where the repack is the live planner's and the freed peers become replicas (where they bring compute of
their own; peers on one machine's cores stand by instead)
(`swarm.experiments.freezing_live`). `--in-process` runs the settings below in one process instead.

Three runs from the same seed over the same batches: without freezing, with freezing (the trainer's
`FreezePolicy` on the per-block gradient norms; frozen layers get no backward and no optimizer step, a stage
frozen through its input runs forward only and answers samples it already sent from the AQ-SGD sender buffer),
and with freezing + repack (each time the frozen prefix grows, `swarm.daemon.repack` re-packs the layers onto
fewer stages; the pipeline is rebuilt with the new layout and every weight and AdamW moment moves over by name).

In-process (`--in-process`, `LocalPipeline`): on the 2 cores this runs on, processes would
share the same cores, while the savings freezing brings (skipped backward, skipped optimizer, cached forward,
fewer boundaries to encode and decode) are real compute saved in one process too, and the byte counts are the
stream items' as in a swarm. What one process cannot show is the repack's other half: the freed peers become
replicas of the remaining stages in a swarm (`repack_plan`), but replicas in one process do not run in
parallel, so the repacked run here has one host per stage and gains only what fewer stages save.

The model is a byte-level Llama, untied, or tied with `--tied` (its frozen prefix freezes the tied pair, embedding
and head copy, so the frozen stage can answer from the cache: `swarm.runtime.freeze`). Freezing follows a criterion
that needs the gradients to settle (windows of `--interval` steps after the learning-rate
warm-up, relative change of each block's mean gradient norm under `--tolerance`) in PipeTransformer's setting,
fine-tuning: `--pretrain-epochs` are trained once without freezing (untimed), and every setting fine-tunes from
those weights with a fresh optimizer and a lower learning rate, over the same batches.

Timing: one pass of the three settings on a shared machine put freeze+repack's speedup anywhere from 1.17x to
1.62x. So the three settings run `--repeats` rounds, interleaved (round k starts at setting k, so none is always
first or last), and each speedup is the median of the per-round ratios to that round's no-freeze, reported with
its min-max; throughput is the median of the rounds. Every round computes the same thing (same start, batches
and seeds): losses, frozen layers and bytes are the first round's, and the rounds' held-out losses are kept to
show it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.daemon.repack import repack_layout
from swarm.experiments import rotated
from swarm.flags import Flags, flag
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.model.gpt import split_layers
from swarm.model.hf import HFModelConfig, _canonical, _family_config_dict
from swarm.plots import Panel, moving_average, save_line_plots
from swarm.runtime.freeze import FreezePolicy, set_frozen
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import OptimConfig, StageConfig

__all__ = [
    "FreezingExperimentConfig",
    "SETTINGS",
    "add_arguments",
    "byte_llama",
    "run",
    "run_experiment",
    "untied_llama",
]

SETTINGS = ("no-freeze", "freeze", "freeze+repack")


@dataclass(frozen=True)
class FreezingExperimentConfig:
    """`swarm experiment freezing`: from one seed, no freezing, PipeTransformer's freezing, and freezing + repack."""

    n_layers: int = field(default=8, metadata=flag(name="--layers"))
    """model layers"""
    hidden: int = 128
    """model width"""
    seq_len: int = field(default=64, metadata=flag(skip=True))
    """Tokens per sample."""
    n_stages: int = field(default=4, metadata=flag(name="--stages"))
    """pipeline stages before any repack"""
    batch_size: int = field(default=16, metadata=flag(skip=True))
    """Samples per step."""
    n_micro: int = field(default=4, metadata=flag(skip=True))
    """Micro-batches per step."""
    train_samples: int = field(default=256, metadata=flag(skip=True))
    """Training samples."""
    eval_samples: int = field(default=64, metadata=flag(skip=True))
    """Held-out samples."""
    pretrain_epochs: int = 12
    """untimed epochs trained once, without freezing, to the state every setting fine-tunes from. After 6 the
    model still learned in every layer and freezing cost +1.7% held-out loss; after 12, +0.8% (one seed)"""
    pretrain_lr: float = field(default=2e-3, metadata=flag(skip=True))
    """Peak learning rate of the pre-training."""
    epochs: int = 6
    """fine-tuning epochs per setting (timed)"""
    lr: float = field(default=5e-4, metadata=flag(skip=True))
    """Peak learning rate of the fine-tuning."""
    warmup_fraction: float = field(default=0.1, metadata=flag(skip=True))
    """Share of the fine-tuning steps that warm the learning rate up."""
    interval: int = 8
    """steps per window of the criterion"""
    tolerance: float = 0.1
    """settled below this change: a block whose mean gradient norm moved by less than this fraction between
    windows has settled"""
    max_fraction: float = 0.75
    """freeze at most this fraction of the layers (PipeTransformer's alpha-style cap)"""
    alpha: float = 1 / 3
    """one decision freezes at most this fraction of the active layers (PipeTransformer's alpha; its paper's
    conservative 1/3: 8 layers freeze 2, 2, 1, 1 where the criterion allows)"""
    tied: bool = False
    """tie the token embedding and the LM head (the frozen prefix then freezes the tied pair)"""
    verify_fraction: float = 0.0
    """on processes: the trainer's audits of replicated stages' work (`swarm train --verify-fraction`; its default
    0.1). Off by default here: only the repacked plan has replicas, and in the quick run the audits' recomputes
    and records (400-660 KB through the trainer on an audited step) cost more than freezing saved"""
    in_process: bool = False
    """run the settings in one process (`LocalPipeline`) instead of a local swarm of swarm-peer processes"""
    fw_codec: str = field(default=DEFAULT_FORWARD_CODEC, metadata=flag(skip=True))
    """Activation codec of the stage links."""
    bw_codec: str = field(default=DEFAULT_BACKWARD_CODEC, metadata=flag(skip=True))
    """Gradient codec of the stage links."""
    seed: int = 0
    """model and data seed"""
    repeats: int = 3
    """interleaved timed rounds of the three settings; speedups are the median of the rounds' ratios (module
    doc)"""


QUICK = {
    "n_layers": 4,
    "interval": 4,
    "hidden": 64,
    "n_stages": 2,
    "train_samples": 96,
    "eval_samples": 32,
    "pretrain_epochs": 4,
    "epochs": 6,
}
QUICK_LIVE = {"n_stages": 4, "repeats": 1, "epochs": 8, "interval": 3, "tolerance": 0.25, "alpha": 0.75}
"""On processes: 4 peers of one layer, so 3 frozen layers repack 4 stages onto 2 of 2 replicas, stage 0 entirely
frozen (answering from the cache); one round, and a criterion quick enough to get there with epochs to spare (at
interval 4, tolerance 0.1 and alpha 1/3 it froze 2 layers by step 32 of 36: no repack)."""


def byte_llama(n_layers: int, hidden: int, seq_len: int, seed: int = 0, tied: bool = False) -> HFModelConfig:
    """A byte-level Llama, its head untied (or tied), built in code (nothing downloaded)."""
    config = dict(
        vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(seq_len, 128),
        tie_word_embeddings=tied, initializer_range=0.02,
    )  # fmt: skip
    return HFModelConfig("llama", _canonical("llama", _family_config_dict("llama", config)), seq_len, seed)


def untied_llama(n_layers: int, hidden: int, seq_len: int, seed: int = 0) -> HFModelConfig:
    """A byte-level Llama with an untied head, built in code (nothing downloaded)."""
    return byte_llama(n_layers, hidden, seq_len, seed)


def _transplant(old: LocalPipeline, new: LocalPipeline, frozen: int) -> None:
    """Every weight and AdamW moment of `old` into `new` by parameter name (names are global), the frozen
    prefix applied; `new` continues at `old`'s step."""
    held = {}
    for w in old.workers:
        for name, p in w.module.named_parameters():
            held[name] = (p, w.optimizer.state.get(p), w.step_count)
    for host in new.hosts:
        w = host.worker
        for name, p in w.module.named_parameters():
            src, state, steps = held[name]
            p.data.copy_(src.data)
            if state:
                w.optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            w.step_count = steps
        host.gate.forward_only = set_frozen(w, frozen)
    new._step = old._step
    new.freeze = old.freeze


def _close(pipe: LocalPipeline) -> None:
    """Closes the driver and every host's connector, and collects the garbage now."""
    pipe.close()
    for host in (h for row in pipe.replica_hosts for h in row):
        host.close()
    gc.collect()


def _pretrain(cfg: FreezingExperimentConfig, model, train, say) -> dict[str, torch.Tensor]:
    """The state every setting fine-tunes from: `pretrain_epochs` without freezing (weights by global name)."""
    total = max(1, len(train) // cfg.batch_size * cfg.pretrain_epochs)
    optim = OptimConfig(lr_peak=cfg.pretrain_lr, warmup_steps=max(1, round(total * 0.2)), total_steps=total)
    forward, backward = CodecConfig.parse(cfg.fw_codec), CodecConfig.parse(cfg.bw_codec)
    pipe = LocalPipeline(model, cfg.n_stages, forward, backward, stage_cfg=StageConfig(optim))
    for epoch in range(cfg.pretrain_epochs):
        for batch in epoch_batches(train, cfg.batch_size, 1000 + epoch, cfg.seed):
            result = pipe.train_step(batch, cfg.n_micro)
        say(f"pretrain (in one process, untimed): epoch {epoch + 1}/{cfg.pretrain_epochs} loss {result.loss:.4f}")
    weights = {k: p.detach().clone() for w in pipe.workers for k, p in w.module.named_parameters()}
    _close(pipe)
    return weights


def _run_setting(setting: str, cfg: FreezingExperimentConfig, model, train, evals, say, start=None) -> dict:
    steps_per_epoch = len(train) // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    optim = OptimConfig(lr_peak=cfg.lr, warmup_steps=max(1, round(total * cfg.warmup_fraction)), total_steps=total)
    stage_cfg = StageConfig(optim)
    forward, backward = CodecConfig.parse(cfg.fw_codec), CodecConfig.parse(cfg.bw_codec)
    layout = split_layers(cfg.n_layers, cfg.n_stages)
    pipe = LocalPipeline(model, cfg.n_stages, forward, backward, stage_cfg=stage_cfg, layers=layout)
    with torch.no_grad():
        for w in pipe.workers if start else ():
            for name, p in w.module.named_parameters():
                p.copy_(start[name])
    if setting != "no-freeze":
        pipe.freeze = FreezePolicy(
            cfg.n_layers,
            cfg.interval,
            cfg.tolerance,
            cfg.max_fraction,
            alpha=cfg.alpha,
            warmup_steps=optim.warmup_steps,
        )
    limit = max(b - a for a, b in layout)
    rows, wire, seconds, frozen, stages, hits = [], 0, 0.0, 0, [len(layout)], 0
    for epoch in range(cfg.epochs):
        for batch in epoch_batches(train, cfg.batch_size, epoch, cfg.seed):
            start = time.perf_counter()
            result = pipe.train_step(batch, cfg.n_micro)
            now = pipe.freeze.frozen if pipe.freeze is not None else 0
            if setting == "freeze+repack" and now != frozen:
                ranges, _ = repack_layout(cfg.n_layers, now, cfg.n_stages, limit, cfg.n_stages)
                # only when the stages get fewer: in one process a rebalance alone buys nothing to pay its first
                # sights for, and one host per stage, as replicas in one process would not run in parallel
                if len(ranges) < len(layout):
                    layout, repacked = (
                        ranges,
                        LocalPipeline(model, len(ranges), forward, backward, stage_cfg=stage_cfg, layers=ranges),
                    )
                    _transplant(pipe, repacked, now)
                    hits += sum(w.cache_hits for w in pipe.workers)
                    _close(pipe)
                    pipe = repacked
                    stages.append(len(ranges))
            frozen = now
            seconds += time.perf_counter() - start
            wire += result.total_wire_bytes
            rows.append({"step": len(rows), "seconds": seconds, "loss": result.loss, "frozen_layers": frozen})
        say(f"{setting}: epoch {epoch + 1}/{cfg.epochs} loss {rows[-1]['loss']:.4f} frozen {frozen} stages {stages}")
    final = pipe.evaluate(evals, cfg.batch_size * 2)
    samples = len(rows) * cfg.batch_size
    hits += sum(w.cache_hits for w in pipe.workers)
    _close(pipe)
    return {
        "setting": setting,
        "frozen_layers": frozen,
        "stages": stages[-1],
        "stage_history": stages,
        "throughput_samples_s": samples / seconds,
        "final_eval_loss": final,
        "total_wire_bytes": wire,
        "train_seconds": seconds,
        "steps": len(rows),
        "cache_hits": hits,
        "curve": rows,
    }


def run_experiment(cfg: FreezingExperimentConfig, out: Path, say=lambda s: None) -> list[dict]:
    torch.manual_seed(cfg.seed)
    model = byte_llama(cfg.n_layers, cfg.hidden, cfg.seq_len, cfg.seed, tied=cfg.tied)
    data = DataConfig(seq_len_tokens=cfg.seq_len, train_samples=cfg.train_samples, eval_samples=cfg.eval_samples)
    train, evals, _ = build_datasets(data)
    rounds = []
    if cfg.in_process:
        start = _pretrain(cfg, model, train, say) if cfg.pretrain_epochs else None
        # untimed: the first setting run in a process ran 3-6x slower than the same setting run again (not the
        # garbage collector, not lingering threads; cause not found), so one epoch of it runs first, discarded
        _run_setting("no-freeze", replace(cfg, epochs=1), model, train, evals, lambda *_: None, start)
        run_setting = lambda s, k, quiet: _run_setting(s, cfg, model, train, evals, quiet, start)  # noqa: E731
    else:
        from swarm.experiments.freezing_live import live_setting, write_checkpoint

        checkpoint = write_checkpoint(model, _pretrain(cfg, model, train, say), out / "checkpoint")
        say(f"pretrained checkpoint: {checkpoint}; every setting: a local swarm of {cfg.n_stages} swarm-peer processes")
        run_setting = lambda s, k, quiet: live_setting(s, cfg, checkpoint, out / f"round{k + 1}", quiet)  # noqa: E731
    for k in range(max(1, cfg.repeats)):
        order = rotated(SETTINGS, k)
        quiet = say if k == 0 or not cfg.in_process else (lambda *_: None)
        rounds.append({s: run_setting(s, k, quiet) for s in order})
        say(f"round {k + 1}/{cfg.repeats}: " + ", ".join(f"{s} {rounds[-1][s]['train_seconds']:.1f} s" for s in order))
    results = [rounds[0][s] for s in SETTINGS]
    base = results[0]
    for r in results:
        runs = [rd[r["setting"]]["throughput_samples_s"] for rd in rounds]
        ratios = [rd[r["setting"]]["throughput_samples_s"] / rd["no-freeze"]["throughput_samples_s"] for rd in rounds]
        r["throughput_samples_s"], r["throughput_runs"] = statistics.median(runs), runs
        r["speedup"], r["speedup_runs"] = statistics.median(ratios), ratios
        r["final_eval_loss_runs"] = [rd[r["setting"]]["final_eval_loss"] for rd in rounds]
        r["cache_hits_runs"] = [rd[r["setting"]]["cache_hits"] for rd in rounds]
        if "samples_per_cpu_s" in r:  # on processes: the load-independent figure beside the wall clock's
            cpu = [rd[r["setting"]]["samples_per_cpu_s"] / rd["no-freeze"]["samples_per_cpu_s"] for rd in rounds]
            r["cpu_speedup"], r["cpu_speedup_runs"] = statistics.median(cpu), cpu
        r["on_processes"] = not cfg.in_process
        r["eval_loss_vs_no_freeze"] = r["final_eval_loss"] / base["final_eval_loss"] - 1
    out.mkdir(parents=True, exist_ok=True)
    panels = [
        Panel("training loss vs time", "seconds", "loss (moving average of 8)"),
        Panel("frozen layers vs time", "seconds", "frozen layers"),
    ]
    for r in results:
        xs = [row["seconds"] for row in r["curve"]]
        panels[0].series[r["setting"]] = (xs, moving_average([row["loss"] for row in r["curve"]], 8))
        panels[1].series[r["setting"]] = (xs, [row["frozen_layers"] for row in r["curve"]])
    save_line_plots(panels, out / "loss_vs_time.png", "swarm experiment freezing")
    (out / "table.md").write_text(format_table(results) + "\n")
    (out / "results.json").write_text(json.dumps({"config": asdict(cfg), "rows": _rows(results)}, indent=2))
    with open(out / "curves.json", "w") as f:
        json.dump({r["setting"]: r["curve"] for r in results}, f)
    return results


def _rows(results: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "curve"} for r in results]


def format_table(results: list[dict]) -> str:
    lines = [
        "| setting | frozen layers (end) | stages | samples/s (median) | speedup (median) | min-max of rounds | "
        "held-out loss | vs no-freeze | wire bytes | cache hits | samples per CPU-s | CPU speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratios = r.get("speedup_runs", [r["speedup"]])
        lines.append(
            f"| {r['setting']} | {r['frozen_layers']} | {'->'.join(map(str, r['stage_history']))} | "
            f"{r['throughput_samples_s']:.1f} | {r['speedup']:.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x "
            f"({len(ratios)}) | {r['final_eval_loss']:.4f} | "
            f"{100 * r['eval_loss_vs_no_freeze']:+.2f}% | {r['total_wire_bytes']:,} | {r['cache_hits']:,} | "
            + (f"{r['samples_per_cpu_s']:.2f} | {r['cpu_speedup']:.2f}x |" if "cpu_speedup" in r else "- | - |")
        )
    return "\n".join(lines)


_FLAGS = Flags(FreezingExperimentConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)
    add = parser.add_argument
    add("--quick", action="store_true", help="a small model and run (a few minutes on processes, one round)")
    add("--json", action="store_true", help="print the rows as JSON")
    add("--out", type=Path, default=None, help="output folder (default runs/freezing-<time>)")


def config_from_args(args: argparse.Namespace) -> FreezingExperimentConfig:
    cfg = _FLAGS.from_args(args)
    if not args.quick:
        return cfg
    return replace(cfg, **{**QUICK, **({} if cfg.in_process else QUICK_LIVE)})


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    out = args.out or Path("runs") / f"freezing-{time.strftime('%Y%m%d-%H%M%S')}"
    say = lambda s: print(f"[freezing] {s}", file=sys.stderr, flush=True)  # noqa: E731 (--json: rows on stdout)
    results = run_experiment(cfg, out, say)
    print(json.dumps(_rows(results), indent=2) if args.json else format_table(results) + f"\n\nwritten to {out}")
    return 0
