"""`swarm train`: find the stages in the DHT, then drive training across them with a progress bar.

Writes the same per-step CSV as the convergence experiment (plus step time and fp32-equivalent bytes),
a loss plot, and a JSON summary. It drives every route of the plan (with equal replica counts, the plan's
columns: replicas of each stage); a dead replica costs a step attempt while a route lives (the driver
reroutes). When no route lives (`NoLiveRoute`, or a stage unreachable on a plan of one route) it waits for a
newer plan, the planner's repair, up to `--replan-timeout-s`, and runs the step there. Other stage failures
are reported by stage and peer, and the trainer exits non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.flags import Flags, flag
from swarm.metrics import Metrics, serve_metrics
from swarm.model.gpt import ModelConfig
from swarm.model.spec import AnyModelConfig, model_identity
from swarm.options import DHT_FLAGS, MODEL_GROUP, SCHEDULE_CHOICES, ModelFlags
from swarm.runtime.audit_wire import RECORD_CODECS
from swarm.runtime.heartbeat import HeartbeatConfig
from swarm.runtime.verify import VerifyConfig
from swarm.train.follower import PlanFollower, discover_route, route_answers
from swarm.train.freezing import FREEZE_FLAG, FreezeConfig, driver_factory, with_stages_prefix
from swarm.train.heldout import HeldOut, held_out_rows
from swarm.train.journal import Journal, Settled, settle
from swarm.train.run_length import ScheduleWatch
from swarm.train.steplog import StepLog, counter_columns, machine_cpu_s, step_columns, step_row
from swarm.train.summary_text import format_summary, step_time_spread  # noqa: F401  (format_summary re-exported)

if TYPE_CHECKING:
    from swarm.model.data import DataReport
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.routes import PlanRoutes

log = logging.getLogger("swarm.train.trainer")

CSV_FIELDS = [
    "setting",
    "step",
    "epoch",
    "train_loss",
    "lr",
    "grad_norm",
    "forward_bytes",
    "backward_bytes",
    "fp32_wire_bytes",
    "sync_bytes",
    "tied_bytes",
    "reduce_bytes",
    "control_bytes",
    "total_wire_bytes",
    "fp32_total_wire_bytes",
    "step_s",
    "skipped",
    "loss_scale",
    "plan_version",
    "attempts",
    "chains",
    "dead_peers",
    "sample_ids",
    "held_out_loss",
]
_TRAINING = "training"
CHAIN_WEIGHTS = ("measured", "equal")
"""--chain-weights (the flag keeps its name): the routes' sample shares from measured throughput, or equal and fixed."""


@dataclass(frozen=True)
class TrainSummary:
    final_loss: float
    first_loss: float
    steps: int
    wire_bytes: int
    fp32_wire_bytes: int
    sync_bytes: int
    """the tied embedding's gradient sum between the end stages (compressed, shaped), not part of wire_bytes"""
    mean_step_s: float
    seconds: float
    stages: int
    route: list[str]
    plan_version: int
    """The plan the last step ran on (0: no plan, an even split)."""
    replans: int
    """Times the trainer moved to a newer plan during the run."""
    csv: str
    plot: str | None
    total_wire_bytes: int = 0
    """every byte of the run: boundaries both ways + tied sync + replica sums + control, failed attempts too"""
    fp32_total_wire_bytes: int = 0
    """the same tensors in fp32 plus the same control bytes"""
    total_ratio_vs_fp32: float = 0.0
    """fp32_total_wire_bytes / total_wire_bytes (0: nothing counted)"""
    predicted_step_s: float | None = None
    """the plan's predicted step time (`PlanRoutes.predicted_step_s`), beside `mean_step_s`; None for even splits"""
    relay_extra_s: float | None = None
    """what the plan's relayed links add to `predicted_step_s` (`PlanRoutes.relay_extra_s`); None: none relayed"""
    median_step_s: float = 0.0
    """median step time (the first step left out, as in `mean_step_s`): what `predicted_step_s` is compared with,
    a few slow steps (a re-plan, a loaded machine's other work) moving the mean but not the median"""
    step_s_p10: float = 0.0
    """10th percentile of the step times: with `step_s_p90`, how much the machine's speed moved during the run"""
    step_s_p90: float = 0.0
    """90th percentile of the step times"""
    held_out_loss: float | None = None
    """mean loss per token on the held-out windows at the last evaluation (`swarm.train.heldout`); None: none ran"""
    held_out_step: int | None = None
    """steps applied when `held_out_loss` was measured (the run's `steps` when the final evaluation succeeded)"""
    held_out_samples: int = 0
    """held-out windows evaluated (`--eval-samples`)"""
    held_out_first_id: int | None = None
    """the first held-out window's sample id (they run on from it): which windows of the corpus were held out"""
    held_out_bytes: int = 0
    """bytes of the evaluations' calls, outside `total_wire_bytes`"""
    held_out_deferred: int = 0
    """periodic evaluations put off to keep the evaluations within `--eval-max-share` of the run's time"""
    state_bytes: int | None = None
    """stage state the peers sent each other over GetState (held copies, takeovers, joiners), as the live peers'
    `swarm_state_bytes_total` read at the end: no step's bytes, outside `total_wire_bytes` (a peer that died took its
    count with it); None: not read (no peer gave one, or a Status call failed)"""
    corpus_digest: str = ""
    """SHA-256 of the corpus (`DataReport.corpus_digest`): equal where two machines read the same text"""
    windows_digest: str = ""
    """SHA-256 of the training and held-out windows (`DataReport.windows_digest`): equal where two runs trained and
    evaluated on the same samples"""


