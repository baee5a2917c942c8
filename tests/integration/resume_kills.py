"""Kills a trainer at every point of a step, again and again, and checks that the run it resumes is the run that
never stopped: every stage applied every step exactly once, the weights are bit for bit an uninterrupted run's,
and steps.csv holds each step once with the same losses.

The stages are loopback gRPC servers in this process (they outlive the trainer, as peers do); each trainer life
is a process (`tests.integration.resume_trainer`) that SIGKILLs itself at a hook. `python -m
tests.integration.resume_kills --kills 20` runs the long form and prints one line per life and the tally.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from swarm.compression import CodecConfig
from swarm.net.auth import CallSigner
from swarm.peers.routes import PlanRoutes
from swarm.train.trainer import TrainConfig, train
from tests.integration.swarm_fixtures import TINY, loopback_stages, trainer_of

POINTS = (
    "mid-forward", "mid-step", "commit", "save-begin", "save-commit", "mid-apply", "after-step", "after-row",
)  # fmt: skip
"""every precise kill point of `resume_trainer` (one per phase of a step and of its journal writes)"""
FP32 = CodecConfig("fp32")
LIFE_TIMEOUT_S = 90.0
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """What a run of kills saw; `ok` when every check held."""

    kills: list[str] = field(default_factory=list)
    """each life's kill, as passed (`point:step`, `random+seconds:step`), for the lives that were killed"""
    lives: int = 0
    settled: list[str] = field(default_factory=list)
    """how each resumed life found the step its last life left: "finished" (committed) or "abandoned" (open)"""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def config(steps: int) -> dict:
    model = {k: getattr(TINY, k) for k in ("vocab_size", "seq_len_tokens", "hidden_dim", "n_layers", "n_heads")}
    return dict(model=model, train_samples=16, batch_size=4, micro_batches=2, steps=steps, schedule="1f1b",
                resume=True, checkpoint_every=5)  # fmt: skip


def train_config(cfg: dict, out: Path) -> TrainConfig:
    return TrainConfig(**{**cfg, "model": type(TINY)(**cfg["model"])}, out=str(out))


def reference(cfg: dict, out: Path) -> tuple[list[dict], list[float]]:
    """The uninterrupted run: each stage's weights at the end, and the losses of steps.csv."""
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        peers, trainer = trainer_of(addresses)
        summary = train(train_config(cfg, out), PlanRoutes(addresses, peers), quiet=True, signer=CallSigner(trainer))
        weights = [{k: v.clone() for k, v in h.worker.module.state_dict().items()} for h in hosts]
    return weights, losses_of(Path(summary.csv))


def losses_of(path: Path) -> list[float]:
    with open(path) as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f)]


