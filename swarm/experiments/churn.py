"""`swarm experiment churn`: the same seed trained twice on a local swarm, without churn and with a schedule of
kills, graceful leaves and joins, and what the churn cost (issue 12's targets, reported as measured).

Each setting starts a bootstrap node, swarm-peer processes (default: 3 stages x 2 replicas + 1 standby,
AQ-SGD forward and gradq backward) and a `swarm train` process on the embedded data set, trains a fixed
number of steps and reaps everything. In the churn setting a controller (swarm.testbed.churn_control) SIGKILLs
serving peers (SIGTERMs a `--graceful-fraction` of them) on a seeded schedule that starts at the first
completed step, and starts a fresh peer after each leave so the swarm keeps its size; it never touches the
bootstrap node or the trainer.

The run is judged by steps, not by the machine's speed: by default the schedule is in training steps (a
leave every `--kill-every-steps` 150 steps), played against the trainer's completed steps, so a machine half
as fast sees the same kills at the same steps; and a setting ends when its trainer has trained every step,
stopped only when no step completes for `--stall-timeout-s` (or past an explicit `--timeout-s`). Seconds
(`--kill-every S`, `--mean-lifetime S`) remain for studies of churn in wall-clock time.

Both settings compute the same numbers until the first kill, by design: same seed, same peer ids, declared
compute speeds, and by default no measured plan inputs (swarm-peer --no-link-probe: every link planned at
the default speed; swarm train --chain-weights equal: every route of replicas gets the same share). The
report compares the two settings' losses step by step up to the first kill. `--measured-plan` restores
the measured inputs (link probes, throughput-weighted routes) for realism studies.

Sample accounting, recovery and throughput come from the trainer's steps.csv, the controller's events.jsonl
and a step clock (swarm.experiments.churn_report).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC
from swarm.experiments.churn_report import (
    ROW_KEYS,
    expected_batches,
    loss_agreement,
    read_jsonl,
    read_steps,
    report_markdown,
    summarize,
    targets,
)
from swarm.flags import Flags, flag
from swarm.metrics import logged_state_bytes

SETTINGS = ("no-churn", "churn")
OPTIONAL_PEER_FLAGS = ("--replicas", "--no-link-probe")
OPTIONAL_TRAINER_FLAGS = ("--replan-timeout-s", "--chain-weights")
COMPUTE_LAYERS_PER_S = 8.0
"""Declared by every peer instead of measured (4.6-9.8 layers/s in one run here): measured speeds moved the
planner's layer split between the two settings ([0, 2) vs [0, 1) for stage 0), which changes the math being
compared."""
PLAN_INPUTS = {
    False: "frozen (peers --no-link-probe: every link planned at the default speed; trainer --chain-weights "
    "equal): both settings compute the same losses until the first kill",
    True: "measured (--measured-plan: link probes and throughput-weighted chains; timing noise moves the plan "
    "and the sample split, so the settings differ before the first kill)",
}
QUICK_STEPS = 120
"""--quick's steps: in namespaces the kill waits on a `swarm status` in the trainer's namespace (a fresh Python, a
DHT lookup: seconds on a loaded machine) and the join on a namespace of its own, and the run must outlast both. 40
steps did not; 80 did until s56, when 1 of 3 suite runs under load saw the trainer end before the join, likely
because the held copies of replicated stages, no longer made, had slowed the quick swarm's steps (not measured)."""
QUICK_STEPS_AFTER_CHURN = 10
"""--quick's churn setting ends this many steps after its join (the kill's recovery is in them): its 120 steps are
only the bound that leaves a loaded machine's slow join time to land; training them all cost the suite's longest
test 100 more steps of a five-process swarm."""
QUICK_KILL_AT_S = 5.0
"""--quick with --kill-every S: the one leave S seconds into training."""
QUICK_KILL_AT_STEP = 10
"""--quick's one leave, after this step (by default: in steps, like the full run)."""
KILL_EVERY_STEPS = 150
"""The default schedule: a leave every 150 steps, 2 in the default 400 (the runs of issue 12 saw 2-3 leaves
a minute apart at ~22 samples/s; on a machine half as fast a schedule in seconds saw 6)."""