@dataclass(frozen=True)
class TrainConfig:
    """What the trainer trains and how: `swarm train` builds it from flags, the demo and experiments directly."""

    model: AnyModelConfig = field(default_factory=ModelConfig, metadata=flag(via=ModelFlags, group=MODEL_GROUP))
    """The model; every stage's peer must serve the same one (flags: `ModelFlags`)."""
    num_stages: int | None = field(default=None, metadata=flag(group=_TRAINING))
    """stages to wait for when the peers follow no plan (--assign even; none: 2); with a plan, its stages"""
    data: str | None = field(default=None, metadata=flag(group=_TRAINING))
    """a text file or folder to train on (none: the Python standard library's sources)"""
    train_samples: int = field(default=64, metadata=flag(group=_TRAINING))
    """training samples (each seen once per epoch)"""
    batch_size: int = field(default=8, metadata=flag(group=_TRAINING))
    """samples per optimizer step"""
    micro_batches: int = field(default=4, metadata=flag(group=_TRAINING))
    """micro-batches per step (must divide the batch)"""
    schedule: str = field(default="1f1b", metadata=flag(choices=SCHEDULE_CHOICES, group=_TRAINING))
    """pipeline schedule"""
    steps: int | None = field(default=None, metadata=flag(group=_TRAINING))
    """optimizer steps (none: --epochs worth)"""
    epochs: int = field(default=4, metadata=flag(group=_TRAINING))
    """passes over the training samples (ignored when --steps is set)"""
    seed: int = field(default=0, metadata=flag(group=_TRAINING))
    """seed of the data order"""
    setting: str = field(default="swarm", metadata=flag(group=_TRAINING))
    """label of this run in the CSV"""
    wait_timeout_s: float = field(default=120.0, metadata=flag(group=_TRAINING))
    """give up if the stages are not all served within this many seconds (at the start and after a re-plan)"""
    replan_timeout_s: float = field(default=120.0, metadata=flag(group=_TRAINING))
    """with no route of replicas left, wait this long for a newer plan (the planner's repair), seconds"""
    chain_weights: str = field(default="measured", metadata=flag(choices=CHAIN_WEIGHTS, group=_TRAINING))
    """how a step's samples are shared among the routes of replicas: by their measured throughput
    (RouteWeights), or equally (every route weight 1, always: the same split every run, for comparisons)"""
    deadline_s: float = field(default=120.0, metadata=flag(group=_TRAINING))
    """longest a micro-batch may take end to end, seconds"""
    heartbeat_s: float = field(default=1.0, metadata=flag(group=_TRAINING))
    """seconds between the trainer's liveness pings of the stages while a step runs, and the smallest timeout of
    one (swarm.runtime.heartbeat: a peer is dead only once silent past its window and a confirming probe fails)"""
    heartbeat_misses: int = field(default=3, metadata=flag(group=_TRAINING))
    """timeouts' worth of silence that make a peer suspect; a ping's timeout grows with the peer's measured
    round trips (smoothed + 4 deviations, as TCP's), from --heartbeat-s to --heartbeat-ceiling-s"""
    heartbeat_ceiling_s: float = field(default=10.0, metadata=flag(group=_TRAINING))
    """largest timeout of one liveness ping, seconds, however slowly a peer answered before"""
    heartbeat_confirm_s: float = field(default=10.0, metadata=flag(group=_TRAINING))
    """deadline of the probe that confirms a silent peer's death, seconds (a killed peer refuses it at once)"""
    out: str | None = field(default=None, metadata=flag(group=_TRAINING))
    """folder for steps.csv, loss.png, summary.json (none: runs/train-<time>)"""
    resume: bool = field(default=False, metadata=flag(group=_TRAINING))
    """continue from --out's trainer_state.json, however the last run ended (a SIGKILL too): the step it left
    open is finished or run again on every stage, the data order goes on, and steps.csv is appended to"""
    checkpoint_every: int = field(default=50, metadata=flag(group=_TRAINING))
    """steps between fsyncs of trainer_state.json (it is rewritten at every step, which a kill never loses; a
    power cut loses the writes since the last fsync)"""
    eval_every: int = field(default=20, metadata=flag(group=_TRAINING))
    """steps between held-out evaluations, forward only through the stages (0: only after the last step)"""
    eval_max_share: float = field(default=0.25, metadata=flag(group=_TRAINING))
    """the most of the run's time periodic held-out evaluations may take: after one that took E >= 5 s, the next
    waits for E (1 - share) / share s of training (slow links: an evaluation sends fp32 activations; 1: every
    --eval-every steps whatever they cost; the one after the last step always runs)"""
    eval_samples: int = field(default=48, metadata=flag(group=_TRAINING))
    """held-out windows, cut from the corpus after the training ones (the ones `swarm demo` reports; 0: none)"""
    dht: DHTConfig | None = field(default=None, metadata={"flag": DHT_FLAGS})
    """How `swarm train` joins the DHT; None where the caller finds the route itself (demo, experiments)."""
    address_file: str | None = field(default=None, metadata=flag(group="DHT"))
    """join through the multiaddrs in this file (as `swarm bootstrap` writes), besides --initial-peers"""
    metrics_port: int | None = field(default=None, metadata=flag(group="monitoring"))
    """serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --host (none: off; 0: any port)"""
    verify_fraction: float = field(default=VerifyConfig().fraction, metadata=flag(group=_TRAINING))
    """share of micro-batches whose work a sibling replica recomputes and the trainer compares, on stages with
    replicas; replicas also compare their weights' digests after every step (0: both off;
    docs/SECURITY.md#verified-stage-work gives the cost and what it catches)"""
    verify_records: str = field(default="sketch", metadata=flag(choices=RECORD_CODECS, group=_TRAINING))
    """how audited records and recomputations travel: sketch (fp16 for what a sibling recomputes from, count
    sketches for the rest: about a fifth of fp32's bytes), fp16 (every tensor in fp16: half) or fp32; a compact
    audit whose checks fail is asked again in fp32, so verdicts stay fp32's (swarm.runtime.audit_wire)"""
    freeze: FreezeConfig | None = field(default=None, metadata={"flag": FREEZE_FLAG})
    """freeze a growing prefix of the layers by the gradient norms' change (PipeTransformer, swarm.train.freezing);
    the planner repacks the active layers onto fewer stages"""

    def __post_init__(self) -> None:
        for name in ("train_samples", "batch_size", "micro_batches", "epochs", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"TrainConfig: {self.micro_batches} micro-batches do not divide {self.batch_size} samples")
        if self.schedule not in SCHEDULE_CHOICES:
            choices = ", ".join(SCHEDULE_CHOICES)
            raise ValueError(f"TrainConfig.schedule: expected one of {choices}, got {self.schedule!r}")
        if self.eval_every < 0 or self.eval_samples < 0:
            raise ValueError("TrainConfig: eval_every and eval_samples must be >= 0")
        if not 0 < self.eval_max_share <= 1:
            raise ValueError(f"TrainConfig: eval_max_share must be in (0, 1], not {self.eval_max_share}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"TrainConfig.steps: expected >= 1 or None, got {self.steps}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"TrainConfig.num_stages: expected >= 1 or None, got {self.num_stages}")
        if self.deadline_s <= 0 or self.wait_timeout_s <= 0 or self.replan_timeout_s <= 0 or not self.heartbeat_s > 0:
            raise ValueError("TrainConfig: deadline_s, wait_timeout_s, replan_timeout_s and heartbeat_s must be > 0")
        self.heartbeat  # noqa: B018  (checks the liveness fields: HeartbeatConfig refuses nonsense by name)
        if self.chain_weights not in CHAIN_WEIGHTS:
            raise ValueError(f"TrainConfig.chain_weights: expected one of {CHAIN_WEIGHTS}, got {self.chain_weights!r}")
        if not 0 <= self.verify_fraction <= 1:
            raise ValueError(f"TrainConfig.verify_fraction: expected 0-1, got {self.verify_fraction}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"TrainConfig.metrics_port: expected 0-65535, got {self.metrics_port}")

    @property
    def heartbeat(self) -> HeartbeatConfig:
        """The driver's liveness pings (swarm.runtime.heartbeat) from the heartbeat_* fields."""
        floor_s = min(self.heartbeat_s, self.heartbeat_ceiling_s)  # a peer never measured: today's fixed timeout
        return HeartbeatConfig(
            interval_s=self.heartbeat_s, misses=self.heartbeat_misses, floor_s=floor_s,
            ceiling_s=self.heartbeat_ceiling_s, confirm_s=self.heartbeat_confirm_s,
        )  # fmt: skip


@cache
def train_flags() -> Flags[TrainConfig]:
    """`swarm train`'s flags: a `TrainConfig` whose DHT node joins in client mode (it serves nothing)."""
    from swarm.peers.dht_config import DHTConfig  # hivemind is slow to import: only when the command is built

    return Flags(TrainConfig, base=TrainConfig(dht=DHTConfig(client_mode=True)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    train_flags().add_to(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--save-model", metavar="DIR", help="at the end, write the model as a Hugging Face directory")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="what swarm's modules log (to stderr, above the progress bar); INFO adds re-plans, deferred held-out "
        "evaluations and the like (default: WARNING)",
    )


def configure_logging(level: str) -> None:
    """`swarm train`'s log lines: swarm's modules at `level` and up (hivemind's from WARNING), timestamped, on
    stderr; `train` prints them above its progress bar."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("hivemind").setLevel(logging.WARNING)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of `swarm train`'s parsed flags, with the --address-file's peers among the initial ones."""
    from swarm.daemon.bootstrap import joined_peers  # hivemind is slow to import: only when a config is made

    cfg = train_flags().from_args(args)
    dht = replace(cfg.dht, initial_peers=joined_peers(cfg.dht.initial_peers, cfg.address_file))
    if dht.run is not None:  # an owned run: the model and the run length are the manifest's (swarm.train.run_length)
        from swarm.daemon.run_cli import manifest_of, with_manifest
        from swarm.train.run_length import with_run_length

        manifest = manifest_of(dht)
        cfg = with_manifest(train_flags(), args, manifest)
        cfg = with_run_length(cfg, train_flags().given(args), manifest.total_steps, manifest.run_id)
    return replace(cfg, dht=dht)


def plan_referee(dht, model, plan_version: int):
    """The trainer's own recomputation of a stage under plan `plan_version` (`swarm.runtime.referee`), which settles
    a dispute between two replicas with the stage's weights (fetched over GetState, checked against the replicas'
    digest); None without that plan's layer ranges (no DHT, or a split by join order): disputes stay disputes."""
    from swarm.runtime.referee import StageReferee

    record = dht.get_plan(model.n_layers) if dht is not None and plan_version else None
    if record is None or record.version != plan_version:
        return None
    return StageReferee(model, [(stage.layer_start, stage.layer_end) for stage in record.document.stages])


def train(
    cfg: TrainConfig,
    route: PlanRoutes,
    quiet: bool = False,
    dht=None,
    say=lambda line: None,
    stop: threading.Event | None = None,
    metrics: Metrics | None = None,
    signer=None,
    suspects=None,
) -> TrainSummary:
    """Trains over the stages of `route`; raises StageCallError if one fails.

    With `dht`, it follows re-plans: between steps it checks for a newer plan, and a step a stage refuses
    because it already follows a newer plan is abandoned on every stage and run again on the new route.
    `metrics` is the process's registry (`swarm train` serves it with --metrics-port); None: a private one.
    `signer` (a `CallSigner`) signs every call to the stages; None: a fresh key, enough where any
    authenticated trainer may train. `suspects` (a `swarm.runtime.suspects.Suspects`) holds the run's strikes and
    bans across re-plans; None: a fresh one.
    """
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from swarm.daemon.nat import announced_dial
    from swarm.model.data import DataConfig, build_datasets, epoch_batches
    from swarm.net.auth import CallSigner, Identity
    from swarm.net.connect import GrpcConnector
    from swarm.runtime.modelcheck import model_label

    metrics = metrics if metrics is not None else Metrics()
    signer = signer or CallSigner(Identity.generate())
    model = cfg.model
    identity = model_identity(model)
    train_set, held_out_set, report = build_datasets(
        DataConfig(
            path=cfg.data,
            seq_len_tokens=model.seq_len_tokens,
            train_samples=cfg.train_samples,
            eval_samples=cfg.eval_samples,
            tokenizer=getattr(model, "tokenizer_path", None),
        )  # fmt: skip
    )
    if not quiet:
        print(report.describe(), file=sys.stderr)
    steps_per_epoch = len(train_set) // cfg.batch_size
    if steps_per_epoch < 1:
        raise SystemExit(f"--batch-size {cfg.batch_size} exceeds the {len(train_set)} training samples")
    total = cfg.steps or steps_per_epoch * cfg.epochs
    out = Path(cfg.out or default_out())
    out.mkdir(parents=True, exist_ok=True)

    dial = None if dht is None else announced_dial(dht.peers, signer)  # peers behind NAT: through their relays
    make_driver = driver_factory(cfg.freeze, model.n_layers)  # with --freeze: one FreezePolicy for the whole run
    if suspects is None:
        from swarm.runtime.suspects import Suspects

        suspects = Suspects()  # one for the run: a re-plan's driver knows whom this trainer evicted

    def make(r: PlanRoutes):
        return make_driver(
            r, cfg.schedule, cfg.micro_batches, deadline_s=cfg.deadline_s, heartbeat=cfg.heartbeat,
            plan_version=r.plan_version, metrics=metrics, signer=signer, weights=route_weights(cfg.chain_weights),
            tied=model.tied_embeddings, connector=GrpcConnector(signer=signer, dial=dial), suspects=suspects,
            verify=VerifyConfig(cfg.verify_fraction, records=cfg.verify_records) if cfg.verify_fraction > 0 else None,
            referee=plan_referee(dht, model, r.plan_version) if cfg.verify_fraction > 0 else None,
        )  # fmt: skip

    def connect(r: PlanRoutes):
        metrics.plan_version.set(r.plan_version)
        driver = make(r)
        statuses = driver.check_model(identity, model_label(model))  # another model's stage: refused before a step
        if dht is None:  # a fixed route set: no planner holds a prefix for it
            return driver
        # a prefix the planner holds, not the plan
        return with_stages_prefix(driver, r, statuses, make, model.n_layers, say)

    def answers(r: PlanRoutes) -> bool:  # the peers the driver declared dead answer again: a stall, not a death
        pinger = GrpcConnector(signer=signer, dial=dial)
        try:
            return route_answers(pinger, r, dht.peers(), suspects.banned_ids())
        finally:
            pinger.close()

    follower = PlanFollower(
        connect, route, dht, model.n_layers, say, cfg.wait_timeout_s, cfg.replan_timeout_s,
        answers=answers if dht is not None else None,
    )  # fmt: skip
    owned = cfg.dht is not None and cfg.dht.run is not None  # the manifest gave the stages and this trainer one length
    schedule = ScheduleWatch(total) if not owned else None
    rows = held_out_rows(cfg.batch_size, cfg.micro_batches)
    held = HeldOut(held_out_set, cfg.eval_every, rows, model.boundary_dim, metrics, max_share=cfg.eval_max_share)

    run_identity = {"seed": cfg.seed, "batch_size": cfg.batch_size, "train_samples": cfg.train_samples}
    journal = Journal(out, run_identity, steps_per_epoch, durable_every=cfg.checkpoint_every)
    record = (journal.load() or (0, None, None)) if cfg.resume else None  # no journal: the stages may know more
    settled = settle(follower.driver, record, say) if record is not None else Settled(0)
    if cfg.resume:  # the stages' record, settled against the journal, says where: the data order follows it
        at = settled.next_step
        say(f"resuming at step {at} (epoch {at // steps_per_epoch}, batch {at % steps_per_epoch})" if at else
            "nothing to resume")  # fmt: skip
    log, started = StepLog(out, CSV_FIELDS, resume_at=settled.next_step if cfg.resume else None), time.perf_counter()
    if settled.finished is not None and not log.has(settled.next_step):
        epoch, index = divmod(settled.finished.step, steps_per_epoch)
        batch = next(itertools.islice(epoch_batches(train_set, cfg.batch_size, epoch, cfg.seed), index, None))
        log.add(finished_row(cfg.setting, settled, epoch, batch.sample_ids))
    follower.driver.on_commit = journal.commit
    step = settled.next_step
    ended = False
    try:
        with (
            logging_redirect_tqdm(),  # log lines print above the bar, not through it
            tqdm(total=total, desc="training", unit="step", disable=quiet, file=sys.stderr) as bar,
        ):
            epoch, skip = divmod(step, steps_per_epoch)
            bar.update(step)
            while step < total and not (stop is not None and stop.is_set()):
                for index, batch in enumerate(epoch_batches(train_set, cfg.batch_size, epoch, cfg.seed)):
                    if index < skip:  # resumed: these batches of this epoch were trained before the stop
                        continue
                    if step >= total or (stop is not None and stop.is_set()):  # stop between steps
                        break
                    journal.begin(step)
                    r, retries = follower.run_step(step, batch)
                    if schedule is not None:
                        schedule.observe(step, r.lr)
                    row = step_record(cfg.setting, r, step, epoch, batch, follower, retries)
                    due = held.due(step + 1, total)
                    held_out = held.run(follower.driver, step + 1, follower.replan) if due else None
                    log.add({**row, "held_out_loss": "" if held_out is None else held_out})
                    step += 1
                    wire = log.wire_bytes
                    bar.set_postfix_str(f"loss {r.loss:.3f} | {r.seconds:.2f} s/step | wire {wire / 1e6:.1f} MB")
                    bar.update(1)
                epoch, skip = epoch + 1, 0
        # a run stopped between two evaluations: its final weights too
        held.finish(follower.driver, step, follower.replan)
        ended = True
    finally:
        follower.close()
        log.close()
        if ended:  # else the journal keeps the step that failed open (or committed): a resume settles it
            journal.close(step)
    return summarize(cfg.setting, log, held, follower, started, out, report)


def step_record(setting: str, result, step: int, epoch: int, batch, follower: PlanFollower, retries: int) -> dict:
    """steps.csv's row of `step` (counted from 0) of `epoch`: what the driver's `StepResult` `result` reports, on the
    plan `follower` ran it on after `retries` re-plans (`held_out_loss` is the caller's)."""
    ids = getattr(result, "sample_ids", None) or tuple(int(i) for i in batch.sample_ids)
    return {
        "setting": setting,
        **step_row(result, step + 1, epoch),
        "fp32_wire_bytes": result.fp32_wire_bytes,
        "tied_bytes": result.sync_bytes,
        "step_s": result.seconds,
        "skipped": int(result.skipped),  # fp16: every stage skipped it
        "loss_scale": result.loss_scale,
        "time": round(time.time(), 3),  # when the step completed (unix s): recovery times
        "machine_cpu_s": machine_cpu_s(),  # the machine's busy CPU-seconds then (CPU a step, from two rows)
        "plan_version": follower.route.plan_version,
        "stages": follower.driver.n_stages,
        "frozen_layers": getattr(getattr(follower.driver, "policy", None), "frozen", 0),  # --freeze: from the next step
        **step_columns(result, ids, follower.route.n_replicas, retries),
        **{f"link{k}_bytes": result.traffic.link_bytes.get(k, 0) for k in range(follower.driver.n_stages - 1)},
        **counter_columns(result.counters),
    }


def summarize(
    setting: str, log: StepLog, held: HeldOut, follower: PlanFollower, started: float, out: Path, report: DataReport
):
    """The run's `TrainSummary` from its step log, its held-out points and the plan it ended on (`started`: the
    `time.perf_counter()` of its first step; `report`: the data it trained on, whose digests it records), written
    to `out`/summary.json beside the loss plot (`out`/loss.png)."""
    from swarm.plots import Panel, moving_average, save_line_plots

    route = follower.route
    losses = list(log.losses)
    panel = Panel("training and held-out loss", "step", "loss")
    panel.series[setting] = (list(log.steps), moving_average(losses, 5))
    if held.points:
        panel.series["held-out"] = ([p.step for p in held.points], [p.loss for p in held.points])
    title = f"swarm train: {len(route.addresses)} stages"
    plot = save_line_plots([panel], out / "loss.png", title) if log.count else None
    times = list(log.step_seconds)
    summary = TrainSummary(
        final_loss=sum(losses[-5:]) / len(losses[-5:]) if losses else float("nan"),
        first_loss=losses[0] if losses else float("nan"),
        steps=log.count,
        wire_bytes=log.wire_bytes,
        fp32_wire_bytes=log.totals["fp32_wire_bytes"],
        sync_bytes=log.totals["sync_bytes"],
        mean_step_s=sum(times[1:] or times) / len(times[1:] or times) if times else 0.0,
        seconds=time.perf_counter() - started,
        stages=len(route.addresses),
        route=route.addresses,
        plan_version=route.plan_version,
        replans=follower.replans,
        csv=str(out / "steps.csv"),
        plot=str(plot) if plot else None,
        total_wire_bytes=log.totals["total_wire_bytes"],
        fp32_total_wire_bytes=log.totals["fp32_total_wire_bytes"],
        total_ratio_vs_fp32=log.totals["fp32_total_wire_bytes"] / max(1, log.totals["total_wire_bytes"]),
        predicted_step_s=getattr(route, "predicted_step_s", None),
        relay_extra_s=getattr(route, "relay_extra_s", None),
        **held.summary(),
        state_bytes=peers_state_bytes(follower.driver),
        **step_time_spread(times[1:] or times),
        corpus_digest=report.corpus_digest,
        windows_digest=report.windows_digest,
    )
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
    return summary


STATE_STATUS_TIMEOUT_S = 2.0
"""How long the summary waits for the replicas' Status, all asked at once (`peers_state_bytes`): hung peers delay the
end of a run by about this, however many, and leave the whole figure unread (None), never a partial sum."""


def peers_state_bytes(driver) -> int | None:
    """The GetState bytes every live replica of the route says it sent (its Status's `swarm_state_bytes_total`),
    summed; None where none gave one, or where a Status call failed. A peer's figure is its own claim, taken as a
    count to report, never to act on; one outside [0, 2^50] is left out."""
    try:
        replies = [r for row in driver.replica_status(timeout_s=STATE_STATUS_TIMEOUT_S) for r in row if r is not None]
    except Exception as e:  # noqa: BLE001 - the summary is written whatever the peers do at the end
        log.info("the peers' state bytes were not read: %s", e)
        return None
    counts = [dict(r.metrics).get("swarm_state_bytes_total") for r in replies]
    counts = [c for c in counts if isinstance(c, float) and 0 <= c <= 2**50]
    return int(sum(counts)) if counts else None


def finished_row(setting: str, settled: Settled, epoch: int, sample_ids) -> dict:
    """The row of a step its trainer committed before it was killed and a resume finished (`settle`): what its
    commit record holds (loss, norm, scale, plan), its lr and samples, no bytes (that life's counts died with it).
    """
    commit = settled.finished
    return {
        "setting": setting, "step": commit.step + 1, "epoch": epoch, "train_loss": commit.loss, "lr": settled.lr,
        "grad_norm": commit.grad_norm, "step_s": 0.0, "skipped": int(commit.skip), "loss_scale": commit.loss_scale,
        "plan_version": commit.plan_version, "time": round(time.time(), 3), "attempts": 1,
        "sample_ids": " ".join(str(int(i)) for i in sample_ids), "finished_on_resume": 1,
    }  # fmt: skip


def route_weights(kind: str):
    """The driver's RouteWeights for --chain-weights: `measured` moves with the routes' throughput; `equal`
    never moves (an infinite tolerance: no measurement ever replaces the weight 1 every route starts at)."""
    from swarm.runtime.routing import RouteWeights

    if kind not in CHAIN_WEIGHTS:
        raise ValueError(f"chain weights: expected one of {CHAIN_WEIGHTS}, got {kind!r}")
    return RouteWeights(tolerance=math.inf) if kind == "equal" else RouteWeights()


def default_out() -> str:
    """Where a run's steps go without --out: runs/train-<date>-<time>."""
    return f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}"


def trainer_page(dht, cfg: TrainConfig):
    """The status page on the trainer's metrics port: the run's DHT view (through the trainer's own DHT node), the
    peers' metrics and this trainer's steps under `cfg.out`; it reads only while the page is looked at."""
    from swarm.daemon.status import peer_metrics
    from swarm.daemon.status_page import DhtReader, StatusPage

    metrics_of = lambda peers: peer_metrics(peers, timeout_s=2.0)  # noqa: E731
    reader = DhtReader(dht, cfg.dht.run_name, cfg.dht.initial_peers, cfg.out, metrics_of)
    return StatusPage(reader, refresh_s=5.0, idle_s=60.0)


def _announce_quietly(dht, announcement) -> None:
    """Announces now (a ban, before the next beat); a failure is left to the next beat, which retries."""
    try:
        dht.announce(announcement)
    except Exception as e:
        log.warning("announcing the trainer's bans failed (the next heartbeat retries): %s", e)


def run(args: argparse.Namespace) -> int:
    from swarm.daemon.roster import PeerAuth
    from swarm.daemon.stopping import watch_stop_orders
    from swarm.net.stream import StageCallError
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.reannounce import Reannouncer
    from swarm.peers.records import MAX_BANNED, TrainerAnnouncement
    from swarm.runtime.suspects import Suspects

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    say = lambda line: print(line, file=sys.stderr)
    metrics = Metrics()
    auth = PeerAuth.load(cfg.dht)  # the trainer's calls are signed with its DHT key: stages know it by its id
    with SwarmDHT(cfg.dht, private_key=auth.identity.key) as dht, contextlib.ExitStack() as stack:
        if cfg.metrics_port is not None:
            # the live status page beside /metrics (swarm.daemon.status_page), read while someone looks at it
            cfg = replace(cfg, out=cfg.out or default_out())  # the page reads the steps where train() writes them
            page = stack.enter_context(contextlib.closing(trainer_page(dht, cfg)))
            # after the DHT's process is forked, so that it holds no copy of the listening socket
            try:
                server = stack.enter_context(serve_metrics(metrics, cfg.metrics_port, cfg.dht.host, routes=page.routes))
            except OSError as e:
                print(f"error: cannot serve metrics on {cfg.dht.host}:{cfg.metrics_port}: {e}", file=sys.stderr)
                return 2
            say(f"metrics at {server.url}")
            say(f"status page at {server.url.removesuffix('metrics')}")
        authority = dht.authority()
        if authority is not None and dht.peer_id not in authority.trainers:
            print(
                f"error: {dht.peer_id} is not a trainer of run {cfg.dht.run_name} (its owner delegated "
                f"{sorted(authority.trainers)}): train with a delegated key (--identity), or have the owner run "
                f"`swarm run delegate MANIFEST --trainer {dht.peer_id}`",
                file=sys.stderr,
            )
            return 2
        # the planner names announced trainers in the plan, and stages serve only those: announce until done
        me = TrainerAnnouncement(dht.peer_id, started_at=time.time())
        # the peers it evicts are announced with it, at once: the planner plans them no more
        ban = lambda: replace(me, banned=suspects.banned_ids()[-MAX_BANNED:])  # noqa: E731
        suspects = Suspects(on_ban=lambda *_: _announce_quietly(dht, ban()))
        stack.enter_context(Reannouncer(dht, ban))
        say(f"trainer {dht.peer_id} announced")
        try:
            route = discover_route(
                dht, cfg.num_stages, cfg.wait_timeout_s, say, trainer_id=dht.peer_id, n_layers=cfg.model.n_layers
            )
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        say(f"training on plan {route.plan_version}: {route.describe()}")
        try:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: (say("stopping after the current step"), stop.set()))
            watch_stop_orders(dht, stop, say)  # `swarm stop`
            summary = train(
                cfg, route, dht=dht, say=say, stop=stop, metrics=metrics, signer=auth.signer, suspects=suspects
            )
        except StageCallError as e:
            print(f"error: training failed: {e}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"error: training stopped: {e}", file=sys.stderr)
            return 2
        except ValueError as e:  # e.g. --resume from another run's trainer_state.json
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # the journal could not record a step's commit (a full disk): stopped before its Step
            print(f"error: training stopped: {e}", file=sys.stderr)
            return 1
        if args.save_model:  # from the live stages, as the last step left them (swarm.train.export_cli)
            from swarm.train.export_cli import held_out_of, save_model

            save_model(cfg.model, args.save_model, dht=dht, signer=auth.signer, **held_out_of(cfg), say=say)
    print(json.dumps(asdict(summary)) if args.json else format_summary(summary))
    return 0
