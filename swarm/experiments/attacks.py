"""`swarm experiment attacks`: a real local open run attacked one way per setting, and whether the code stops it.

Each setting starts a fresh app-shaped run: a bootstrap node, volunteer `swarm-peer`s (default 3 stages x 2
replicas) and one `swarm train`, all local processes (`swarm.testbed.churn_control.ChurnSwarm`), and trains a
fixed number of steps. The settings:

- `clean`: no attack (and, where the peers have a verification switch, the same run with verification off, for the
  throughput it costs);
- the stranger attacks of `swarm.experiments.adversaries` (ground-key planner, Sybils then a planner kill, stranger
  trainers, held data streams, relay slot fill, token replay), started once the trainer has completed
  `--attack-at-step` steps;
- an in-plan liar per lie of `swarm.experiments.liar_peer` (`liar-scale:300`, ...): one volunteer, the one the clean
  run's plan put at a middle stage, runs modified code from its start.

Meanwhile the experiment reads the run as anyone can (its plan, bans and announcements in the DHT, every half
second, to observations.jsonl) and the trainer's steps; `swarm.experiments.attacks_report` turns them into one
row per setting, judged only by what the run exposed: where a defence is not in the code, its row shows the
attack succeeding.

The run is open (no --trusted-planners, no --trainers) unless the checkout has owned runs
(`swarm.daemon.run_cli.init_run`): then `_start_run` makes an owner, its manifest and delegated keys and every
row says `owned_run: true`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from swarm.experiments.attacks_patience import Patience
from swarm.experiments.attacks_report import (
    CLEAN_KEYS,
    LOSS_KEYS,
    ROW_KEYS,
    SHAPE_KEYS,
    Observation,
    Setting,
    clean_row,
    judge,
    read_observations,
    read_steps,
    report_markdown,
    save_plots,
    targets,
)
from swarm.experiments.liar_peer import LIES
from swarm.flags import Flags, flag

__all__ = ["AttacksConfig", "AttacksRun", "SETTINGS", "add_arguments", "run"]

STRANGER_SETTINGS = (
    "ground-key-planner", "sybils-planner-kill", "stranger-trainers", "held-data-streams", "relay-slot-fill",
    "token-replay",
)  # fmt: skip
LIAR_SETTINGS = tuple(f"liar-{lie}" for lie in LIES)
CONTROL_SETTINGS = ("churn-control",)
"""Diagnostics, no attack and no target: `churn-control` is the clean run with the liars' volunteer SIGKILLed
once the trainer completed `churn_at_step` steps (an honest loss of the same replica a liar's eviction costs)."""
SETTINGS = ("clean", *STRANGER_SETTINGS, *LIAR_SETTINGS, *CONTROL_SETTINGS)
QUICK_SETTINGS = ("clean", "liar-norm:nan")
"""--quick's settings: about 45 s each on a loaded 2-core machine (`--quick --settings A,B` runs others)."""
COMPUTE_LAYERS_PER_S = 8.0
"""Declared by every peer instead of measured, so every setting gets the same plan from the same keys."""
VERIFY_OFF_FLAGS = ("--verify-fraction", "0")
"""The trainer's switch for stage verification (`swarm.runtime.verify`): no audits, no weight digests."""
HARD_FACTOR = 3.0
"""A trainer still making steps (or evaluating after its last) may run this many times the setting's bound."""


@dataclass(frozen=True)
class AttacksConfig:
    """One `swarm experiment attacks` run: the swarm, the training, and the attacks' sizes."""

    stages: int = 3
    """pipeline stages"""
    replicas: int = 2
    """replicas per stage (stages x replicas volunteers in the plan)"""
    standbys: int = 1
    """volunteers beyond stages x replicas, which the first plan keeps on standby: an evicted liar's place goes to
    one (the planner's repair, `swarm.daemon.repair`), which pulls the stage's state from the liar's sibling, so
    the run keeps its shape (0: the stage serves on with one replica fewer)"""
    steps: int = 120
    """optimizer steps each setting trains (long enough that the loss curve has flattened: at 30 steps it still
    fell ~0.6% a step, so one perturbed early step, an honest peer's kill included, moved the final loss by 1-2%)"""
    attack_at_step: int = 3
    """a stranger attack starts once the trainer has completed this many steps"""
    churn_at_step: int = 1
    """churn-control kills the liars' volunteer once the trainer has completed this many steps (the liars are
    evicted at steps 0-3)"""
    settings: str = "all"
    """comma-separated settings to run (all: every one); clean always runs first"""
    seed: int = 0
    """seed of the data order and the planner"""
    train_samples: int = 960
    """training samples of the embedded data set (the default, steps x batch: each sample is seen once, as in
    pretraining, so the final training loss is a loss on unseen samples)"""
    batch_size: int = field(default=8, metadata=flag(skip=True))
    """Samples per step."""
    micro_batches: int = field(default=4, metadata=flag(skip=True))
    """Micro-batches per step."""
    stall_s: float = 60.0
    """a setting whose trainer completes no step for this long (or 5 median step intervals, if longer: a loaded
    machine) has stopped: the trainer is stopped (`swarm.experiments.attacks_patience`)"""
    setting_timeout_s: float = field(default=600.0, metadata=flag(name="--timeout-s"))
    """bound on one setting, seconds, from the trainer's start (+ 120 s for the first plan); a trainer that still
    makes steps, or evaluates after its last, goes on to 3 times that"""
    sybils: int = 20
    """Sybil announcements before the planner kill"""
    stranger_trainers: int = 16
    """stranger trainer announcements"""
    held_streams: int = 24
    """held Forward streams per stage-0 peer"""
    no_verify_flags: str = "auto"
    """swarm train flags that turn stage verification off, for the clean run's second measurement (auto:
    --verify-fraction 0; none: do not measure)"""
    identities: Path | None = field(default=None, metadata=flag(metavar="DIR"))
    """the peers' and the trainer's key files, created there if missing (none: OUT/identities); every setting
    uses the same keys, so the same plan"""
    out: Path | None = None
    """output folder (none: runs/attacks-<time>)"""

    def __post_init__(self) -> None:
        for name in ("stages", "replicas", "steps", "train_samples", "batch_size", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttacksConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.standbys < 0:
            raise ValueError(f"AttacksConfig.standbys: expected >= 0, got {self.standbys}")
        if self.stages * self.replicas < 2 or not 0 <= self.attack_at_step < self.steps:
            raise ValueError("AttacksConfig: need at least 2 volunteers and 0 <= attack_at_step < steps")
        if self.batch_size % self.micro_batches or self.train_samples % self.batch_size:
            raise ValueError("AttacksConfig: micro-batches divide the batch, the batch the samples")
        unknown = set(self.chosen()) - set(SETTINGS)
        if unknown:
            raise ValueError(f"--settings: unknown {sorted(unknown)}; known: {', '.join(SETTINGS)}")

    @property
    def peers(self) -> int:
        """Volunteers the plan puts at stages."""
        return self.stages * self.replicas

    @property
    def volunteers(self) -> int:
        """Volunteers started: the plan's and the standbys."""
        return self.peers + self.standbys

    def chosen(self) -> tuple[str, ...]:
        if self.settings == "all":
            return SETTINGS
        names = [s.strip() for s in self.settings.split(",") if s.strip()]
        return ("clean", *[n for n in names if n != "clean"])


@dataclass(frozen=True)
class AttacksRun:
    """`swarm experiment attacks`'s flags."""

    attacks: AttacksConfig = field(default_factory=AttacksConfig)
    quick: bool = False
    """a small run for the test suite: 2 stages x 2 replicas, 8 steps, settings clean and liar-norm:nan (unless
    --settings names others)"""
    json: bool = False
    """print one row per setting as JSON"""

    def config(self) -> AttacksConfig:
        cfg = self.attacks
        if not self.quick:
            return cfg
        settings = ",".join(QUICK_SETTINGS) if cfg.settings == "all" else cfg.settings
        return replace(cfg, stages=2, replicas=2, steps=8, attack_at_step=2, train_samples=32, settings=settings,
                       stall_s=45.0, setting_timeout_s=150.0, sybils=4, stranger_trainers=4,
                       no_verify_flags="none")  # fmt: skip


_FLAGS = Flags(AttacksRun)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


@dataclass
class RunSetup:
    """How the run's processes are told which run they join: extra flags for every peer and for the trainer."""

    owned: bool
    peer_flags: list[str]
    trainer_flags: list[str]
    trainer_key: Path
    note: str
    run: str | None = None
    """what `--run` names (the manifest file) in an owned run; None: the open run"""
    run_name: str = "swarm"
    """the run's DHT namespace: an owned run's id"""


def _start_run(cfg: AttacksConfig, identities: Path) -> RunSetup:
    """The run every setting joins: an owned run (`swarm.daemon.run_cli.init_run`). The owner's key signs a
    manifest (the model, codecs and the schedule of `cfg.steps`) that delegates the trainer's key and, as
    planners, the keys of the first two volunteers (so a planner kill fails over to the other); every peer and
    the trainer join with `--run` naming the manifest file. The attacks come from keys the owner never
    delegated."""
    from swarm.daemon.run_cli import init_run
    from swarm.net.auth import Identity
    from swarm.peers.dht_config import load_or_create_key
    from swarm.train.trainer import train_flags

    trainer_key = identities / "trainer.der"
    identities.mkdir(parents=True, exist_ok=True)
    for path in (trainer_key, *(identities / f"peer{i}.der" for i in range(min(2, cfg.peers)))):
        load_or_create_key(str(path))  # made now, so that the manifest can name them
    planners = tuple(Identity.load(str(identities / f"peer{i}.der")).peer_id for i in range(min(2, cfg.peers)))
    trainers = (Identity.load(str(trainer_key)).peer_id,)
    run_dir = identities / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun into the same --out: a fresh owner
    run = init_run(
        run_dir, name="attacks", planners=planners, trainers=trainers, total_steps=cfg.steps,
        warmup_steps=warmup_steps(cfg.steps),
    )  # fmt: skip
    flags = train_flags()
    key_flag = flags.to_argv(replace(flags.base, dht=replace(flags.base.dht, signing_key_path=str(trainer_key))))
    joined = ["--run", str(run.manifest_path)]
    return RunSetup(True, joined, [*key_flag, *joined], trainer_key, f"owned run {run.run_id}",
                    str(run.manifest_path), run.run_id)  # fmt: skip


def warmup_steps(steps: int) -> int:
    """The runs' warm-up: half the run, at most the default's 40. A tenth of a 30-step run (3 steps) reached the peak
    rate within Adam's second-moment horizon and spiked the clean run's loss from 3.6 to 8.4 at step 9
    (`OptimConfig.warmup_steps`, scripts/loss_spike.py): whether a run spiked then decided its final loss more than
    any liar did, and made the 1% comparison a coin toss."""
    return max(1, min(40, steps // 2))


def swarm_flags(cfg: AttacksConfig, setup: RunSetup, setting: str) -> tuple[list[str], list[str]]:
    """(swarm-peer flags, swarm train flags) of every setting."""
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig, peer_flags
    from swarm.runtime.worker import OptimConfig
    from swarm.train.trainer import train_flags

    planning = PlanningConfig(
        min_peers=cfg.volunteers, seed=cfg.seed, replicas=cfg.replicas, probe_links=False, codec_policy="fixed"
    )
    config = PeerConfig(
        num_stages=cfg.stages, threads=1, compute_layers_per_s=COMPUTE_LAYERS_PER_S, planning=planning,
        leave_timeout_s=0.0,  # a setting's end stops its volunteers at once (no hand-over to wait for)
        optim=OptimConfig(total_steps=cfg.steps, warmup_steps=warmup_steps(cfg.steps)),
    )  # fmt: skip
    peer = [*peer_flags().to_argv(config), *setup.peer_flags]
    flags = train_flags()
    train = replace(
        flags.base, num_stages=cfg.stages, steps=cfg.steps, seed=cfg.seed, setting=setting,
        train_samples=cfg.train_samples, batch_size=cfg.batch_size, micro_batches=cfg.micro_batches, deadline_s=30.0,
        wait_timeout_s=180.0, replan_timeout_s=60.0, chain_weights="equal",
    )  # fmt: skip
    return peer, [*flags.to_argv(train), *setup.trainer_flags]


def verify_off_flags(cfg: AttacksConfig) -> list[str] | None:
    """The swarm train flags that turn verification off (None: not measured)."""
    if cfg.no_verify_flags == "none":
        return None
    return list(VERIFY_OFF_FLAGS) if cfg.no_verify_flags == "auto" else cfg.no_verify_flags.split()


class Observer(threading.Thread):
    """Reads the run as anyone can, every `every_s`: the plan, bans, announcements, and the trainer's step count
    (its steps.jsonl lines), to `path` (one `Observation` a line) and `self.seen`."""

    def __init__(self, dht, n_layers: int, trainer_dir: Path, path: Path, every_s: float = 0.5):
        super().__init__(name="attacks-observer", daemon=True)
        self.dht, self.n_layers, self.trainer_dir, self.path, self.every_s = dht, n_layers, trainer_dir, path, every_s
        self.stop = threading.Event()
        self.seen: list[Observation] = []
        self.steps = 0

    def step_count(self) -> int:
        """Steps the trainer completed: the lines it writes while it runs, or its steps.csv once it has closed them
        (at its exit `swarm.train.steplog` writes the CSV, then removes the lines: read whichever is there)."""
        self.steps = max(self.steps, len(read_steps(self.trainer_dir)))
        return self.steps

    def observe(self) -> Observation:
        peers = self.dht.peers()
        record = self.dht.get_plan(self.n_layers, peers=peers, check_trainers=False)
        trainers = self.dht.trainers()
        doc = record.document if record is not None else None
        banned = set(getattr(doc, "banned", None) or ())
        for t in trainers:
            banned |= set(getattr(t, "banned", None) or ())
        return Observation(
            t=time.time(), step=self.step_count(), plan_version=record.version if record is not None else 0,
            stages=tuple(tuple(s.peer_ids) for s in doc.stages) if doc is not None else (),
            trainer_ids=tuple(doc.trainer_ids or ()) if doc is not None else (), banned=tuple(sorted(banned)),
            peers={p.peer_id: [p.stage, p.plan_version, p.reach, p.relay, p.planner_until] for p in peers},
        )  # fmt: skip

    def run(self) -> None:
        with open(self.path, "a") as f:
            while not self.stop.wait(self.every_s):
                try:
                    o = self.observe()
                except Exception:  # a slow DHT read: the next poll tells
                    continue
                self.seen.append(o)
                f.write(o.to_json() + "\n")
                f.flush()


def _dir_name(setting: str) -> str:
    return setting.replace(":", "_")


def run_setting(
    cfg: AttacksConfig, setting: str, out: Path, setup: RunSetup, liar: tuple[int, str] | None = None,
    extra_trainer_flags: tuple[str, ...] = (), keys=None, say=print,
) -> dict:  # fmt: skip
    """Runs one setting on a fresh local run; returns its raw result (exit, attack, observations, steps), with
    everything under out/<setting>: logs/, trainer/steps.csv, observations.jsonl, attack.json. `keys`: the
    stranger attacks' `KeyPool` (made once: grinding keys is their slow part)."""
    from swarm.experiments.adversaries import ATTACKS, AttackContext, KeyPool
    from swarm.model.gpt import ModelConfig
    from swarm.net.auth import Identity
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.dht_config import DHTConfig
    from swarm.testbed.churn_control import ChurnSwarm

    d = out / _dir_name(setting)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    peer_flags, trainer_flags = swarm_flags(cfg, setup, setting)
    trainer_flags += list(extra_trainer_flags)
    kind = "clean" if setting.startswith("clean") else "liar" if setting.startswith("liar-") else "stranger"
    kind = "control" if setting in CONTROL_SETTINGS else kind
    lie = setting.removeprefix("liar-") if kind == "liar" else None

    def wrap(name: str, argv: list[str]) -> list[str]:  # the liar runs the modified volunteer
        if lie is None or liar is None or name != f"peer{liar[0]}":
            return argv
        at = argv.index("swarm.daemon.peer")
        return [*argv[:at], "swarm.experiments.liar_peer", "--lie", lie, *argv[at + 1 :]]

    identities = cfg.identities or out / "identities"
    trainer_id = Identity.load(str(setup.trainer_key)).peer_id
    result: dict = {"setting": setting, "kind": kind, "rc": None, "stalled": False, "facts": {}, "attackers": [],
                    "attack_step": 0, "attack_t": 0.0}  # fmt: skip
    if kind == "liar" and liar is not None:
        result["attackers"] = [liar[1]]
    observer = attack = dht = None
    with ChurnSwarm(d, peer_flags, trainer_flags, wrap, observe=lambda: {}, identities=identities) as swarm:
        try:
            swarm.start(cfg.volunteers)
            initial = [line for line in swarm.address_file.read_text().splitlines() if line.strip()]
            dht = SwarmDHT(DHTConfig(initial_peers=tuple(initial), client_mode=True, run=setup.run))
            trainer = swarm.start_trainer(d / "trainer")
            observer = Observer(dht, ModelConfig().n_layers, d / "trainer", d / "observations.jsonl")
            observer.start()
            say(f"{setting}: {cfg.volunteers} volunteers ({cfg.standbys} on standby) and a trainer starting")
            started = time.monotonic()
            deadline = started + cfg.setting_timeout_s + 120.0  # + the wait for the first plan
            if kind == "stranger":
                while observer.step_count() < cfg.attack_at_step and trainer.poll() is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the trainer completed no {cfg.attack_at_step} steps in time")
                    time.sleep(0.2)  # polling the trainer's step lines, bounded by the deadline
                ctx = AttackContext(
                    initial, dht, keys or KeyPool(), ModelConfig().n_layers, trainer_id, str(setup.trainer_key),
                    kill_planner=lambda: _kill_planner(swarm, dht), start_peer=lambda flags: _start_peer(swarm, flags),
                    options={"sybils": cfg.sybils, "trainers": cfg.stranger_trainers, "streams": cfg.held_streams},
                    run_name=setup.run_name,
                )  # fmt: skip
                result["attack_step"], result["attack_t"] = observer.step_count(), time.time()
                say(f"{setting}: attacking after step {result['attack_step']}")
                try:
                    attack = ATTACKS[setting](ctx)
                    result["facts"], result["attackers"] = attack.facts, attack.attacker_ids
                except Exception as e:  # the attacker's own failure: its row says not tried, the run goes on
                    result["facts"] = {"error": f"{type(e).__name__}: {e}"}
                    say(f"{setting}: the attack failed: {result['facts']['error']}")
            if kind == "control" and liar is not None:
                _kill_at_step(swarm, observer, trainer, f"peer{liar[0]}", cfg.churn_at_step, deadline)
                result["attackers"], result["attack_step"] = [liar[1]], observer.step_count()
                result["attack_t"] = time.time()
                say(f"{setting}: killed peer{liar[0]} after step {result['attack_step']}")
            patience = Patience(cfg.steps, cfg.stall_s, deadline, started + HARD_FACTOR * (deadline - started))
            result["rc"], result["stalled"] = _wait_trainer(trainer, observer, patience, say)
            result["replicas"] = replica_digests(dht, ModelConfig().n_layers)
        except Exception as e:  # a failed setting still leaves its files for the row
            say(f"{setting}: {type(e).__name__}: {e}")
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            if observer is not None:  # first: nothing after the attack's end is judged as its effect
                observer.stop.set()
                observer.join(10)
            if dht is not None:
                dht.shutdown()
            if attack is not None:
                attack.stop()
            result["pids"] = {name: proc.pid for name, proc in swarm.procs.procs.items()}
    if kind == "liar" and liar is not None:  # did the liar's stage give its lie something to change?
        log = d / "logs" / f"peer{liar[0]}.log"
        result["facts"]["lied"] = log.exists() and "this peer lies:" in log.read_text(errors="replace")
    (d / "attack.json").write_text(json.dumps(result, indent=1, default=str))
    say(f"{setting}: trainer exit {result['rc']}{' (stalled: stopped)' if result['stalled'] else ''}")
    return result


def _wait_trainer(trainer: subprocess.Popen, observer: Observer, patience: Patience, say=print):
    """The trainer's exit code, and whether it was stopped (`Patience`: a stall or a deadline scaled to its pace)."""
    while trainer.poll() is None:
        now = time.monotonic()
        patience.observe(observer.step_count(), now)
        if (why := patience.stop(now)) is not None:
            say(f"stopping the trainer: {why}")
            trainer.terminate()
            try:
                trainer.wait(5)  # a trainer waiting for a plan finishes no step to stop after
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait(10)
            return trainer.returncode, True
        time.sleep(0.5)  # polling the trainer's progress, bounded by the stall and the deadline
    return trainer.returncode, False


def replica_digests(dht, n_layers: int) -> dict[str, list]:
    """Every replica of the plan the run ends on, as its Status says once the trainer is done: peer id ->
    [stage, last applied step, SHA-256 of its weights] (the stage's replicas must hold the same bits, a standby
    that took an evicted liar's place too). A replica that does not answer is left out."""
    from swarm.runtime.driver import PipelineDriver

    found: dict[str, list] = {}
    try:
        record = dht.get_plan(n_layers, check_trainers=False)
        addresses = {p.peer_id: p.address for p in dht.peers()}
    except TimeoutError:
        return found
    for s, stage in enumerate(record.document.stages if record is not None else ()):
        for peer in stage.peer_ids:
            if peer not in addresses:
                continue
            reader = PipelineDriver([addresses[peer]], [peer])
            try:
                reply = reader.status()[0]
                found[peer] = [s, int(reply.last_step), reply.weights_digest]
            except Exception:  # noqa: BLE001 - a replica gone by now: nothing to compare
                continue
            finally:
                reader.close()
    return found


def _kill_at_step(swarm, observer: Observer, trainer, name: str, step: int, deadline: float) -> None:
    """SIGKILLs volunteer `name` once the trainer has completed `step` steps."""
    while observer.step_count() < step and trainer.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer completed no {step} steps in time")
        time.sleep(0.2)  # polling the trainer's step lines, bounded by the deadline
    swarm.leave(swarm.peers[name], "kill")


PLANNER_WAIT_S = 30.0
"""How long the Sybil attack looks for a planner lease holder to kill: on a loaded machine the 3 s lease is
often lapsed at any one look (the fifth pass's full run found none at its one look, and the row was not tried)."""


def _kill_planner(swarm, dht, wait_s: float = PLANNER_WAIT_S, now=None) -> str | None:
    """SIGKILLs the peer holding the planner lease, looking again every 0.5 s for up to `wait_s`; returns its id
    (None: no holder found)."""
    if now is None:
        from hivemind.utils import get_dht_time as now
    deadline = time.monotonic() + wait_s
    while True:
        holders = sorted(p.peer_id for p in dht.peers() if p.planner_until > now())
        by_id = {p.peer_id: p for p in swarm.live_peers()}
        for pid in holders:
            if pid in by_id:
                swarm.leave(by_id[pid], "kill")
                return pid
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)  # the DHT's poll interval: the lease is renewed every lease_s/3


def _start_peer(swarm, flags: list[str]) -> str:
    """One more honest volunteer, with `flags` beside every peer's; returns its id."""
    base = swarm.peer_flags
    swarm.peer_flags = [*base, *flags]
    try:
        return swarm.start_peer().peer_id
    finally:
        swarm.peer_flags = base


def liar_choice(observations: list[Observation], stages: int, names: dict[str, str]) -> tuple[int, str] | None:
    """The volunteer a liar replaces: one the clean run's last plan put at the middle stage (stage 0 with two),
    not the planner where another serves there; (peer index, peer id)."""
    plans = [o for o in observations if o.stages]
    if not plans:
        return None
    last = plans[-1]
    middle = last.stages[min(stages // 2, len(last.stages) - 1) if stages > 2 else 0]
    planner = [p for p, a in last.peers.items() if a[4] and a[4] > last.t]
    pick = sorted(middle, key=lambda p: (p in planner, p))
    for pid in pick:
        if pid in names:
            return int(names[pid].removeprefix("peer")), pid
    return None


def _peer_names(identities: Path, n: int) -> dict[str, str]:
    from swarm.net.auth import Identity

    return {Identity.load(str(identities / f"peer{i}.der")).peer_id: f"peer{i}" for i in range(n)}


def run(args: argparse.Namespace) -> int:
    from swarm.experiments.adversaries import KeyPool

    flags = _FLAGS.from_args(args)
    try:
        cfg = flags.config()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    say = lambda line: print(line, file=sys.stderr)  # stderr: --json stays clean
    out = cfg.out or Path(f"runs/attacks-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    identities = cfg.identities or out / "identities"
    started = time.monotonic()
    setup = _start_run(cfg, identities)
    notes = [setup.note]
    keys = KeyPool()
    strangers = [s for s in cfg.chosen() if s in STRANGER_SETTINGS]
    if strangers:  # grinding runs beside the clean setting
        threading.Thread(target=keys.make, args=(8 + cfg.sybils + cfg.stranger_trainers,), daemon=True).start()
    results = {"clean": run_setting(cfg, "clean", out, setup, say=say)}
    no_verify = verify_off_flags(cfg)
    if no_verify is not None:
        results["clean-no-verify"] = run_setting(
            cfg, "clean-no-verify", out, setup, extra_trainer_flags=tuple(no_verify), say=say
        )
    else:
        notes.append("verification off not measured (--no-verify-flags none): its cost is not measured")
    names = _peer_names(identities, cfg.volunteers)
    liar = liar_choice(read_observations(out / "clean" / "observations.jsonl"), cfg.stages, names)
    if any(s in LIAR_SETTINGS for s in cfg.chosen()):
        notes.append(f"liar: {names.get(liar[1]) if liar else None} ({liar[1] if liar else 'none found'}), at the "
                     "middle stage of the clean run's plan")  # fmt: skip
    for setting in cfg.chosen()[1:]:
        if setting in (*LIAR_SETTINGS, *CONTROL_SETTINGS) and liar is None:
            notes.append(f"{setting}: not run (the clean run had no plan to place a liar in)")
            continue
        results[setting] = run_setting(cfg, setting, out, setup, liar=liar, keys=keys, say=say)
    rows, curves = collect(cfg, out, results, setup.owned)
    checks = targets(rows)
    plots = save_plots(out, curves, {r["setting"]: r["kind"] for r in rows})
    config = {"volunteers": f"{cfg.stages} stages x {cfg.replicas} replicas", "steps": cfg.steps,
              "stranger attacks start after step": cfg.attack_at_step, "seed": cfg.seed, "run": setup.note,
              "verification off": " ".join(no_verify) if no_verify else "no switch"}  # fmt: skip
    (out / "report.md").write_text(report_markdown(rows, checks, config, [p.name for p in plots], notes))
    (out / "results.json").write_text(json.dumps({"rows": rows, "targets": [asdict(c) for c in checks]}, indent=1))
    say(f"done in {time.monotonic() - started:.0f} s; wrote {out}/report.md")
    if flags.json:
        keys = lambda r: [  # noqa: E731
            *ROW_KEYS, *(CLEAN_KEYS if r["setting"] == "clean" else ()), *LOSS_KEYS, *SHAPE_KEYS, "owned_run"
        ]  # fmt: skip
        print(json.dumps([{k: r.get(k) for k in keys(r)} for r in rows], indent=1))
    else:
        for c in checks:
            print(f"{c.verdict:13} {c.name}: {c.value}")
    return 0


def collect(cfg: AttacksConfig, out: Path, results: dict[str, dict], owned: bool) -> tuple[list[dict], dict]:
    """The rows of the settings run (`results`: `run_setting`'s), and each setting's step rows for the plots."""
    rows, curves = [], {}
    for name, r in results.items():
        if name == "clean-no-verify":
            continue
        d = out / _dir_name(name)
        steps = read_steps(d / "trainer")
        obs = read_observations(d / "observations.jsonl")
        setting = Setting(
            name, r["kind"], tuple(r["attackers"]), r["attack_step"], r["attack_t"], r["facts"], r.get("error")
        )
        row = judge(setting, steps, obs, None if r["stalled"] else r["rc"], cfg.steps, r.get("replicas"))
        if name == "clean":
            nv = results.get("clean-no-verify")
            nv_steps = read_steps(out / "clean-no-verify" / "trainer") if nv is not None else None
            row = clean_row(row, obs, steps, nv_steps, cfg.batch_size)
        row["owned_run"] = owned
        rows.append(row)
        curves[name] = steps
    return rows, curves
