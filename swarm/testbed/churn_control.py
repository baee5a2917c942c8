"""Churn on a local swarm: a seeded schedule of kills, graceful leaves and joins, and the processes it acts on.

The schedule is data (`ChurnEvent`s made by `churn_schedule` or `churn_schedule_steps` from a seed), so a run
can be replayed and the schedule unit-tested without processes. A schedule in steps (`at_step`) is played
against the trainer's completed steps, so a machine half as fast sees the same kills at the same steps; a
schedule in seconds does not (on a slower machine it kills more often per step).
`ChurnSwarm` starts a bootstrap node, swarm-peer daemons (each with
an identity file written first, so its peer id is known before it starts) and a `swarm train` process, all
in one `ProcessGroup` (reaped when the `with` block ends); `ChurnController` plays a schedule against it
from a thread and writes every kill, term and join to `events.jsonl`. `StepClock` timestamps the trainer's
completed steps by scraping its `swarm_steps_total` metric, for trainers whose steps.csv has no time column.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from swarm.testbed.procs import ProcessGroup, peer_command, swarm_command

__all__ = [
    "ChurnController",
    "ChurnEvent",
    "ChurnSwarm",
    "StepClock",
    "churn_schedule",
    "churn_schedule_steps",
    "last_step",
    "peer_flag_support",
]

LEAVES = ("kill", "term")


@dataclass(frozen=True)
class ChurnEvent:
    """One churn event, `at_s` seconds after the schedule starts (e.g. `kill@60.0#0.42`), or, with `at_step`,
    `at_s` seconds after the trainer completed that step (e.g. `join@step150+2.0`)."""

    at_s: float
    """Seconds after the start of the schedule (with `at_step`: after that step completed)."""
    kind: str
    """kill (SIGKILL), term (SIGTERM: a graceful leave) or join (a fresh peer)."""
    pick: float = 0.0
    """Which eligible peer a leave takes, in [0, 1): index floor(pick * n) of the serving peers by name, so
    the choice is seeded but made among the peers alive when the action runs."""
    at_step: int | None = None
    """The trainer's completed step the event waits for (None: a schedule in seconds)."""

    def __post_init__(self) -> None:
        if self.kind not in (*LEAVES, "join"):
            raise ValueError(f"ChurnEvent.kind: expected kill, term or join, got {self.kind!r}")
        if not 0.0 <= self.pick < 1.0 or self.at_s < 0:
            raise ValueError(f"ChurnEvent: at_s must be >= 0 and pick in [0, 1), got {self.at_s}, {self.pick}")
        if self.at_step is not None and self.at_step < 1:
            raise ValueError(f"ChurnEvent: at_step must be >= 1, got {self.at_step}")

    def __str__(self) -> str:
        if self.at_step is not None:
            return f"{self.kind}@step{self.at_step}+{self.at_s:.1f}#{self.pick:.2f}"
        return f"{self.kind}@{self.at_s:.1f}#{self.pick:.2f}"


def churn_schedule(
    duration_s: float,
    seed: int,
    kill_every_s: float | None = None,
    mean_lifetime_s: float | None = None,
    serving_peers: int = 6,
    graceful_fraction: float = 0.0,
    join_delay_s: float = 2.0,
) -> list[ChurnEvent]:
    """The leaves and joins of one run, sorted by time.

    Leaves come every `kill_every_s` seconds (the first one then too), or, with `mean_lifetime_s` instead,
    as the first departures of `serving_peers` peers whose lifetimes are exponential with that mean (a
    Poisson process of rate serving_peers / mean_lifetime_s). Each leave is a SIGTERM with probability
    `graceful_fraction` (else a SIGKILL) and is followed `join_delay_s` later by a join, so the swarm keeps
    its size. Same arguments, same schedule.
    """
    if (kill_every_s is None) == (mean_lifetime_s is None):
        raise ValueError("churn_schedule: give exactly one of kill_every_s and mean_lifetime_s")
    if not 0.0 <= graceful_fraction <= 1.0:
        raise ValueError(f"churn_schedule: graceful_fraction must be in [0, 1], got {graceful_fraction}")
    if (kill_every_s or mean_lifetime_s or 0) <= 0 or serving_peers < 1 or join_delay_s < 0:
        raise ValueError("churn_schedule: intervals must be > 0, serving_peers >= 1, join_delay_s >= 0")
    rng = random.Random(seed)
    actions, t = [], 0.0
    while True:
        t += kill_every_s if kill_every_s is not None else rng.expovariate(serving_peers / mean_lifetime_s)
        if t > duration_s:
            break
        kind = "term" if rng.random() < graceful_fraction else "kill"
        actions.append(ChurnEvent(round(t, 3), kind, rng.random()))
        actions.append(ChurnEvent(round(t + join_delay_s, 3), "join"))
    return sorted(actions, key=lambda a: (a.at_s, a.kind == "join"))