@dataclass(frozen=True)
class ChurnConfig:
    """One `swarm experiment churn` run: the swarm, the training and the churn schedule."""

    stages: int = 3
    """pipeline stages"""
    replicas: int = 2
    """replicas per stage (passed as swarm-peer --replicas when the peer has that flag)"""
    standby: int = 1
    """extra peers on standby for takeovers, beyond stages x replicas"""
    steps: int = 400
    """optimizer steps per setting (both settings train the same number); 400 took 135 s without churn on main
    (3 stages, one route, 2 cores), leaving room for replicas' averaging and the recoveries in 15 minutes"""
    schedule_steps: int | None = field(default=None, metadata=flag(skip=True))
    """Steps of the learning-rate schedule (warm-up and cosine) the peers follow (None: `steps`): a setting may
    train fewer steps than its schedule spans and still compute what a longer run does over them."""
    train_samples: int = field(default=64, metadata=flag(skip=True))
    """Training samples of the embedded data set (the Python standard library's sources)."""
    batch_size: int = field(default=8, metadata=flag(skip=True))
    """Samples per step."""
    micro_batches: int = field(default=4, metadata=flag(skip=True))
    """Micro-batches per step."""
    seed: int = 0
    """seed of the data order, the planner and the churn schedule"""
    fw_codec: str = field(default=DEFAULT_FORWARD_CODEC, metadata=flag(skip=True))
    """Activation codec of the stage links."""
    bw_codec: str = field(default=DEFAULT_BACKWARD_CODEC, metadata=flag(skip=True))
    """Gradient codec of the stage links."""
    kill_every_s: float | None = field(default=None, metadata=flag(skip=True))
    """Seconds between leaves (a schedule in wall-clock time; give exactly one of the four schedules)."""
    mean_lifetime_s: float | None = field(default=None, metadata=flag(skip=True))
    """Mean lifetime of a serving peer, seconds (exponential lifetimes in wall-clock time)."""
    kill_every_steps: int | None = field(default=KILL_EVERY_STEPS, metadata=flag(skip=True))
    """Training steps between leaves (the default schedule: the same kills at the same steps on any machine)."""
    mean_lifetime_steps: float | None = field(default=None, metadata=flag(skip=True))
    """Mean lifetime of a serving peer, in training steps (exponential lifetimes)."""
    graceful_fraction: float = 0.0
    """share of the leaves that are SIGTERM (a graceful leave) instead of SIGKILL"""
    join_delay_s: float = field(default=2.0, metadata=flag(skip=True))
    """Seconds from a leave to the start of the fresh peer that replaces it."""
    churn_horizon_s: float = field(default=3600.0, metadata=flag(skip=True))
    """The schedule's span, seconds from the first step (the run ends it earlier when training ends)."""
    churn_horizon_steps: int | None = field(default=None, metadata=flag(skip=True))
    """A schedule in steps: its last leave at most at this step (None: before the last step)."""
    steps_after_churn: int | None = field(default=None, metadata=flag(skip=True))
    """The churn setting ends this many completed steps after its last churn action: its trainer is asked to stop
    after its current step (SIGTERM, as Ctrl-C) and an `end` event is logged; its steps are then accounted up to
    there (None: it trains every step). --quick's, which has nothing left to watch once its join is made."""
    setting_timeout_s: float | None = field(default=None, metadata=flag(name="--timeout-s"))
    """bound on one setting's training, seconds; the trainer is stopped past it (none: no wall-clock bound, a
    slower machine trains every step; only --stall-timeout-s stops a run)"""
    stall_timeout_s: float = 300.0
    """the trainer is stopped when no step has completed for this many seconds (a hung run)"""
    measured_plan: bool = False
    """plan from measured link speeds and share samples by measured route throughput (realism; both timing noise:
    the settings then differ before the first kill); by default every peer runs --no-link-probe and the trainer
    --chain-weights equal, so both settings compute the same losses step for step until the first kill"""
    identities: Path | None = field(default=None, metadata=flag(metavar="DIR"))
    """the peers' key files, created there if missing (none: OUT/identities, new keys per output folder). Peer ids
    decide the planner, the plan's columns and which route each sample takes (rendezvous hashing on the route's
    peer ids), so two runs given the same DIR compute the same losses"""
    verify_fraction: float | None = None
    """the trainer's --verify-fraction (none: its default, 0.1). Audits carry records through the trainer (sketched
    by default, swarm train's --verify-records), counted in both byte totals as control bytes: in the no-churn
    setting about 210 KB a replicated step, 28% of its bytes, so 0 shows what the codecs alone save"""
    netns: bool = False
    """run the swarm in the namespace testbed (needs root)"""
    out: Path | None = None
    """output folder (none: runs/churn-<time>)"""

    def __post_init__(self) -> None:
        for name in ("stages", "replicas", "steps", "train_samples", "batch_size", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChurnConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(f"ChurnConfig.schedule_steps: {self.schedule_steps} is fewer than the {self.steps} steps")
        if self.standby < 0 or self.batch_size % self.micro_batches or self.train_samples % self.batch_size:
            raise ValueError("ChurnConfig: standby >= 0; micro-batches divide the batch, the batch the samples")
        schedules = (self.kill_every_s, self.mean_lifetime_s, self.kill_every_steps, self.mean_lifetime_steps)
        if sum(x is not None for x in schedules) != 1:
            raise ValueError(
                "ChurnConfig: give exactly one of --kill-every, --mean-lifetime, --kill-every-steps and "
                "--mean-lifetime-steps"
            )
        if any(x is not None and x <= 0 for x in schedules):
            raise ValueError("ChurnConfig: the schedule's interval must be > 0")
        if self.stall_timeout_s <= 0 or (self.setting_timeout_s is not None and self.setting_timeout_s <= 0):
            raise ValueError("ChurnConfig: --stall-timeout-s and --timeout-s must be > 0")
        if self.verify_fraction is not None and not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"--verify-fraction must be in [0, 1], got {self.verify_fraction}")
        if not 0.0 <= self.graceful_fraction <= 1.0:
            raise ValueError(f"--graceful-fraction must be in [0, 1], got {self.graceful_fraction}")

    @property
    def peers(self) -> int:
        return self.stages * self.replicas + self.standby

    @property
    def in_steps(self) -> bool:
        """Whether the churn schedule is in training steps (else in seconds)."""
        return self.kill_every_s is None and self.mean_lifetime_s is None

    def schedule_label(self) -> str:
        """The schedule in words, for the report: "a kill every 150 steps", ..."""
        if self.kill_every_steps is not None:
            return f"a kill every {self.kill_every_steps} steps"
        if self.mean_lifetime_steps is not None:
            return f"peer lifetimes of {self.mean_lifetime_steps:g} steps on average"
        if self.kill_every_s is not None:
            return f"a kill every {self.kill_every_s:g} s"
        return f"peer lifetimes of {self.mean_lifetime_s:g} s on average"


