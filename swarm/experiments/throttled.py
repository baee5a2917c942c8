"""`swarm experiment throttled`: link speed x codec setting, each cell a real local swarm on shaped links.

Every cell starts a bootstrap node and swarm-peer processes whose links are shaped (the application's token
bucket by default, kernel `tc` in network namespaces with `--netns`), trains a fixed number of steps from
the same seed on a data set small enough that every sample comes back several times, and records every
step. `mean_step_s` is taken over the steps after the first epoch (AQ-SGD's steady state: every sample
has been seen once); the first epoch's mean is reported beside it.

This CPU computes about a thousand times slower than a GPU, so at equal link speed it is far less bound by
the network than the AQ-SGD paper's GPUs were. The report gives, per link speed, fp32's time on the wire
over its compute time per step (`rho`): that ratio is what makes results comparable across machines. At a
link, no codec can speed a step up by more than min(its byte ratio, 1 + rho); `speedup_share` is the share
of that bound a setting reached. The default matrix includes 1 Mbit/s, where fp32 is >= 20x network-bound
(the AQ-SGD paper's regime); cells below `SLOW_RATE_MBIT` run `slow_steps` steps only (a prefix of the same
run: the peers' learning-rate schedule still spans `steps`; compressed cells there run `slow_codec_steps`, their
schedule as long), enough for a steady-state mean after the first
epoch at several seconds per step.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
from swarm.experiments.selective import EPILOGUE_SUFFIX, SELECTIVE_SUFFIX
from swarm.flags import Flags, flag
from swarm.metrics import logged_state_bytes
from swarm.peers.plan import PlanDocument
from swarm.report import print_table

if TYPE_CHECKING:
    from swarm.train.trainer import TrainConfig

RATES = [0.5, 1.0, 10.0, 100.0, 1000.0, None]
"""The default matrix's links, Mbit/s (None: unshaped). 0.5 puts a cell past rho 20, where issue 29 judges the
default's speed-up (on a quiet 2-core machine 1 Mbit/s gives rho 19.7-19.9, 0.5 Mbit/s 49.8)."""
DEFAULT_CODECS = f"{DEFAULT_FORWARD_CODEC}/{DEFAULT_BACKWARD_CODEC}"
"""The swarm's default codecs (`swarm-peer --fw-codec/--bw-codec`), the convergence experiment's default setting
spelled with the experiment's rounding and group size."""
SETTINGS = ["fp32/fp32", "directq2/gradq4", "aqsgd2/gradq4", DEFAULT_CODECS]
QUICK_RATES = [10.0, None]
QUICK_SETTINGS = ["fp32/fp32", DEFAULT_CODECS]
TARGET_SETTING = DEFAULT_CODECS
"""The issue's "default setting" in this matrix: at rho >= 20 its speed-up over fp32 is >= 80% of its byte
ratio."""
WARMUP_SHARE = 0.2
"""Learning-rate warm-up as a share of the schedule's steps, as convergence and demo use (10% spiked the loss)."""
SLOW_RATE_MBIT = 5.0
"""Cells on links slower than this run `ThrottledConfig.slow_steps` steps."""
PREDICTION_TOLERANCE = 0.10
"""Target: the plan's predicted step time within 10% of the measured one, in every cell."""
SHARE_TARGET, SHARE_RHO = 0.8, 20.0
"""Target: at rho >= 20, the default setting's speed-up >= 80% of min(byte ratio, 1 + rho)."""
BASELINES = ("torch",)
COLUMNS = [
    "rate_mbit",
    "setting",
    "fw_bits",
    "bw_bits",
    "mean_step_s",
    "first_epoch_step_s",
    "throughput_samples_per_s",
    "wire_bytes",
    "final_loss",
    "speedup_vs_fp32",
    "slowdown_vs_fp32_unshaped",
    "rho",
    "predicted_step_s",
    "total_wire_bytes",
    "total_ratio_vs_fp32",
    "speedup_share",
]


@dataclass(frozen=True)
class Cell:
    rate_mbit: float | None
    setting: str

    @property
    def label(self) -> str:
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g}mbit"
        return f"{rate}-{self.setting.replace('/', '-')}"


def _rates(text: str) -> tuple[float | None, ...]:
    return tuple(None if r.strip().lower() in ("none", "unshaped") else float(r) for r in text.split(","))


def _rates_text(rates: tuple[float | None, ...]) -> str:
    return ",".join("none" if r is None else repr(r).removesuffix(".0") for r in rates)