def churn_schedule_steps(
    total_steps: int,
    seed: int,
    kill_every_steps: int | None = None,
    mean_lifetime_steps: float | None = None,
    serving_peers: int = 6,
    graceful_fraction: float = 0.0,
    join_delay_s: float = 2.0,
) -> list[ChurnEvent]:
    """`churn_schedule` in training steps: leaves at steps every `kill_every_steps` (or, with
    `mean_lifetime_steps`, the first departures of `serving_peers` exponential lifetimes of that mean, in
    steps, each at least one step after the previous leave), only before the last step; each followed
    `join_delay_s` seconds later by a join. Same arguments, same schedule, on any machine."""
    if (kill_every_steps is None) == (mean_lifetime_steps is None):
        raise ValueError("churn_schedule_steps: give exactly one of kill_every_steps and mean_lifetime_steps")
    if not 0.0 <= graceful_fraction <= 1.0:
        raise ValueError(f"churn_schedule_steps: graceful_fraction must be in [0, 1], got {graceful_fraction}")
    if (kill_every_steps or mean_lifetime_steps or 0) <= 0 or serving_peers < 1 or join_delay_s < 0:
        raise ValueError("churn_schedule_steps: intervals must be > 0, serving_peers >= 1, join_delay_s >= 0")
    rng = random.Random(seed)
    actions, step, t = [], 0, 0.0
    while True:
        if kill_every_steps is not None:
            step += kill_every_steps
        else:
            t += rng.expovariate(serving_peers / mean_lifetime_steps)
            step = max(step + 1, round(t))
        if step >= total_steps:
            break
        kind = "term" if rng.random() < graceful_fraction else "kill"
        actions.append(ChurnEvent(0.0, kind, rng.random(), at_step=step))
        actions.append(ChurnEvent(join_delay_s, "join", at_step=step))
    return actions


