"""`swarm experiment hetero`: one slow peer, and what per-peer precision (QSync) recovers of what it costs.

By default on swarm-peer processes planning among themselves (`swarm.experiments.hetero_swarm`, which says how).
`--in-process`: the form below, the runtime's in-process pipeline (`LocalPipeline`: the stage hosts, links and
driver a swarm runs, each stage computing on its own thread; on a shared 2-core machine separate processes
measure their neighbours' load as much as their own), the precisions chosen once by this module from its own
measurements. One stage is slowed by
`ModuleThrottle`: after each forward and each backward of that stage it sleeps (factor - 1) times the CPU time
the pass took on its thread (torch runs one intra-op thread here, so a pass computes on the calling thread and
`time.thread_time` is its compute, unaffected by other processes' load). A peer `factor`x slower in every
precision: when it computes in bf16 its passes are shorter and so are its sleeps, as on a slower device.

Three runs, same seed, same batches: `equal` (no throttle, fp32), `slow-fp32` (the slow stage, fp32
everywhere) and `slow-planned` (the slow stage; after `plan_step` fp32 steps each stage's speed is measured
in fp32 and bf16 (its real module, throttle included, on a real micro-batch), each stage's sensitivity is
measured (`swarm.runtime.sensitivity`), the allocator (`swarm.scheduler.precision_choice`) chooses per-stage
precisions under the loss budget, and the stages switch between two steps). Throughput is over the steps
after `plan_step`, the same window in every run; `recovered` = (planned - slow) / (equal - slow) samples/s.
Target (issue 15): recovers >= 30% with held-out loss within 0.5% of `slow-fp32`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from swarm.flags import Flag, Flags, flag
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.model.gpt import ModelConfig
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.precision import PRECISIONS
from swarm.runtime.sensitivity import measure_sensitivity, set_stage_precision
from swarm.runtime.worker import OptimConfig, StageConfig
from swarm.scheduler.precision_choice import DEFAULT_BUDGET, choose_precisions

__all__ = [
    "ModuleThrottle",
    "HeteroConfig",
    "add_arguments",
    "apply_stage_precisions",
    "run",
    "run_experiment",
    "split_stage_precisions",
]

SETTINGS = ("equal", "slow-fp32", "slow-planned")
RECOVER_TARGET, LOSS_TOLERANCE, SLOW_COST_TARGET = 0.30, 0.005, 0.25


def split_stage_precisions(text: str) -> tuple[str, tuple[tuple[int, str], ...]]:
    """A convergence setting's per-peer-precision suffix: `FW/BW~bf16:1:2` -> ("FW/BW", ((1, "bf16"), (2, "bf16"))):
    the named stages compute in that precision, the others in the run's (":" between stages: --settings splits on
    commas). No suffix: ()."""
    rest, sep, suffix = text.partition("~")
    if not sep:
        return text, ()
    precision, colon, stages = suffix.partition(":")
    if precision not in PRECISIONS or not colon:
        raise ValueError(f"setting {text!r}: expected a suffix ~PRECISION:STAGE[,STAGE...], e.g. ~bf16:1")
    try:
        named = tuple(sorted({int(x) for x in stages.split(":")}))
    except ValueError:
        raise ValueError(f"setting {text!r}: stages must be integers, e.g. ~bf16:0:1") from None
    if not named or min(named) < 0:
        raise ValueError(f"setting {text!r}: stages must be integers >= 0")
    return rest, tuple((s, precision) for s in named)


def apply_stage_precisions(pipe: LocalPipeline, stage_precisions: tuple[tuple[int, str], ...]) -> None:
    """Sets the named stages' precision on every replica (`set_stage_precision`); a stage past the pipeline's is
    refused."""
    for stage, precision in stage_precisions:
        if stage >= len(pipe.replica_hosts):
            raise ValueError(f"stage {stage}: the pipeline has {len(pipe.replica_hosts)} stages")
        for host in pipe.replica_hosts[stage]:
            set_stage_precision(host.worker, precision)


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls `hook()` as the gradient passes (marks where a stage's backward starts and
    ends)."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None


class ModuleThrottle:
    """Makes a stage module `factor`x slower: sleeps (factor - 1) x the thread CPU time of each forward and
    backward (marks on its input and output time the backward). The stage's input must be a float tensor that
    needs a gradient (any stage but the first). Only training passes are slowed (evaluation is not timed).

    The in-process form's throttle. A swarm peer's (`swarm.runtime.throttle.ComputeThrottle`, `swarm-peer
    --compute-slowdown`) wraps the worker's calls and times them by the wall clock, since under load a peer's pass
    waits far longer than it computes. Here the stages share one process and torch one intra-op thread, so CPU
    time is each pass's own compute; and the hooks sit on the module itself, so the planned setting's speed
    measurements, which call the module directly, see the slower stage too."""

    def __init__(self, module: torch.nn.Module, factor: float):
        if not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.factor, self.backward_start, self._t0 = factor, 0.0, 0.0
        self.slept_s = 0.0
        self._handles = [
            module.register_forward_pre_hook(self._pre),
            module.register_forward_hook(self._post),
        ]

    def sleep(self, compute_s: float) -> None:
        pause = max(compute_s, 0.0) * (self.factor - 1)
        self.slept_s += pause
        time.sleep(pause)

    def _pre(self, module, args):
        if not torch.is_grad_enabled():
            return None
        self._t0 = time.thread_time()
        x = args[0]
        if x.is_floating_point() and x.requires_grad:
            return (_OnBackward.apply(x, self._backward_end), *args[1:])
        return None

    def _post(self, module, args, out):
        if not torch.is_grad_enabled():
            return None
        self.sleep(time.thread_time() - self._t0)
        return _OnBackward.apply(out, self._backward_start) if out.requires_grad else out

    def _backward_start(self) -> None:
        self.backward_start = time.thread_time()

    def _backward_end(self) -> None:
        self.sleep(time.thread_time() - self.backward_start)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


_MODEL_FLAGS = Flag(
    only=("hidden_dim", "n_layers", "init_seed"),
    fields={
        "hidden_dim": Flag(name="--hidden", help="model width"),
        "n_layers": Flag(name="--layers", help="transformer blocks"),
        "init_seed": Flag(name="--seed", help="model init and data shuffling seed"),
    },
)
_DATA_FLAGS = Flag(
    only=("path",), fields={"path": Flag(name="--data", help="a text file or folder of them (none: the Python "
                                                               "standard library's sources)")}
)  # fmt: skip


@dataclass(frozen=True)
class HeteroConfig:
    """`swarm experiment hetero`: one stage slowed, all-equal vs uniform fp32 vs planned per-stage precision."""

    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(hidden_dim=256, n_layers=4, n_heads=4), metadata={"flag": _MODEL_FLAGS}
    )
    """The model (its width, depth and seed are flags)."""
    data: DataConfig = field(default_factory=DataConfig, metadata={"flag": _DATA_FLAGS})
    """The data (its file is a flag)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr_peak=1e-3), metadata=flag(skip=True))
    """Optimizer and schedule of every stage."""
    n_stages: int = field(default=2, metadata=flag(name="--stages"))
    """pipeline stages"""
    slow_stage: int = 1
    """the slowed stage, >= 1 (not 0: its input must carry a gradient for the backward to be timed)"""
    slow_factor: float = 2.0
    """how much slower it is"""
    batch_size: int = field(default=16, metadata=flag(skip=True))
    """Samples per step."""
    n_micro: int = field(default=4, metadata=flag(skip=True))
    """Micro-batches per step."""
    epochs: int = 5
    """passes over the training samples"""
    plan_fraction: float = field(default=0.1, metadata=flag(skip=True))
    """share of the steps trained in fp32 before the planned run measures and chooses precisions"""
    budget: float = DEFAULT_BUDGET
    """loss budget: summed sensitivity"""
    sensitivity_batches: int = field(default=2, metadata=flag(skip=True))
    """Batches the sensitivity is measured on."""
    seed: int = 0
    """model init and data shuffling seed"""
    in_process: bool = False
    """run the pipeline's stages as threads of this process (`LocalPipeline`) instead of swarm-peer processes"""
    slow_peer: int = field(default=1, metadata=flag(skip=True))
    """On processes: which peer (in start order) is slowed; the planner decides which stage it serves."""
    placement: bool = False
    """on processes, also run slow-placed: the slow peer, fp32, the planner free to split the layers unevenly by
    speed (placement, not precision)"""
    repeats: int = 1
    """on processes: interleaved rounds of the settings (the median is reported)"""
    warm_fraction: float = field(default=0.2, metadata=flag(skip=True))
    """On processes: share of the steps left out of the throughput (start-up, first plans)."""