def _settings(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))


@dataclass(frozen=True)
class ChurnRun:
    """`swarm experiment churn`'s flags: the run's config, its churn schedule (whose defaults depend on each
    other and on --quick) and how the result is printed."""

    churn: ChurnConfig = field(default_factory=ChurnConfig)
    kill_every_steps: int | None = field(default=None, metadata=flag(metavar="N"))
    """training steps between leaves (the default schedule: 150 unless another schedule is given)"""
    mean_lifetime_steps: float | None = field(default=None, metadata=flag(metavar="N"))
    """instead: serving peers live an exponential number of training steps of this mean"""
    kill_every: float | None = field(default=None, metadata=flag(metavar="S"))
    """instead: seconds between leaves (wall-clock time: a slower machine sees more leaves per step)"""
    mean_lifetime: float | None = field(default=None, metadata=flag(metavar="S"))
    """instead: serving peers live an exponential time of this mean, seconds"""
    quick: bool = False
    """a small swarm (2 stages, 1 standby), one kill after step 10 (or --kill-every S s into training) and one join;
    the churn setting ends 10 steps after the join (at most 120 steps)"""
    settings: tuple[str, ...] = field(
        default=SETTINGS, metadata=flag(parse=_settings, render=",".join, metavar="NAMES")
    )
    """the settings to run, comma-separated, of: no-churn, churn (e.g. `no-churn` alone for the bytes)"""
    json: bool = False
    """print the rows as JSON"""

    def __post_init__(self) -> None:
        if not self.settings or set(self.settings) - set(SETTINGS):
            raise ValueError(f"--settings: one or both of {', '.join(SETTINGS)}, got {','.join(self.settings)}")

    def config(self) -> ChurnConfig:
        """The ChurnConfig of the flags: --kill-every 60 unless --mean-lifetime; --quick shrinks the swarm.

        Raises:
            ValueError: the flags do not make a valid run (both --kill-every and --mean-lifetime, ...).
        """
        cfg = self.churn
        given = (self.kill_every, self.mean_lifetime, self.kill_every_steps, self.mean_lifetime_steps)
        if sum(x is not None for x in given) > 1:
            raise ValueError("give one of --kill-every, --mean-lifetime, --kill-every-steps, --mean-lifetime-steps")
        if self.quick:
            # one leave (the schedule's span ends with the first one), the join right after it: on a swarm that
            # cannot reroute yet the run ends at the kill
            quick = replace(cfg, stages=2, standby=1, steps=QUICK_STEPS, train_samples=32, join_delay_s=0.0,
                            mean_lifetime_s=None, mean_lifetime_steps=None,
                            steps_after_churn=QUICK_STEPS_AFTER_CHURN)  # fmt: skip
            if self.kill_every is not None:
                return replace(quick, kill_every_s=self.kill_every, kill_every_steps=None,
                               churn_horizon_s=self.kill_every)  # fmt: skip
            at = self.kill_every_steps or QUICK_KILL_AT_STEP
            return replace(quick, kill_every_s=None, kill_every_steps=at, churn_horizon_steps=at)
        if not any(x is not None for x in given):
            given = (None, None, cfg.kill_every_steps or KILL_EVERY_STEPS, None)
        kill_s, life_s, kill_steps, life_steps = given
        return replace(cfg, kill_every_s=kill_s, mean_lifetime_s=life_s, kill_every_steps=kill_steps,
                       mean_lifetime_steps=life_steps)  # fmt: skip