def last_step(clock_path: Path) -> tuple[int, float] | None:
    """(steps, time) of a `StepClock` file's last line: the trainer's completed steps and when the clock saw
    them; None before the first step (or if the file is unreadable)."""
    try:
        with open(clock_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
            return int(row["steps"]), float(row["t"])
        except (ValueError, KeyError, TypeError):
            continue  # a line being written, or the cut first line of the tail
    return None


def peer_flag_support(flags: tuple[str, ...]) -> dict[str, bool]:
    """Which of `flags` this checkout's swarm-peer has (its --help), so the experiment passes --replicas etc.
    only to a peer that knows them."""
    text = subprocess.run(peer_command("--help"), capture_output=True, text=True, timeout=120).stdout
    return {flag: re.search(rf"(^|\s){re.escape(flag)}[\s=,]", text) is not None for flag in flags}


@dataclass
class PeerProc:
    name: str
    peer_id: str
    proc: subprocess.Popen
    left: str | None = None
    """kill or term once the schedule made it leave."""


class ChurnSwarm:
    """Bootstrap, peers and a trainer as local processes; peers can be killed and started while it runs.

    Args:
        out: folder of this run (logs/, identities/, checkpoints/, the trainer's steps.csv under trainer/).
        peer_flags: flags of every swarm-peer (codecs, stages, replicas...).
        trainer_flags: flags of `swarm train` after the DHT and output flags.
        wrap: rewrites a process's argv by its name (e.g. `ip netns exec NS ... --host ADDR`); None: as is.
        observe: peer id -> stage (None: standby) as the DHT shows them; None: a client DHT node in this
            process, started with the swarm.
        identities: where peers' key files live (default out/identities); runs that share it give their n-th
            peers the same ids, so they elect the same planner, plan alike and put samples on the same routes.
    """

    def __init__(
        self,
        out: Path,
        peer_flags: list[str],
        trainer_flags: list[str],
        wrap: Callable[[str, list[str]], list[str]] | None = None,
        observe: Callable[[], dict[str, int | None]] | None = None,
        identities: Path | None = None,
    ):
        self.out, self.peer_flags, self.trainer_flags = out, peer_flags, trainer_flags
        self.identities = identities or out / "identities"
        self.wrap = wrap or (lambda _name, argv: argv)
        self.observe = observe
        self.procs = ProcessGroup(out / "logs")
        self.address_file = out / "bootstrap.addr"
        self.peers: dict[str, PeerProc] = {}
        self.trainer: subprocess.Popen | None = None
        self._dht = None
        self._lock = threading.Lock()

    def __enter__(self) -> ChurnSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, n_peers: int, timeout_s: float = 60.0) -> None:
        """The bootstrap node, then `n_peers` peers; returns once the bootstrap's address is written."""
        self.address_file.unlink(missing_ok=True)
        from swarm.daemon.bootstrap import BootstrapConfig, bootstrap_flags

        boot = bootstrap_flags().to_argv(BootstrapConfig(address_file=str(self.address_file)))
        self.procs.start("bootstrap", self.wrap("bootstrap", swarm_command("bootstrap", *boot)))
        self.procs.wait_for_file(self.address_file, timeout_s)
        if self.observe is None:
            self._open_dht()  # here, in the caller's thread: hivemind's DHT does not start from the churn thread
        for _ in range(n_peers):
            self.start_peer()

    def start_peer(self) -> PeerProc:
        """A fresh peer (new name, new identity) joining through the bootstrap node."""
        from swarm.daemon.peer_config import PeerConfig, peer_flags
        from swarm.net.auth import Identity
        from swarm.peers.dht_config import DHTConfig, load_or_create_key

        with self._lock:
            name = f"peer{len(self.peers)}"
            key_path = self.identities / f"{name}.der"
            key_path.parent.mkdir(parents=True, exist_ok=True)
            peer_id = Identity(load_or_create_key(str(key_path))).peer_id
            own = PeerConfig(
                address_file=str(self.address_file),
                dht=DHTConfig(signing_key_path=str(key_path)),
                checkpoint_dir=str(self.out / "checkpoints" / name),
            )
            argv = peer_command(*peer_flags().to_argv(own), *self.peer_flags)
            peer = PeerProc(name, peer_id, self.procs.start(name, self.wrap(name, argv)))
            self.peers[name] = peer
            return peer

    def start_trainer(self, out: Path) -> subprocess.Popen:
        from swarm.train.trainer import train_flags

        flags = train_flags()
        own = replace(flags.base, address_file=str(self.address_file), out=str(out), metrics_port=0)
        argv = swarm_command("train", *flags.to_argv(own), *self.trainer_flags)
        self.trainer = self.procs.start("trainer", self.wrap("trainer", argv))
        return self.trainer

    def trainer_metrics_url(self, timeout_s: float) -> str:
        """The trainer's metrics URL, from the line `swarm train` logs once it serves them."""
        deadline = time.monotonic() + timeout_s
        log = self.procs.log_dir / "trainer.log"
        while time.monotonic() < deadline:
            found = re.search(r"metrics at (http://\S+)", log.read_text(errors="replace")) if log.exists() else None
            if found:
                return found.group(1)
            if self.trainer is not None and self.trainer.poll() is not None:
                raise RuntimeError(f"the trainer exited ({self.trainer.returncode}):\n{self.procs.tail('trainer')}")
            time.sleep(0.2)  # polling a log file for a line, bounded by the deadline
        raise TimeoutError(f"the trainer served no metrics within {timeout_s:.0f} s")

    def live_peers(self) -> list[PeerProc]:
        with self._lock:
            return [p for p in self.peers.values() if p.left is None and p.proc.poll() is None]

    def leave(self, peer: PeerProc, kind: str) -> None:
        """SIGKILL (kind kill) or SIGTERM (term) to one peer. SIGKILL goes to its whole session, so its DHT
        helper dies with it, as it would with the machine; a SIGTERMed peer stops its helpers itself."""
        import os

        peer.left = kind
        try:
            if kind == "kill":
                os.killpg(peer.proc.pid, signal.SIGKILL)
            else:
                peer.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _open_dht(self) -> None:
        from swarm.peers.dht import SwarmDHT
        from swarm.peers.dht_config import DHTConfig

        initial = [line for line in self.address_file.read_text().splitlines() if line.strip()]
        self._dht = SwarmDHT(DHTConfig(initial_peers=tuple(initial), client_mode=True))

    def stages(self) -> dict[str, int | None]:
        """peer id -> the stage it announces (None: standby), as the DHT shows them now."""
        if self.observe is not None:
            return self.observe()
        if self._dht is None:
            return {}
        try:
            return {a.peer_id: a.stage for a in self._dht.peers()}
        except TimeoutError:
            return {}

    def start_clock(self, url: str, path: Path) -> None:
        """A step clock process beside the trainer (in its namespace, if any), writing `path`."""
        argv = [sys.executable, "-m", "swarm.testbed.churn_control", "clock", url, str(path)]
        self.procs.start("clock", self.wrap("clock", argv))

    def close(self) -> dict[str, int | None]:
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
        return self.procs.close()