def _stage_time(pipe: LocalPipeline, stage: int, x: torch.Tensor, targets: torch.Tensor, precision: str) -> float:
    """Fastest of 5 forward+backward passes of the stage's live module (throttle included) in `precision`."""
    from swarm.runtime.precision import autocast

    module = pipe.hosts[stage].worker.module
    best = math.inf
    for i in range(6):
        x_in = x.detach().requires_grad_(stage > 0)
        start = time.perf_counter()
        with autocast(precision):
            out = module(x_in, targets) if module.is_last else module(x_in)
        (out.float().sum() if module.is_last else out.float().pow(2).mean()).backward()
        if i:
            best = min(best, time.perf_counter() - start)
    module.zero_grad(set_to_none=True)
    return best


def _plan(pipe: LocalPipeline, cfg: HeteroConfig, batch) -> tuple[list[str], dict]:
    """Measures each stage's time per precision and sensitivity on `batch`, chooses and applies precisions."""
    mb = max(1, cfg.batch_size // cfg.n_micro)
    # each stage's inputs, computed once through the stages before it: the timed micro-batch, then the
    # sensitivity batches
    feed = [batch.tokens[:mb]] + [batch.tokens[i * mb : (i + 1) * mb] for i in range(cfg.sensitivity_batches)]
    stage_in = []
    with torch.no_grad():
        for host in pipe.hosts:
            stage_in.append(feed)
            if not host.worker.module.is_last:
                feed = [host.worker.module(c) for c in feed]
    times, sens = [], []
    for s, host in enumerate(pipe.hosts):
        timed, *chunks = stage_in[s]
        times.append({p: _stage_time(pipe, s, timed, batch.targets[:mb], p) for p in ("fp32", "bf16")})
        sens.append(measure_sensitivity(host.worker.module, chunks, ("bf16",), seed=cfg.seed))
    choice = choose_precisions(times, sens, cfg.budget)
    for host, p in zip(pipe.hosts, choice.precisions, strict=True):
        set_stage_precision(host.worker, p)
    return list(choice.precisions), {"stage_times_s": times, "sensitivity": sens, "why": choice.why}


class _Run:
    """One setting's pipeline, stepped by `run_experiment` in turn with the others' (see `run_experiment`)."""

    def __init__(self, setting: str, cfg: HeteroConfig, total: int):
        self.setting, self.cfg = setting, cfg
        self.plan_step = max(1, round(total * cfg.plan_fraction))
        optim = replace(cfg.optim, total_steps=total, warmup_steps=max(1, round(total * 0.2)))
        self.pipe = LocalPipeline(cfg.model, cfg.n_stages, stage_cfg=StageConfig(optim))
        self.throttle = None
        if setting != "equal":
            self.throttle = ModuleThrottle(self.pipe.hosts[cfg.slow_stage].worker.module, cfg.slow_factor)
        self.precisions, self.detail = ["fp32"] * cfg.n_stages, {}
        self.step, self.window_s, self.losses = 0, 0.0, []

    def train_step(self, batch) -> None:
        if self.step == self.plan_step and self.setting == "slow-planned":
            start = time.perf_counter()
            self.precisions, self.detail = _plan(self.pipe, self.cfg, batch)
            self.detail["plan_s"] = time.perf_counter() - start  # measuring and choosing: outside the window
        start = time.perf_counter()
        self.losses.append(self.pipe.train_step(batch, self.cfg.n_micro).loss)
        if self.step >= self.plan_step:
            self.window_s += time.perf_counter() - start
        self.step += 1

    def row(self, evals) -> dict:
        eval_loss = self.pipe.evaluate(evals, self.cfg.batch_size * 2)
        self.pipe.close()
        window = self.step - self.plan_step
        return {
            "setting": self.setting,
            "throughput_samples_s": window * self.cfg.batch_size / self.window_s,
            "final_eval_loss": eval_loss,
            "final_train_loss": sum(self.losses[-5:]) / len(self.losses[-5:]),
            "precisions": self.precisions,
            "steps": self.step,
            "window_steps": window,
            "slept_s": round(self.throttle.slept_s, 3) if self.throttle else 0.0,
            **self.detail,
        }


def run_experiment(cfg: HeteroConfig, show_progress: bool = True) -> list[dict]:
    """The three settings, stepped in turn on the same batches (each setting's step i runs beside the others'
    step i), so a neighbour's load on a shared machine falls on all three alike; each setting's throughput is
    its samples over the summed wall time of its own steps after `plan_step`."""
    from tqdm import tqdm

    if not 0 < cfg.slow_stage < cfg.n_stages:
        raise ValueError(f"slow_stage must be in [1, {cfg.n_stages}), got {cfg.slow_stage}")
    train, evals, report = build_datasets(cfg.data)
    print(report.describe(), file=sys.stderr, flush=True)
    total = len(train) // cfg.batch_size * cfg.epochs
    runs = [_Run(setting, cfg, total) for setting in SETTINGS]
    with tqdm(total=total, desc="hetero", disable=not show_progress) as bar:
        for epoch in range(cfg.epochs):
            for batch in epoch_batches(train, cfg.batch_size, epoch, cfg.seed):
                for run in runs:
                    run.train_step(batch)
                bar.update(1)
    rows = [run.row(evals) for run in runs]
    equal, slow = rows[0]["throughput_samples_s"], rows[1]["throughput_samples_s"]
    for row in rows:
        cost = equal - slow
        row["recovered"] = (row["throughput_samples_s"] - slow) / cost if cost > 0 else None
        row["loss_vs_slow_fp32"] = row["final_eval_loss"] / rows[1]["final_eval_loss"] - 1
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'setting':<14} {'samples/s':>10} {'recovered':>10} {'eval loss':>10} {'vs fp32':>8}  precisions",
    ]
    for r in rows:
        rec = "-" if r["recovered"] is None else f"{r['recovered']:.1%}"
        vs = "-" if r["loss_vs_slow_fp32"] is None else f"{r['loss_vs_slow_fp32']:+.2%}"
        loss = "-" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}"
        layers = f"  layers {r['layers']}" if "layers" in r else ""
        lines.append(
            f"{r['setting']:<14} {r['throughput_samples_s']:>10.2f} {rec:>10} {loss:>10} {vs:>8}  "
            f"{','.join(r['precisions'])}{layers}"
        )
    return "\n".join(lines)