_FLAGS = Flags(ChurnRun)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def config_from_args(args: argparse.Namespace) -> ChurnConfig:
    return _FLAGS.from_args(args).config()


def swarm_flags(cfg: ChurnConfig, setting: str, support: dict[str, bool]) -> tuple[list[str], list[str]]:
    """(swarm-peer flags, swarm train flags) of one setting; flags this checkout's peer or trainer lacks are
    left out (main before issue 12: no --replicas)."""
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig, peer_flags
    from swarm.options import CodecFlags
    from swarm.runtime.worker import OptimConfig
    from swarm.train.trainer import train_flags

    planning = PlanningConfig(
        min_peers=cfg.peers,
        seed=cfg.seed,
        replicas=cfg.replicas if support.get("--replicas") else 0,
        probe_links=not (support.get("--no-link-probe") and not cfg.measured_plan),
        codec_policy="fixed",  # the setting's codecs on every link: its bytes are what the rows compare
    )
    config = PeerConfig(
        num_stages=cfg.stages,
        threads=1,
        compute_layers_per_s=COMPUTE_LAYERS_PER_S,
        planning=planning,
        optim=OptimConfig(total_steps=(span := cfg.schedule_steps or cfg.steps), warmup_steps=max(1, span // 10)),
        **CodecFlags(cfg.fw_codec, cfg.bw_codec).build(),
    )
    # named even where they are this checkout's defaults: a run of another checkout may default otherwise
    explicit = ["--num-stages", "--min-peers", "--fw-codec", "--bw-codec", "--threads", "--plan-seed"]
    explicit += [
        "--compute-speed",
        "--total-steps",
        "--warmup-steps",
        *(["--replicas"] if support.get("--replicas") else []),
    ]
    peer = peer_flags().to_argv(config, always=explicit)
    flags = train_flags()
    train = replace(
        flags.base, num_stages=cfg.stages, steps=cfg.steps, seed=cfg.seed, setting=setting,
        train_samples=cfg.train_samples, batch_size=cfg.batch_size, micro_batches=cfg.micro_batches, deadline_s=60.0,
        wait_timeout_s=180.0, replan_timeout_s=120.0,
        chain_weights="equal" if support.get("--chain-weights") and not cfg.measured_plan else "measured",
    )  # fmt: skip
    if cfg.verify_fraction is not None:
        train = replace(train, verify_fraction=cfg.verify_fraction)
    explicit = ["--num-stages", "--steps", "--seed", "--setting", "--train-samples", "--batch-size"]
    explicit += ["--micro-batches", "--deadline-s", "--wait-timeout-s"]
    explicit += ["--verify-fraction"] if cfg.verify_fraction is not None else []
    explicit += ["--replan-timeout-s"] if support.get("--replan-timeout-s") else []
    return peer, flags.to_argv(train, always=explicit)


def flag_support() -> dict[str, bool]:
    """Which optional flags the peers and the trainer take. Both run this interpreter on this checkout
    (`swarm.testbed.procs`), so their parsers are read in process: a `--help` subprocess took over 120 s to start
    on a machine loaded 30x over its cores, and the experiment died before its first peer."""
    import argparse

    from swarm.daemon.peer_config import build_parser
    from swarm.train.trainer import add_arguments

    peer = build_parser().format_help()
    trainer = argparse.ArgumentParser()
    add_arguments(trainer)
    text = trainer.format_help()
    support = {flag: re.search(rf"(^|\s){re.escape(flag)}[\s=,]", peer) is not None for flag in OPTIONAL_PEER_FLAGS}
    support.update({flag: flag in text for flag in OPTIONAL_TRAINER_FLAGS})
    return support


def run_setting(cfg: ChurnConfig, setting: str, out: Path, support: dict[str, bool], say=print) -> dict:
    """Trains one setting on a fresh local swarm; returns {"rc": trainer exit code, "pids": {name: pid}}.
    Writes steps.csv, events.jsonl, step_clock.jsonl, schedule.json and logs/ under out/setting."""
    from swarm.testbed.churn_control import (
        ChurnController,
        ChurnSwarm,
        StepClock,
        churn_schedule,
        churn_schedule_steps,
        last_step,
    )

    d = out / setting
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    schedule = []
    if setting == "churn" and cfg.in_steps:
        horizon = cfg.steps if cfg.churn_horizon_steps is None else min(cfg.steps, cfg.churn_horizon_steps + 1)
        schedule = churn_schedule_steps(
            horizon, cfg.seed, cfg.kill_every_steps, cfg.mean_lifetime_steps, cfg.stages * cfg.replicas,
            cfg.graceful_fraction, cfg.join_delay_s,
        )  # fmt: skip
    elif setting == "churn":
        schedule = churn_schedule(
            cfg.churn_horizon_s, cfg.seed, cfg.kill_every_s, cfg.mean_lifetime_s, cfg.stages * cfg.replicas,
            cfg.graceful_fraction, cfg.join_delay_s,
        )  # fmt: skip
    (d / "schedule.json").write_text(json.dumps([asdict(a) for a in schedule], indent=1))
    (d / "events.jsonl").touch()
    clock_path = d / "step_clock.jsonl"
    peer_flags, trainer_flags = swarm_flags(cfg, setting, support)
    rc, threads = None, []
    with contextlib.ExitStack() as stack:
        wrap = observe = None
        if cfg.netns:  # namespaces for every peer that may join within the timeout, made up front
            from swarm.testbed.churn_netns import NetnsPlacement

            bound = cfg.setting_timeout_s
            joins = sum(1 for a in schedule if a.kind == "join" and (a.at_step or bound is None or a.at_s <= bound))
            place = stack.enter_context(NetnsPlacement(d, cfg.peers + joins, say=say))
            wrap, observe = place.wrap, place.stages
        # both settings' peers share keys: same ids, same plan and routes, so they compute alike until a kill
        swarm = stack.enter_context(
            ChurnSwarm(d, peer_flags, trainer_flags, wrap, observe, cfg.identities or out / "identities")
        )
        try:
            swarm.start(cfg.peers)
            say(f"{setting}: {cfg.peers} peers starting; trainer waits for a plan")
            trainer = swarm.start_trainer(d / "trainer")
            url = swarm.trainer_metrics_url(120.0)
            if cfg.netns:  # the trainer's namespace is out of this process's reach: the clock runs there
                swarm.start_clock(url, clock_path)
            else:
                threads.append(StepClock(url, clock_path))
            steps_done = lambda: (last_step(clock_path) or (None,))[0]
            controller = ChurnController(
                swarm, schedule, d / "events.jsonl", steps=steps_done, end_after=cfg.steps_after_churn
            )  # `end_after` ends a played schedule only: no-churn has none
            threads.append(controller)
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + cfg.stall_timeout_s  # the first step is progress too
            while not _has_lines(clock_path) and trainer.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)  # polling the clock's file for the first step, bounded by the deadline
            controller.begin()
            say(f"{setting}: training ({len(schedule)} churn actions scheduled, {cfg.schedule_label()})")
            rc = wait_for_steps(trainer, lambda: last_step(clock_path), cfg.stall_timeout_s, cfg.setting_timeout_s)
            if ended := [e for e in controller.events if e["kind"] == "end"]:
                say(f"{setting}: the trainer was asked to stop after step {ended[0]['at_step']}, its churn done")
        except Exception as e:  # a hung or failed trainer still leaves its files for the report
            say(f"{setting}: {type(e).__name__}: {e}")
        finally:
            for thread in threads:
                thread.stop.set()
                if isinstance(thread, ChurnController):
                    thread.begin()  # releases a controller still waiting for the first step
            for thread in threads:
                thread.join(10)
        pids = {name: proc.pid for name, proc in swarm.procs.procs.items()}
    if (d / "trainer" / "steps.csv").exists():
        shutil.copy(d / "trainer" / "steps.csv", d / "steps.csv")
    say(f"{setting}: trainer exit code {rc}")
    return {"rc": rc, "pids": pids}


def wait_for_steps(trainer, progress, stall_timeout_s: float, timeout_s: float | None = None, poll_s: float = 0.5):
    """The trainer's exit code once it exits. It is not stopped for being slow: only when no step has
    completed for `stall_timeout_s` (a hung run), or past an explicit `timeout_s`.

    Args:
        trainer: a `subprocess.Popen` (`poll`, `wait`).
        progress: () -> (completed steps, when) of the latest step, or None before the first.
        poll_s: the polling period.

    Raises:
        TimeoutError: stalled or past `timeout_s`; the message says which.
    """
    import subprocess

    start = time.monotonic()
    seen, since = None, start
    while True:
        try:
            return trainer.wait(poll_s)
        except subprocess.TimeoutExpired:
            pass  # the polling period: the trainer is still training
        now = time.monotonic()
        latest = progress()
        if latest is not None and latest[0] != seen:
            seen, since = latest[0], now
        if now - since > stall_timeout_s:
            raise TimeoutError(f"swarm train: no step completed for {stall_timeout_s:g} s (at step {seen}): stopped")
        if timeout_s is not None and now - start > timeout_s:
            raise TimeoutError(f"swarm train: past --timeout-s {timeout_s:g} s at step {seen}: stopped")


def _has_lines(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def collect(cfg: ChurnConfig, out: Path, settings=SETTINGS, expected=None) -> list[dict]:
    """The rows of the settings already run under `out` (also usable on an earlier run's folder)."""
    from swarm.model.gpt import ModelConfig

    if expected is None:
        expected = expected_batches(
            cfg.steps, cfg.batch_size, cfg.train_samples, cfg.seed, ModelConfig().seq_len_tokens
        )
    rows, steps = [], {}
    for setting in settings:
        d = out / setting
        steps[setting], events = read_steps(d / "steps.csv"), read_jsonl(d / "events.jsonl")
        # a setting ended on purpose (`steps_after_churn`) is judged on the steps up to its end
        target = next((e["at_step"] for e in events if e.get("kind") == "end"), cfg.steps)
        rows.append(summarize(setting, steps[setting], events, read_jsonl(d / "step_clock.jsonl"), expected,
                              cfg.batch_size, target, logged_state_bytes(d / "logs")))  # fmt: skip
        if setting == "churn" and "no-churn" in steps:  # same computation until the first kill: is it?
            rows[-1].update(loss_agreement(steps["no-churn"], steps["churn"], events))
    return rows


def write_outputs(cfg: ChurnConfig, out: Path, rows: list[dict], notes: list[str]) -> list:
    from swarm.experiments.churn_plots import save_plots

    plots = save_plots(out, [r["setting"] for r in rows], cfg.batch_size)
    checks = targets(rows, cfg.kill_every_s, schedule=cfg.schedule_label())
    config = {"stages": cfg.stages, "replicas": cfg.replicas, "standby": cfg.standby, "steps": cfg.steps,
              "seed": cfg.seed, "codecs": f"{cfg.fw_codec}/{cfg.bw_codec}", "churn": cfg.schedule_label(),
              "graceful fraction": cfg.graceful_fraction,
              "plan inputs": PLAN_INPUTS[cfg.measured_plan],
              "peer keys": str(cfg.identities or out / "identities")}  # fmt: skip
    if cfg.steps_after_churn is not None:
        config["steps"] = f"{cfg.steps} at most: churn ends {cfg.steps_after_churn} steps after its last churn action"
    text = report_markdown(rows, checks, config, [p.name for p in plots])
    if notes:
        text += "\n## Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"rows": rows, "targets": [asdict(c) for c in checks]}, indent=1))
    return checks


def run(args: argparse.Namespace) -> int:
    try:
        flags = _FLAGS.from_args(args)
        cfg = flags.config()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    say = lambda line: print(line, file=sys.stderr)  # stderr: --json stays clean
    if cfg.netns:
        from swarm.testbed.netns import unavailable_reason

        reason = unavailable_reason()
        if reason:
            say(f"skipped: --netns needs the namespace testbed, which is unavailable here: {reason}")
            return 0
    out = cfg.out or Path(f"runs/churn-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    support = flag_support()
    notes = [
        f"{'swarm train' if flag in OPTIONAL_TRAINER_FLAGS else 'swarm-peer'} {flag} not in this checkout: not passed"
        for flag, ok in support.items()
        if not ok
    ]
    for note in notes:
        say(note)
    started = time.monotonic()
    # the expected data order is built while the first swarm starts (it reads the corpus)
    expected: list = []
    worker = threading.Thread(target=lambda: expected.extend(_expected(cfg)), daemon=True)
    worker.start()
    settings = [s for s in SETTINGS if s in flags.settings]  # no-churn first: the churn row compares with it
    for setting in settings:
        result = run_setting(cfg, setting, out, support, say)
        if result["rc"] not in (0,):
            notes.append(f"{setting}: the trainer exited with code {result['rc']} (see {setting}/logs/trainer.log)")
    worker.join()
    rows = collect(cfg, out, settings, expected=expected)
    checks = write_outputs(cfg, out, rows, notes)
    say(f"done in {time.monotonic() - started:.0f} s; wrote {out}/report.md")
    if flags.json:
        print(json.dumps([{k: r[k] for k in ROW_KEYS} for r in rows], indent=1))
    else:
        for c in checks:
            print(f"{c.verdict:13} {c.name}: {c.value}")
    return 0


def _expected(cfg: ChurnConfig) -> list:
    from swarm.model.gpt import ModelConfig

    return expected_batches(cfg.steps, cfg.batch_size, cfg.train_samples, cfg.seed, ModelConfig().seq_len_tokens)