class ChurnController(threading.Thread):
    """Plays a schedule against a ChurnSwarm from the moment `begin()` is called, logging to `events_path`.

    A leave picks among the live peers that the DHT shows serving a stage (never the bootstrap node or the
    trainer, which are not peers); with none serving it is logged as `skip`. Each event records the time,
    peer, pid, stage and how many other live peers serve that stage (`replicas_left`: 0 means recovery
    needs a standby and a checkpoint).
    """

    def __init__(
        self,
        swarm: ChurnSwarm,
        schedule: list[ChurnEvent],
        events_path: Path,
        steps: Callable[[], int | None] | None = None,
        poll_s: float = 0.2,
        end_after: int | None = None,
    ):
        """`steps()`: the trainer's completed steps (None: none yet), what events with `at_step` wait for.
        `end_after`: once the schedule is played and the trainer has completed this many more steps, the trainer is
        asked to stop after its current step (SIGTERM, which `swarm train` takes as Ctrl-C: the step in flight
        completes, the run exits 0) and an `end` event names the step it was asked at (None: it trains on)."""
        super().__init__(name="churn", daemon=True)
        self.swarm, self.schedule, self.events_path = swarm, schedule, events_path
        self.steps, self.poll_s, self.end_after = steps, poll_s, end_after
        self.stop = threading.Event()
        self.events: list[dict] = []
        self._start_at: float | None = None
        self._begun = threading.Event()
        self._reached: dict[int, float] = {}
        """at_step -> when this controller first saw the trainer past it"""

    def begin(self) -> None:
        self._start_at = time.time()
        self._begun.set()

    def run(self) -> None:
        self._begun.wait()
        with open(self.events_path, "a") as log:
            for action in self.schedule:
                if not self._wait_until_due(action):
                    return  # the run ended first
                try:
                    event = self.apply(action)
                except Exception as e:  # one failed action must not end the schedule; the log says what failed
                    event = {
                        "t": time.time(),
                        "kind": "error",
                        "action": str(action),
                        "why": f"{type(e).__name__}: {e}",
                    }
                self._log(log, event)
            if self.end_after is not None and self.schedule:
                event = self._end()
                if event is not None:
                    self._log(log, event)

    def _log(self, log, event: dict) -> None:
        self.events.append(event)
        log.write(json.dumps(event) + "\n")
        log.flush()

    def _end(self) -> dict | None:
        """Waits for `end_after` more completed steps, then asks the trainer to stop; the `end` event (None: the
        run ended first)."""
        since = self.steps() or 0
        while (done := self.steps() or 0) < since + self.end_after:
            if self.stop.wait(self.poll_s):  # polling the step count, cut short when the run ends
                return None
        with contextlib.suppress(ProcessLookupError):
            self.swarm.trainer.send_signal(signal.SIGTERM)
        return {"t": time.time(), "kind": "end", "at_step": done}

    def _wait_until_due(self, action: ChurnEvent) -> bool:
        """Waits for the event's time (a timed wait on the schedule's clock) or step (polling the trainer's
        step count, then its delay); False when the run ended first."""
        if action.at_step is None:
            return not self.stop.wait(max(0.0, self._start_at + action.at_s - time.time()))
        if self.steps is None:
            raise ValueError(f"{action}: a schedule in steps needs the trainer's step count")
        while action.at_step not in self._reached:
            done = self.steps()
            if done is not None and done >= action.at_step:
                self._reached[action.at_step] = time.time()
            elif self.stop.wait(self.poll_s):  # polling the step count, cut short when the run ends
                return False
        return not self.stop.wait(max(0.0, self._reached[action.at_step] + action.at_s - time.time()))

    def apply(self, action: ChurnEvent) -> dict:
        now = time.time()
        if action.kind == "join":
            peer = self.swarm.start_peer()
            return {"t": now, "kind": "join", "peer": peer.name, "peer_id": peer.peer_id, "pid": peer.proc.pid,
                    "stage": None, "action": str(action)}  # fmt: skip
        stages = self.swarm.stages()
        live = self.swarm.live_peers()
        serving = [p for p in live if stages.get(p.peer_id) is not None]
        if not serving:
            return {"t": now, "kind": "skip", "peer": None, "peer_id": None, "pid": None, "stage": None,
                    "action": str(action), "why": "no live peer serves a stage"}  # fmt: skip
        victim = sorted(serving, key=lambda p: p.name)[math.floor(action.pick * len(serving))]
        stage = stages[victim.peer_id]
        left = sum(1 for p in serving if p is not victim and stages[p.peer_id] == stage)
        self.swarm.leave(victim, action.kind)
        return {"t": time.time(), "kind": action.kind, "peer": victim.name, "peer_id": victim.peer_id,
                "pid": victim.proc.pid, "stage": stage, "replicas_left": left, "action": str(action)}  # fmt: skip