def check_targets(rows: list[dict]) -> list[tuple[str, bool]]:
    equal, slow, planned = rows[0], rows[1], rows[2]
    rec = planned["recovered"] if planned["recovered"] is not None else 0.0
    cost = slow.get("slow_cost", 1 - slow["throughput_samples_s"] / equal["throughput_samples_s"])
    loss = planned["loss_vs_slow_fp32"]
    return [
        (f"the slow peer costs >= {SLOW_COST_TARGET:.0%} of the throughput ({cost:.1%})", cost >= SLOW_COST_TARGET),
        (
            f"per-peer precision recovers >= {RECOVER_TARGET:.0%} of the slow peer's cost ({rec:.1%})",
            rec >= RECOVER_TARGET,
        ),
        (
            f"held-out loss within {LOSS_TOLERANCE:.1%} of uniform fp32 ({'-' if loss is None else f'{loss:+.2%}'})",
            loss is not None and abs(loss) <= LOSS_TOLERANCE,
        ),
    ]


_FLAGS = Flags(HeteroConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)
    add = parser.add_argument
    add("--quick", action="store_true", help="fewer steps and samples: a smoke test")
    add("--no-progress", action="store_true", help="hide the progress bar")
    add("--json", action="store_true", help="print the result rows as JSON instead of a table")
    add("--out", type=Path, default=None, help="also write the rows as JSON to this file")


def config_from_args(args: argparse.Namespace) -> HeteroConfig:
    cfg = _FLAGS.from_args(args)  # --seed seeds the model's init and the run alike (one flag, both fields)
    if args.quick:
        cfg = replace(cfg, data=replace(cfg.data, train_samples=128, eval_samples=32), epochs=2)
    return cfg


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # one intra-op thread: a pass computes on its stage's thread (see ModuleThrottle)
    cfg = config_from_args(args)
    if cfg.in_process:
        rows = run_experiment(cfg, show_progress=not args.no_progress)
    else:
        import tempfile

        from swarm.experiments.hetero_swarm import run_swarm_experiment

        out = args.out.parent / "hetero-swarm" if args.out else Path(tempfile.mkdtemp(prefix="swarm-hetero-"))
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.no_progress else (lambda _: None)
        rows = run_swarm_experiment(cfg, out, say)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(format_table(rows))
    for statement, met in check_targets(rows):
        print(f"[{'met' if met else 'MISSED'}] {statement}")
    return 0