def next_step(out: Path) -> int:
    """The step a resume of `out` reaches first (its journal's open step, else its position)."""
    try:
        state = json.loads((out / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return 0
    return state["open"] if state.get("open") is not None else state["step"]


def run_with_kills(tmp: Path, n_kills: int, seed: int = 0, log=lambda line: None) -> Outcome:
    """One run of `config(...)` steps whose trainer is SIGKILLed `n_kills` times: the precise points in turn,
    every fourth kill at a random time; then the checks against `reference`."""
    rng = random.Random(seed)
    steps = 3 * n_kills + 4  # a random kill may fire a step or two late: room for every kill before the end
    cfg = config(steps)
    began = time.perf_counter()
    want_weights, want_losses = reference(cfg, tmp / "reference")
    spec_step_s = (time.perf_counter() - began) / steps  # an upper bound (the run's start counted in)
    outcome, out = Outcome(), tmp / "killed"
    applied: dict[int, list[int]] = {0: [], 1: []}

    def record(host) -> None:
        applied[host.role.stage].append(host.ledger.last_step)

    with loopback_stages(2, FP32, FP32, on_step=record) as (hosts, _, addresses):
        peers, trainer = trainer_of(addresses)
        key = tmp / "trainer.key"
        key.write_bytes(trainer.key.to_bytes())
        spec = {"addresses": addresses, "peers": peers, "key": str(key), "out": str(out), "config": cfg,
                "step_s": min(0.5, spec_step_s)}  # fmt: skip
        lives = Lives(tmp)
        try:
            outcome = _kill_and_resume(lives, spec, n_kills, rng, outcome, log)
        finally:
            lives.close()
        if outcome.problems:
            return outcome
        for stage, steps_applied in applied.items():
            if steps_applied != list(range(steps)):
                outcome.problems.append(f"stage {stage} applied steps {steps_applied}, not 0..{steps - 1} once each")
        for stage, (host, want) in enumerate(zip(hosts, want_weights, strict=True)):
            for name, value in host.worker.module.state_dict().items():
                if not torch.equal(value, want[name]):
                    outcome.problems.append(f"stage {stage}: {name} differs from the uninterrupted run's")
                    break
    got = losses_of(out / "steps.csv")
    with open(out / "steps.csv") as f:
        numbers = [int(r["step"]) for r in csv.DictReader(f)]
    if numbers != list(range(1, steps + 1)):
        outcome.problems.append(f"steps.csv numbers its rows {numbers}, not 1..{steps} once each")
    elif got != want_losses:
        outcome.problems.append(f"steps.csv losses {got} differ from the uninterrupted run's {want_losses}")
    return outcome


def _kill_and_resume(lives: Lives, spec: dict, n_kills: int, rng: random.Random, outcome: Outcome, log) -> Outcome:
    """Lives until the run ends: each killed at the next point (the precise ones in turn, every fourth at a
    random time) until `n_kills` kills, then one to the end."""
    out = Path(spec["out"])
    while True:
        kill = None
        if len(outcome.kills) < n_kills:
            if len(outcome.kills) % 4 == 3:
                # within about a step of its start (a fixed 0.5 s let a fast machine run 10 steps past it and
                # the run end before the last kills)
                kill = f"random+{rng.uniform(0.0, spec['step_s']):.3f}:{next_step(out) + 1}"
            else:
                precise = len(outcome.kills) - len(outcome.kills) // 4  # the points in turn, between randoms
                kill = f"{POINTS[precise % len(POINTS)]}:{next_step(out) + 1}"
        began = time.perf_counter()
        rc, tail = lives.run(spec, kill)
        outcome.lives += 1
        took = time.perf_counter() - began
        log(f"life {outcome.lives}: kill {kill or '-'} -> rc {rc} after {took:.1f} s; next step {next_step(out)}")
        outcome.settled += ["finished" for _ in re.finditer("committed before the stop", tail)]
        outcome.settled += ["abandoned" for _ in re.finditer("was open on the stages", tail)]
        if rc == -9:
            outcome.kills.append(kill)
            continue
        if rc != 0:
            outcome.problems.append(f"life {outcome.lives} (kill {kill}) exited {rc}: {tail[-3000:]}")
        elif len(outcome.kills) < n_kills:  # the run ended before a kill fired
            outcome.problems.append(f"the run ended after {len(outcome.kills)} of {n_kills} kills ({kill})")
        return outcome


class Lives:
    """A forking server of trainer lives (`resume_trainer --serve`): every life starts with the imports done."""

    def __init__(self, log_dir: Path):
        argv = [sys.executable, "-m", "tests.integration.resume_trainer", "--serve"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log_dir, self.count = log_dir, 0
        self._stderr = open(log_dir / "lives.log", "w")  # noqa: SIM115 - the server's, closed in close()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True)  # fmt: skip

    def _line(self, timeout_s: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline().strip() if ready else None

    def run(self, spec: dict, kill: str | None) -> tuple[int | str, str]:
        """One life, to its end or its kill (SIGKILLed after `LIFE_TIMEOUT_S`); (exit code, its output)."""
        log_path = self.log_dir / f"life{self.count}.log"
        self.count += 1
        self.proc.stdin.write(json.dumps({"spec": spec, "kill": kill, "log": str(log_path)}) + "\n")
        self.proc.stdin.flush()
        started = self._line(LIFE_TIMEOUT_S)
        if started is None or not started.startswith("pid "):
            return f"no life started ({started!r})", ""
        pid, rc = int(started.split()[1]), "timeout"
        ended = self._line(LIFE_TIMEOUT_S)
        if ended is None:
            os.kill(pid, signal.SIGKILL)
            self._line(10)
        else:
            rc = int(ended.split()[1])
        return rc, log_path.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of the trainer in the run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill times")
    parser.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
    args = parser.parse_args()
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        outcome = run_with_kills(Path(tmp), args.kills, args.seed, log=lambda line: print(line, file=sys.stderr))
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({**asdict(outcome), "ok": outcome.ok, "seconds": round(seconds, 1)}))
    else:
        resumed = len(outcome.kills) if outcome.ok else "?"
        print(f"{len(outcome.kills)} kills, {resumed} resumed with every step applied once on every stage, "
              f"weights and losses equal to the uninterrupted run: {'ok' if outcome.ok else 'FAILED'} "
              f"({seconds:.0f} s)")  # fmt: skip
        for problem in outcome.problems:
            print(f"  {problem}")
    sys.exit(0 if outcome.ok else 1)


if __name__ == "__main__":
    main()