class StepClock(threading.Thread):
    """Scrapes the trainer's `swarm_steps_total` every `every_s` and writes `{"t", "steps"}` lines to `path`
    whenever it grows: when each step completed, within `every_s`."""

    def __init__(self, url: str, path: Path, every_s: float = 0.25):
        super().__init__(name="step-clock", daemon=True)
        self.url, self.path, self.every_s = url, path, every_s
        self.stop = threading.Event()
        self.first_step = threading.Event()
        """Set once the trainer has completed a step."""

    def run(self) -> None:
        last = 0.0
        with open(self.path, "a") as f:
            while not self.stop.wait(self.every_s):
                try:
                    with urllib.request.urlopen(self.url, timeout=2) as reply:
                        text = reply.read(1 << 20).decode(errors="replace")
                except OSError:
                    continue  # the trainer is between steps or gone; the next scrape tells
                found = re.search(r"^swarm_steps_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.MULTILINE)
                if found and float(found.group(1)) > last:
                    last = float(found.group(1))
                    f.write(json.dumps({"t": time.time(), "steps": int(last)}) + "\n")
                    f.flush()
                    self.first_step.set()


def main(argv: list[str]) -> int:
    """`python -m swarm.testbed.churn_control clock URL PATH`: a step clock as its own process (run beside a trainer
    in a network namespace, where this process's network cannot reach it); stops on SIGTERM."""
    if len(argv) != 3 or argv[0] != "clock":
        print("usage: python -m swarm.testbed.churn_control clock URL PATH", file=sys.stderr)
        return 2
    clock = StepClock(argv[1], Path(argv[2]))
    signal.signal(signal.SIGTERM, lambda *_: clock.stop.set())
    clock.start()
    while clock.is_alive():
        clock.join(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