def _settings(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


PER_LINK_SUFFIX = "@link"
"""`FW/BW@link`: the peers plan with `--codec-policy per-link`: each boundary's codecs (down to the default floors)
and the epilogue's chosen by the planner with the placement, from the probed links and this machine's codec times;
FW/BW are only the codecs configured before a plan names them."""


def split_setting(setting: str) -> tuple[str, str]:
    """(`FW/BW`, the setting's suffix: `EPILOGUE_SUFFIX`, `SELECTIVE_SUFFIX`, `PER_LINK_SUFFIX` or '')."""
    for suffix in (EPILOGUE_SUFFIX, SELECTIVE_SUFFIX, PER_LINK_SUFFIX):
        if setting.endswith(suffix):
            return setting.removesuffix(suffix), suffix
    return setting, ""


@dataclass(frozen=True)
class ThrottledConfig:
    """The matrix of `swarm experiment throttled`: every link speed with every codec setting."""

    rates: tuple[float | None, ...] = field(default=tuple(RATES), metadata=flag(parse=_rates, render=_rates_text))
    """comma-separated link speeds of the cells, Mbit/s; 'none' for an unshaped link"""
    settings: tuple[str, ...] = field(default=tuple(SETTINGS), metadata=flag(parse=_settings, render=",".join))
    """comma-separated FW/BW codec pairs of the cells; the fp32/* ones are the baseline of the comparisons (one is
    always run). FW/BW@epi: the peers' planner chooses epilogue-only compression (--plan-epilogue-only); FW/BW@sel:
    it chooses the replicas' sums' codecs (--codec-policy selective; with --stages below --peers); FW/BW@link: it
    chooses every link's codecs with the placement (--codec-policy per-link)"""
    steps: int = 40
    """optimizer steps per cell"""
    slow_steps: int = 12
    """optimizer steps of the fp32 cells on links slower than 100 Mbit/s (`SLOW_RATE_MBIT`; at most --steps), on
    the same learning-rate schedule: fp32 takes seconds per step there. 12 = 3 epochs of the default data: 8
    steps of steady state after the first"""
    slow_codec_steps: int = 64
    """optimizer steps of the compressed cells on those links (at least --steps; past --steps the learning rate stays
    at its minimum), long enough that a filled token bucket does not set their mean. A link-bound step there takes
    its bytes over the rate, but twice in a run the links idle long enough to fill the shaper's bucket (one
    direction through the first epoch's full forward messages, both while the trainer follows the calibrated plan):
    with the 64 KiB bucket of s22-s53, about 1 s of link time passed at once each time (over s22's 8 steady steps
    that read 0.195 s a step for a link-bound 0.28 s); the bucket is ten frames at these rates since s54
    (`peers.shaper.default_burst_bytes`), 0.12 s at 1 Mbit/s."""
    train_samples: int = 32
    """training samples, a multiple of --batch-size"""
    batch_size: int = 8
    """samples per step"""
    micro_batches: int = 4
    """micro-batches per step"""
    peers: int = 2
    """swarm-peer processes, one stage each unless --stages"""
    stages: int | None = None
    """pipeline stages (none: one per peer); fewer than --peers plans --peers/--stages replicas of every stage, whose
    gradient sums cross the shaped links too (what the FW/BW@sel settings choose codecs for)"""
    delay_ms: float = 0.0
    """one-way delay of every link, ms"""
    netns: bool = False
    """shape with tc in network namespaces (needs root) instead of the application's shaper"""
    trace: bool = False
    """write a timeline of every process of each cell (`swarm.trace`) to CELL/trace/: merged into trace.json (Perfetto
    opens it), the spans' time a step in spans.txt and the pipeline's figures after the first epoch (compute, hops
    between stages, gate hand-offs) in pipeline.json"""
    netns_prefix: str = "swt-"
    """name prefix of the --netns cells' namespaces and links ([a-z][a-z0-9]{0,4}-); the torch baseline's are the
    same with a 'q' before the dash. Give each concurrent run its own"""
    out: Path | None = None
    """output folder (none: runs/throttled-<time>)"""
    baseline: str | None = field(default=None, metadata=flag(choices=BASELINES))
    """torch: also PyTorch's own pipeline (torch.distributed.pipelining, 1F1B, gloo, fp32) at every rate, same
    model split and tc shaping (needs --netns)"""
    model: object = field(default=None, metadata=flag(skip=True))
    """The model (`swarm.options.model_config`; None: the entry points' default, the built-in GPT)."""
    model_flags: tuple[str, ...] = field(default=(), metadata=flag(skip=True))
    """The same model as swarm-peer flags (`swarm.options.model_arguments`)."""

    def __post_init__(self) -> None:
        if self.baseline is not None and self.baseline not in BASELINES:
            raise ValueError(f"--baseline: expected one of {', '.join(BASELINES)}, got {self.baseline!r}")
        if self.baseline and not self.netns:
            raise ValueError(
                f"--baseline {self.baseline} needs --netns: the baseline's gloo links are shaped by tc in the "
                "testbed's namespaces, not by the swarm's own shaper, so the comparison is fair only there"
            )
        for name in (
            "steps",
            "slow_steps",
            "slow_codec_steps",
            "train_samples",
            "batch_size",
            "micro_batches",
            "peers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ThrottledConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.train_samples % self.batch_size:
            raise ValueError("--train-samples must be a multiple of --batch-size")
        if self.stages is not None and not (1 <= self.stages <= self.peers and self.peers % self.stages == 0):
            raise ValueError(f"--stages {self.stages}: expected a divisor of --peers {self.peers} (replicas per stage)")
        if self.netns and self.stages not in (None, self.peers):
            raise ValueError("--stages below --peers runs on the application's shaper only, not with --netns")
        for setting in self.settings:
            pair, _ = split_setting(setting)
            if pair.count("/") != 1 or "@" in pair:
                raise ValueError(
                    f"setting {setting!r}: expected FW/BW, optionally with {EPILOGUE_SUFFIX}, {SELECTIVE_SUFFIX} or "
                    f"{PER_LINK_SUFFIX}"
                )
        if not re.fullmatch(r"[a-z][a-z0-9]{0,4}-", self.netns_prefix):
            raise ValueError(f"--netns-prefix: expected [a-z][a-z0-9]{{0,4}}- (e.g. 'swt-'), got {self.netns_prefix!r}")

    @property
    def baseline_prefix(self) -> str:
        """The torch baseline's namespace prefix: `netns_prefix` with a 'q' before its dash (`swt-`: `swtq-`)."""
        return self.netns_prefix[:-1] + "q-"

    @property
    def cells(self) -> list[Cell]:
        return [Cell(rate, setting) for rate in self.rates for setting in self.settings]

    def steps_of(self, cell: Cell) -> int:
        """Steps the cell trains: on links slower than `SLOW_RATE_MBIT`, `slow_steps` for fp32 and
        `slow_codec_steps` for the others; else `steps`."""
        if cell.rate_mbit is None or cell.rate_mbit >= SLOW_RATE_MBIT:
            return self.steps
        if cell.setting.startswith("fp32/"):
            return min(self.steps, self.slow_steps)
        return max(self.steps, self.slow_codec_steps)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swarm.options import add_model_arguments

    _FLAGS.add_to(parser)
    parser.add_argument("--quick", action="store_true", help="a small matrix (10 Mbit/s and unshaped, 2 settings)")
    parser.add_argument("--json", action="store_true", help="print the table rows as JSON")
    add_model_arguments(parser)


def config_from_args(args: argparse.Namespace) -> ThrottledConfig:
    """The ThrottledConfig of the flags; --quick shrinks the matrix, and an fp32 baseline is always run."""
    cfg = replace(_FLAGS.from_args(args), **_model_of(args))
    rates, settings, steps, train_samples = cfg.rates, list(cfg.settings), cfg.steps, cfg.train_samples
    if args.quick:
        rates, settings = tuple(QUICK_RATES), list(QUICK_SETTINGS)
        steps, train_samples = min(steps, 8), min(train_samples, 16)
    if not any(s.startswith("fp32/") for s in settings):
        settings.insert(0, "fp32/fp32")
    return replace(cfg, rates=rates, settings=tuple(settings), steps=steps, train_samples=train_samples)


_FLAGS = Flags(ThrottledConfig)


def _model_of(args: argparse.Namespace) -> dict:
    """`model` and `model_flags` of the flags; empty for the default model, so every cell runs as it did."""
    from swarm.options import DEFAULT_MODEL, model_arguments, model_config

    model = model_config(args)
    return {} if model == DEFAULT_MODEL else {"model": model, "model_flags": tuple(model_arguments(args))}


def train_config(cell: Cell, cfg: ThrottledConfig, out: Path) -> TrainConfig:
    """The trainer of one cell: the entry points' default model, every cell from the same seed."""
    from swarm.train.trainer import TrainConfig

    return TrainConfig(
        **({} if cfg.model is None else {"model": cfg.model}),
        train_samples=cfg.train_samples, batch_size=cfg.batch_size, micro_batches=cfg.micro_batches,
        schedule="1f1b", steps=cfg.steps_of(cell), seed=0, setting=cell.setting, deadline_s=300.0,
        out=str(out / cell.label),
    )  # fmt: skip


def warmup_steps(total_steps: int) -> int:
    """Warm-up steps of a schedule of `total_steps`: `WARMUP_SHARE` of them, at least 1."""
    return max(1, round(total_steps * WARMUP_SHARE))


def _bits(codec: str) -> int:
    from swarm.compression import CodecConfig

    return CodecConfig.parse(codec).wire_bits  # any label: suffixes (+ef, +ch, +rot) and new codec names


def read_summary(cell_dir: Path) -> dict:
    """The trainer's summary.json of a cell (`<cell>/summary.json` of a local swarm, `<cell>/train/` of the
    testbed's trainer), its prediction replaced by the newest plan's when the planner calibrated that plan
    during the run (`plan.json`: the trainer may end before it follows it); {} when there is none."""
    for path in (cell_dir / "summary.json", cell_dir / "train" / "summary.json"):
        if path.is_file():
            summary = json.loads(path.read_text())
            saved = cell_dir / "plan.json"
            plan = PlanDocument.from_wire(json.loads(saved.read_text())) if saved.is_file() else None
            if plan is not None and plan.measured is not None and isinstance(plan.step_time_s, float):
                summary["first_plan_step_s"] = plan.first_step_time_s
                summary["predicted_step_s"] = plan.step_time_s
                summary["calibration_window"] = calibration_window(plan.measured_figures())
            if plan is not None and plan.bw_epilogue:  # the live planner's epilogue-only choice (@epi)
                summary["bw_epilogue"] = plan.bw_epilogue
            if plan is not None and plan.epilogue is not None:  # what the planner chose for the sums (@sel)
                summary["epilogue_codecs"] = {
                    "average": list(plan.epilogue.average_labels),
                    "tied": plan.epilogue.tied_label,
                }
            if plan is not None and plan.codecs:  # each boundary's codecs as the planner chose them (@link)
                summary["link_codecs"] = [f"{c.forward_label}/{c.backward_label}" for c in plan.codecs]
            # the stage state its peers moved (held copies): no step's bytes, named beside them (docs/BYTES.md)
            summary["state_bytes"] = logged_state_bytes(cell_dir / "logs")
            epilogue = cell_dir / "epilogue.json"
            if epilogue.is_file():
                summary["epilogue"] = json.loads(epilogue.read_text())
            return summary
    return {}


def calibration_window(measured: object) -> dict | None:
    """The calibrated plan's window: its first and last step (the trainer's numbering, from 1) and the longest
    stage clock over it (the step the calibration took); None when the plan's figures do not read that way."""
    if not isinstance(measured, dict) or not measured:
        return None
    try:
        figures = [(int(m["first_step"]), int(m["steps"]), float(m["step_s"])) for m in measured.values()]
    except (KeyError, TypeError, ValueError):
        return None  # a plan from before `Measured.first_step`
    first, steps = min(f[0] for f in figures), min(f[1] for f in figures)
    return {"first": first + 1, "last": first + steps, "clock_s": max(f[2] for f in figures)}


def planned_peer(*, batch_size: int, micro_batches: int, steps: int, rate_mbit: float, delay_ms: float, **fields):
    """What every peer of a planned experiment is told: a planned route with even layers, the same split in every
    cell or setting (the planner's own split follows noisy compute measurements, and a different stage boundary
    would change the training math between the runs being compared), so the plan carries the cost model's
    prediction for the batch and links; links shaped to `rate_mbit`/`delay_ms` (0 or None: unshaped, as
    swarm-peer's own --rate-mbit reads it), the optimizer's warm-up for `steps`; `fields`: further `PeerConfig`
    fields (codecs, ports)."""
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig
    from swarm.peers.shaper import LinkShape
    from swarm.runtime.worker import OptimConfig

    planning = PlanningConfig(  # the cell's codecs on every link (fixed): the settings are what is compared
        even_layers=True,
        micro_batch_size=max(1, batch_size // micro_batches),
        micro_batches=micro_batches,
        codec_policy="fixed",
    )
    return PeerConfig(
        assign="plan",
        planning=planning,
        link_shape=LinkShape.from_mbit(rate_mbit or None, delay_ms),
        optim=OptimConfig(total_steps=steps, warmup_steps=warmup_steps(steps)),
        **fields,
    )


def peer_config(cell: Cell, cfg: ThrottledConfig):
    """What every peer of a cell is told: `planned_peer` with the cell's codecs and link rate."""
    from swarm.options import CodecFlags

    pair, suffix = split_setting(cell.setting)
    forward, backward = pair.split("/")
    peer = planned_peer(
        batch_size=cfg.batch_size, micro_batches=cfg.micro_batches, rate_mbit=cell.rate_mbit,
        # a slow link's fp32 cell runs a prefix of the schedule; a cell that runs longer gets a schedule as long
        steps=max(cfg.steps, cfg.steps_of(cell)),
        delay_ms=cfg.delay_ms, **CodecFlags(forward, backward).build(),
    )  # fmt: skip
    stages = cfg.stages or cfg.peers
    replicas = cfg.peers // stages if stages < cfg.peers else peer.planning.replicas
    # FW/BW@sel: the planner chooses the sums' codecs from the measured links (selective stage compression)
    # FW/BW@link: every link's codecs chosen with the placement (`swarm.scheduler.bits.link_ladder`)
    policies = {SELECTIVE_SUFFIX: "selective", PER_LINK_SUFFIX: "per-link"}
    policy = policies.get(suffix, peer.planning.codec_policy)
    # FW/BW@epi: epilogue-only compression, the live planner choosing the exposed backward messages from the peers'
    # announced speeds and the probed links (`--plan-epilogue-only`)
    planning = replace(peer.planning, replicas=replicas, codec_policy=policy, epilogue_only=suffix == EPILOGUE_SUFFIX)
    return replace(peer, num_stages=stages, planning=planning)


@cache
def epilogue_choice(cell: Cell, cfg: ThrottledConfig):
    """A `FW/BW@epi` cell's epilogue-only choice (`swarm.experiments.selective.plan_epilogue_only`: this machine's
    stage timings, measured once per cell, and the cell's link rate)."""
    from swarm.experiments.selective import plan_epilogue_only
    from swarm.options import DEFAULT_MODEL

    micro_batch_size = max(1, cfg.batch_size // cfg.micro_batches)
    model = cfg.model or DEFAULT_MODEL
    return plan_epilogue_only(
        model, cell.setting, cfg.stages or cfg.peers, micro_batch_size, cfg.micro_batches, cell.rate_mbit, cfg.delay_ms
    )


def _run_cell(cell: Cell, cfg: ThrottledConfig, out: Path) -> list[dict]:
    if not cfg.trace:
        return _run_cell_processes(cell, cfg, out)
    from swarm import trace

    directory, before = out / cell.label / "trace", os.environ.get(trace.ENV)
    os.environ[trace.ENV] = str(directory)  # the cell's processes inherit it; this one's trainer starts on it
    try:
        rows = _run_cell_processes(cell, cfg, out)
    finally:
        trace.flush()  # this process's trainer (the next cell's starts anew)
        if before is None:
            os.environ.pop(trace.ENV, None)
        else:
            os.environ[trace.ENV] = before
    _, events = trace.merge(directory)
    table = "\n".join(f"{p}\t{n}\t{c}\t{ms / max(1, len(rows)):.3f}" for p, n, c, ms in trace.summary(events))
    (directory / "spans.txt").write_text("process\tspan\tcount\tms a step\n" + table + "\n")
    figures = trace.pipeline_figures(events, from_step=cfg.train_samples // cfg.batch_size)
    (directory / "pipeline.json").write_text(json.dumps(figures, indent=1))
    return rows


def _run_cell_processes(cell: Cell, cfg: ThrottledConfig, out: Path) -> list[dict]:
    from swarm.daemon.peer_config import peer_flags
    from swarm.testbed.local import local_swarm
    from swarm.train.trainer import train

    peer = peer_config(cell, cfg)
    train_cfg = train_config(cell, cfg, out)
    if peer.planning.epilogue_only:  # the choice from this machine's stage timings, predicted (`read_summary`)
        (out / cell.label).mkdir(parents=True, exist_ok=True)
        (out / cell.label / "epilogue.json").write_text(json.dumps(epilogue_choice(cell, cfg)[1].row()))
    # the planner re-predicts the plan from the peers' clocks over the steps after the first epoch (AQ-SGD's
    # full first sights over) and republishes it; the trainer follows it through the DHT, and its summary's
    # prediction is that one: made during the run, from the run's own early steps. The namespace cells too: their
    # uncalibrated first plans (block speed timed alone, no step overhead) were 43-57% below measured
    calibrated = replace(peer.planning, calibrate_after_steps=cfg.train_samples // cfg.batch_size)
    if cfg.netns:
        from swarm.testbed.testbed_cli import run_in_testbed

        keep_plan = lambda testbed: _save_testbed_plan(testbed, out / cell.label)  # noqa: E731
        return run_in_testbed(
            cell.rate_mbit, replace(peer, planning=calibrated), train_cfg, cfg.peers, prefix=cfg.netns_prefix,
            before_down=keep_plan,
        )  # fmt: skip
    flags = peer_flags().to_argv(replace(peer, planning=calibrated)) + list(cfg.model_flags)
    with local_swarm(out / cell.label, cfg.peers, flags, n_stages=peer.num_stages) as swarm:
        train(train_cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        record = swarm.dht.get_plan(train_cfg.model.n_layers)
        if record is not None:  # the newest plan: calibrated if the window completed during the run
            (out / cell.label / "plan.json").write_text(json.dumps(record.document.to_wire()))
    with open(out / cell.label / "steps.csv") as f:
        return list(csv.DictReader(f))


def _save_testbed_plan(testbed, cell_dir: Path) -> None:
    """Writes the newest plan of a namespace cell's DHT to `cell_dir/plan.json` (`read_summary` takes its prediction:
    the calibrated one when the planner republished the plan late in the run, after the trainer's last look), asked
    with `swarm status` from the trainer's namespace; nothing when the DHT does not answer (the trainer's own plan's
    prediction stands)."""
    import subprocess

    from swarm.daemon.status import status_argv
    from swarm.testbed.services import ADDRESS_FILE, process_argv

    trainer = testbed.layout.node("trainer")
    status = status_argv(str(testbed.run_dir / ADDRESS_FILE), trainer.service.address, timeout_s=30.0)
    argv = ["ip", "netns", "exec", trainer.namespace, *process_argv(("swarm", "status", *status))]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL).stdout
    except subprocess.TimeoutExpired as e:  # on a loaded machine it printed its answer, then hung leaving the DHT
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
    except OSError:
        out = ""
    try:
        plan = json.loads(out).get("plan")
    except (ValueError, AttributeError):
        plan = None
    if isinstance(plan, dict) and isinstance(plan.get("plan"), dict):
        (cell_dir / "plan.json").write_text(json.dumps(plan["plan"]))


def _int(step: dict, key: str) -> int:
    return int(step.get(key) or 0)  # a missing or empty column (a torch row, an older run's steps.csv) reads as 0


def _busiest_direction(step: dict) -> float:
    """Bytes of a step's busier direction: the larger boundary direction plus half of what is not boundary
    traffic (the tied-embedding exchange, averaging, control: symmetric between two members, so half each
    way); the boundaries alone while the runtime reports no totals."""
    forward_bytes, backward_bytes = _int(step, "forward_bytes"), _int(step, "backward_bytes")
    not_boundary = max(0, _int(step, "total_wire_bytes") - forward_bytes - backward_bytes)
    return max(forward_bytes, backward_bytes) + not_boundary / 2


PHASE_COLUMN = "swarm_trainer_phase_seconds_total{phase="


def phase_ms(steps: list[dict]) -> dict[str, float]:
    """The trainer's phases (labels, pipeline, reduce, grads, commit, step), median milliseconds a step over
    `steps`: steps.csv gives each step's own seconds per phase (an empty cell: none that step). Empty without
    those columns (a torch row, an older run's steps.csv)."""
    phases = [k[len(PHASE_COLUMN) : -1] for k in (steps[0] if steps else {}) if k.startswith(PHASE_COLUMN)]
    return {p: 1000 * statistics.median(float(s.get(f"{PHASE_COLUMN}{p}}}") or 0.0) for s in steps) for p in phases}


def summarize(
    cell: Cell, steps: list[dict], steps_per_epoch: int, batch_size: int, summary: dict | None = None
) -> dict:
    """One row of the table from a cell's steps.csv rows and its trainer summary (`read_summary`)."""
    from swarm.train.steplog import machine_cpu

    times = [float(s["step_s"]) for s in steps]
    steady = times[steps_per_epoch:] or times
    first = times[:steps_per_epoch]
    forward, backward = split_setting(cell.setting)[0].split("/")
    wire = sum(_int(s, "forward_bytes") + _int(s, "backward_bytes") for s in steps)
    losses = [float(s["train_loss"]) for s in steps]
    total, fp32_total = (
        sum(_int(s, "total_wire_bytes") for s in steps),
        sum(_int(s, "fp32_total_wire_bytes") for s in steps),
    )
    after = steps[steps_per_epoch:] or steps  # the steps mean_step_s is taken over
    steady_total = sum(_int(s, "total_wire_bytes") for s in after)
    steady_fp32_total = sum(_int(s, "fp32_total_wire_bytes") for s in after)
    predicted = (summary or {}).get("predicted_step_s")
    mean = statistics.mean(steady)
    # the calibration's window: the trainer's own mean over those steps beside the stage clock the planner read
    cal = (summary or {}).get("calibration_window") or {}
    in_window = [float(s["step_s"]) for s in steps if cal and cal["first"] <= int(s["step"]) <= cal["last"]]
    stages = [(int(s["step"]), int(s["stages"])) for s in steps if str(s.get("stages") or "").isdigit()]
    return {
        "rate_mbit": cell.rate_mbit,
        "setting": cell.setting,
        "fw_bits": _bits(forward),
        "bw_bits": _bits(backward),
        "mean_step_s": mean,
        "first_epoch_step_s": statistics.mean(first),
        "throughput_samples_per_s": batch_size / mean,
        "wire_bytes": wire,
        "fp32_wire_bytes": sum(_int(s, "fp32_wire_bytes") for s in steps),
        "wire_bytes_per_step": wire / len(steps),
        # the tied embedding's gradient sum between the end stages (also in the totals)
        "sync_bytes": sum(_int(s, "sync_bytes") for s in steps),
        # the replicas' gradient sums (also in the totals), per step after the first epoch
        "reduce_bytes_per_step": sum(_int(s, "reduce_bytes") for s in after) / len(after),
        "control_bytes": sum(_int(s, "control_bytes") for s in steps),
        "total_wire_bytes": total,
        "fp32_total_wire_bytes": fp32_total,
        "steady_total_wire_bytes_per_step": steady_total / len(after),
        # the GetState bytes the cell's peers sent (held copies of each other's stage), beside the totals: not in them
        "state_bytes": (summary or {}).get("state_bytes"),
        "total_wire_bytes_per_step": total / len(steps),
        # each cell's own raw fp32 equivalent over what it sent; add_comparisons replaces these with what the
        # fp32 cell at the same rate actually sent (zstd included), the stricter baseline, when there is one
        "total_ratio_vs_fp32": fp32_total / total if total else None,
        "total_steady_ratio_vs_fp32": steady_fp32_total / steady_total if steady_total else None,
        # links are full duplex: the busier direction bounds a step's time on the wire
        "busiest_direction_bytes_per_step": statistics.mean(_busiest_direction(s) for s in steps),
        "predicted_step_s": predicted,
        "predicted_error_pct": 100 * (predicted - mean) / mean if predicted else None,
        # the first plan's prediction (the peers' block speed alone, no overhead), when a calibrated one followed
        "first_plan_step_s": (summary or {}).get("first_plan_step_s"),
        "window_steps": [cal["first"], cal["last"]] if cal else None,
        "window_clock_s": cal.get("clock_s"),
        "window_step_s": statistics.mean(in_window) if in_window else None,
        "final_loss": statistics.mean(losses[-steps_per_epoch:]),
        "steps": len(steps),
        # the pipeline's stages at the first step and the fewest any later step ran on: a planner that re-planned
        # onto fewer peers (a slow link starving the control traffic, say) leaves a cell measuring another pipeline
        "stages": stages[0][1] if stages else None,
        "fewest_stages": min(n for _, n in stages) if stages else None,
        "fewer_stages_from_step": next((i for i, n in stages if n < stages[0][1]), None) if stages else None,
        # where the steps after the first epoch spent their time, measured (the predicted split is the epilogue's)
        "phase_ms": phase_ms(after),
        # the machine's CPU over those steps (every process of the cell, and anything else running): a cell whose
        # cpu_floor_step_s nears its step is CPU-bound here, whatever its links
        **machine_cpu(after),
        **(summary or {}).get("epilogue", {}),  # a FW/BW@epi cell's choice from timed stages and predicted split
        "bw_epilogue": (summary or {}).get("bw_epilogue"),  # ... and the live planner's, which the peers ran
        "epilogue_codecs": (summary or {}).get("epilogue_codecs"),  # the plan's codecs of the sums (selective)
        "link_codecs": (summary or {}).get("link_codecs"),  # the plan's boundaries' codecs (per-link)
    }


def add_comparisons(rows: list[dict]) -> dict[float | None, float]:
    """Speed-ups against fp32 at the same rate and against fp32 unshaped, each cell's `rho` and
    `speedup_share`; returns fp32's wire/compute ratio (rho) per rate (wire time = fp32's busier direction's
    boundary bytes per step at that rate, since links are full duplex; compute = fp32's step time on the
    unshaped link).

    speedup_share = speedup_vs_fp32 / min(byte ratio, 1 + rho): the share of the most any codec can give at
    that link. The byte ratio is the fp32 cell's total bytes per step after the first epoch (at the same rate)
    over this cell's, the same steps the step times are taken over. Rows of a baseline (setting not `FW/BW`,
    e.g. torch-fp32) are compared with swarm's fp32 but are not a baseline themselves."""
    fp32 = {r["rate_mbit"]: r for r in rows if r["setting"].startswith("fp32/")}
    unshaped = fp32.get(None)
    ratios = {}
    if unshaped:
        for rate, r in fp32.items():
            if rate is not None:
                wire_s = r["busiest_direction_bytes_per_step"] * 8 / (rate * 1e6)
                ratios[rate] = wire_s / unshaped["mean_step_s"]
    for r in rows:
        base = fp32.get(r["rate_mbit"])
        r["speedup_vs_fp32"] = base["mean_step_s"] / r["mean_step_s"] if base else None
        if base and base.get("total_wire_bytes_per_step") and r.get("total_wire_bytes_per_step"):
            r["total_ratio_vs_fp32"] = base["total_wire_bytes_per_step"] / r["total_wire_bytes_per_step"]
            steady = r.get("steady_total_wire_bytes_per_step")
            r["total_steady_ratio_vs_fp32"] = base["steady_total_wire_bytes_per_step"] / steady if steady else None
        r["slowdown_vs_fp32_unshaped"] = r["mean_step_s"] / unshaped["mean_step_s"] if unshaped else None
        r["rho"] = ratios.get(r["rate_mbit"])
        byte_ratio = r.get("total_steady_ratio_vs_fp32")
        if r["speedup_vs_fp32"] is None or r["rho"] is None or not byte_ratio:
            r["speedup_share"] = None
        else:
            r["speedup_share"] = r["speedup_vs_fp32"] / min(byte_ratio, 1 + r["rho"])
    return ratios


def check_targets(rows: list[dict]) -> list[tuple[str, bool | None]]:
    """The issue's targets for this experiment as (statement, met) pairs; met is None where nothing could
    be judged (no prediction, no cell at rho >= 20, no totals)."""
    swarm_rows = [r for r in rows if "/" in r["setting"]]
    missed = [r for r in swarm_rows if r.get("predicted_error_pct") is None]
    off = [r for r in swarm_rows if r.get("predicted_error_pct") is not None]
    worst = max(off, key=lambda r: abs(r["predicted_error_pct"]), default=None)
    out: list[tuple[str, bool | None]] = []
    tolerance = 100 * PREDICTION_TOLERANCE
    if worst is None:
        out.append(
            (f"predicted step time within {tolerance:g}% of measured in every cell: no cell has a prediction", None)
        )
    else:
        met = abs(worst["predicted_error_pct"]) <= tolerance and not missed
        note = f"; {len(missed)} cells without a prediction" if missed else ""
        out.append(
            (
                f"predicted step time within {tolerance:g}% of measured in every cell (worst "
                f"{worst['predicted_error_pct']:+.1f}% at {_link(worst['rate_mbit'])} {worst['setting']}{note})",
                met,
            )
        )
    shrunk = [r for r in swarm_rows if r.get("fewer_stages_from_step") is not None]
    if shrunk:  # not a target of the issue: whether the cells measured what they say
        out.append(
            (
                "every cell kept its pipeline's stages: "
                + "; ".join(
                    f"{_link(r['rate_mbit'])} {r['setting']} ran on {r['fewest_stages']} of {r['stages']} stages from "
                    f"step {r['fewer_stages_from_step']} (re-planned: its step time is not that pipeline's)"
                    for r in shrunk
                ),
                False,
            )
        )
    slow = [r for r in swarm_rows if r["setting"] == TARGET_SETTING and (r.get("rho") or 0) >= SHARE_RHO]
    if not slow:
        top = max((r["rho"] for r in swarm_rows if r.get("rho") is not None), default=None)
        out.append((f"{TARGET_SETTING} at rho >= {SHARE_RHO:g}: no such cell (highest rho {_fmt(top, '.2f')})", None))
    for r in slow:
        share = r.get("speedup_share")
        statement = (
            f"{TARGET_SETTING} at {_link(r['rate_mbit'])} (rho {r['rho']:.1f}): speed-up over fp32 >= "
            f"{100 * SHARE_TARGET:g}% of min(byte ratio, 1 + rho) ("
            + ("no byte totals" if share is None else f"{r['speedup_vs_fp32']:.2f}x, {100 * share:.0f}%")
            + ")"
        )
        out.append((statement, None if share is None else share >= SHARE_TARGET))
    return out + torch_targets(rows)


def _torch_target(setting: str, rate: float | None) -> bool | None:
    """Which target against torch a swarm cell has: no slower (False: fp32, every rate), faster (True: the default,
    at 100 Mbit/s and below), or none (None)."""
    if setting == "fp32/fp32":
        return False
    return True if setting == TARGET_SETTING and rate is not None and rate <= 100 else None


def torch_targets(rows: list[dict]) -> list[tuple[str, bool | None]]:
    """The issue's targets against PyTorch's pipeline, per rate with a `torch-fp32` row (`--baseline torch`):
    swarm's fp32 no slower at every rate, the default setting faster at 100 Mbit/s and below; each statement names
    the swarm cell's CPU floor where it has one (`cpu_floor_step_s`): a floor above torch's step is a miss no
    schedule could mend on this machine."""
    torch_rows = {r["rate_mbit"]: r for r in rows if r["setting"] == "torch-fp32"}
    out: list[tuple[str, bool | None]] = []
    for faster in (False, True):  # swarm's fp32 rows first, then the default's
        for r in rows:
            rate, theirs = r["rate_mbit"], torch_rows.get(r["rate_mbit"])
            if theirs is None or _torch_target(r["setting"], rate) is not faster:
                continue
            step, base, floor = r["mean_step_s"], theirs["mean_step_s"], r.get("cpu_floor_step_s")
            statement = (
                f"{r['setting']} {'faster than' if faster else 'no slower than'} torch-fp32 at {_link(rate)}: "
                f"{step:.3f} against {base:.3f} s a step ({step / base:.2f}x)"
                + ("" if floor is None else f"; its CPU floor here {floor:.3f} s")
            )
            out.append((statement, step < base if faster else step <= base))
    return out


def slow_steps_note(cfg: ThrottledConfig) -> str:
    """What the report says of the cells whose step count is not `steps` ('' when there are none)."""
    slow = sorted({c.rate_mbit for c in cfg.cells if cfg.steps_of(c) != cfg.steps})
    if not slow:
        return ""
    rates = ", ".join(f"{r:g}" for r in slow)
    fp32, other = min(cfg.slow_steps, cfg.steps), max(cfg.steps, cfg.slow_codec_steps)
    return (
        f"Cells at {rates} Mbit/s: fp32 ran {fp32} of {cfg.steps} steps (a prefix of the same learning-rate "
        f"schedule; its final loss is at that step), the compressed settings {other} (past step {cfg.steps} at "
        "the schedule's minimum rate), so that the token bucket's two refills do not set their mean step."
    )


def _link(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit/s"


def _fmt(value, spec: str = ".3g", scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


BASELINE_ROW = dict.fromkeys(COLUMNS) | {"fw_bits": 32, "bw_bits": 32, "steps": 0}
"""A baseline's row before its own keys (run_torch_rows gives the throttled row keys only)."""


def _run_baseline(cfg: ThrottledConfig, out: Path, say) -> list[dict]:
    from swarm.experiments.torch_baseline import run_torch_rows  # lazy: torch.distributed, only when asked

    return [BASELINE_ROW | row for row in run_torch_rows(cfg, list(cfg.rates), out, say)]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = cfg.out or Path(f"runs/throttled-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    cells = cfg.cells
    steps_per_epoch = cfg.train_samples // cfg.batch_size
    all_steps, rows = {}, []
    with tqdm(cells, desc="cells", unit="cell", file=sys.stderr) as bar:  # stderr: --json stays clean
        for cell in bar:
            bar.set_postfix_str(cell.label)
            all_steps[cell] = _run_cell(cell, cfg, out)
            summary = read_summary(out / cell.label)
            rows.append(summarize(cell, all_steps[cell], steps_per_epoch, cfg.batch_size, summary))
    if cfg.baseline == "torch":
        rows += _run_baseline(cfg, out, lambda line: print(f"[torch] {line}", file=sys.stderr, flush=True))
    ratios = add_comparisons(rows)
    slow_note = slow_steps_note(cfg)
    from swarm.experiments.throttled_report import torch_comparison, write_outputs

    write_outputs(out, rows, all_steps, ratios, slow_note)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, COLUMNS, f"throttled experiment ({len(cells)} cells, {cfg.steps} steps each)")
        print(
            "fp32 wire/compute per step (rho): " + ", ".join(f"{r:g} Mbit/s {v:.2f}" for r, v in sorted(ratios.items()))
        )
        for statement, met in check_targets(rows):
            print(f"[{'not judged' if met is None else 'met' if met else 'MISSED'}] {statement}")
        for line in torch_comparison(rows):
            print(line)
        print(f"wrote {out}/report.md, steps.csv, results.json, loss_vs_time.png, step_time.png, wire_bytes.png")
    return 0
