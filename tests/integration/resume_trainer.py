"""A `swarm train` life for the kill-at-every-point resume test: trains on loopback stages (`--spec` JSON) and
SIGKILLs itself at one precise point (`--kill POINT:STEP`) or a time after the step began (`--kill
random+SECONDS:STEP`).

The points are hooks patched into this process only (nothing of it is in the package):
  mid-forward  a micro-batch of the step is in flight, another not started
  mid-step     every forward and backward ran, the Reduce not yet
  commit       the commit record is written, no Step sent
  save-begin   mid-write of the journal's begin record (a half-written temporary file)
  save-commit  mid-write of the journal's commit record
  mid-apply    the first stage applied the Step, the last one has not got it
  after-step   every stage applied it, its row not written
  after-row    its row written, the next step's begin record not
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import torch


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, at: str) -> None:
    from swarm.runtime import driver as driver_mod
    from swarm.train import journal as journal_mod
    from swarm.train import steplog

    step, delay = int(at), 0.0
    if point.startswith("random"):  # random+DELAY: DELAY seconds after the step's begin record, wherever that is
        point, delay = "random", float(point.split("+")[1])
    Driver = driver_mod.PipelineDriver
    if point == "random":
        begin = journal_mod.Journal.begin

        def begin_and_time(self, s):
            begin(self, s)
            if s == step:
                threading.Timer(delay, die).start()

        journal_mod.Journal.begin = begin_and_time
    elif point == "mid-forward":
        micro = Driver._micro_batch

        def _micro_batch(self, s, work, mb, *args, **kw):
            if s == step and mb == 1:
                die()
            return micro(self, s, work, mb, *args, **kw)

        Driver._micro_batch = _micro_batch
    elif point == "mid-step":
        reduce = Driver._reduce

        def _reduce(self, s, *args, **kw):
            if s == step:
                die()
            return reduce(self, s, *args, **kw)

        Driver._reduce = _reduce
    elif point == "commit":
        commit = journal_mod.Journal.commit

        def commit_then_die(self, c):
            commit(self, c)
            if c.step == step:
                die()

        journal_mod.Journal.commit = commit_then_die
    elif point in ("save-begin", "save-commit"):
        write = steplog.write_state

        def write_state(tmp, text, durable):
            state = json.loads(text)
            if state.get("open") == step and ("commit" in state) == (point == "save-commit"):
                with open(tmp, "w") as f:
                    f.write(text[: len(text) // 2])
                die()
            write(tmp, text, durable)

        steplog.write_state = write_state
    elif point == "mid-apply":
        call = Driver._call
        first_applied = threading.Event()

        def _call(self, stage, replica, method, request, timeout=None):
            if method == "Step" and not request.abandon and request.step == step:
                if stage == self.n_stages - 1:
                    first_applied.wait(10)
                    die()
                reply = call(self, stage, replica, method, request, timeout)
                first_applied.set()
                return reply
            return call(self, stage, replica, method, request, timeout)

        Driver._call = _call
    elif point in ("after-step", "after-row"):
        add = steplog.StepLog.add

        def add_and_die(self, row):
            if row["step"] == step + 1 and point == "after-step":
                die()
            add(self, row)
            if row["step"] == step + 1:
                die()

        steplog.StepLog.add = add_and_die
    else:
        raise SystemExit(f"--kill: unknown point {point!r}")


def life(spec: dict, kill: str | None) -> None:
    """One life of the trainer: train on the spec's stages, killed at `kill` (None: to the end)."""
    from swarm.model.gpt import ModelConfig
    from swarm.net.auth import CallSigner, Identity
    from swarm.peers.routes import PlanRoutes
    from swarm.train.trainer import TrainConfig, train

    if kill:
        point, at = kill.split(":")
        install(point, at)
    cfg = TrainConfig(**{**spec["config"], "model": ModelConfig(**spec["config"]["model"])}, out=spec["out"])
    signer = CallSigner(Identity.load(spec["key"]))
    summary = train(cfg, PlanRoutes(spec["addresses"], spec["peers"]), quiet=True, signer=signer, say=print)
    print(json.dumps({"steps": summary.steps}), flush=True)


def serve() -> None:
    """Forks one life per request line (JSON: spec, kill, log) from a process that imported everything once (a
    life then starts in milliseconds, not the seconds torch's import takes); prints `pid N` as a life starts and
    `rc N` (negative: killed by that signal) when it ends. Nothing here runs torch or opens a channel before the
    fork, so the lives start clean."""
    import importlib
    import traceback

    for name in (  # what `train` imports as it runs, and the last life's plot
        "matplotlib.pyplot", "tqdm", "swarm.daemon.nat", "swarm.model.data", "swarm.net.auth", "swarm.net.connect",
        "swarm.net.stream", "swarm.plots", "swarm.runtime.modelcheck", "swarm.runtime.suspects",
        "swarm.runtime.driver", "swarm.runtime.freeze", "swarm.train.trainer",
    ):  # fmt: skip
        importlib.import_module(name)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdin.close()
                life(request["spec"], request["kill"])
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"rc {os.waitstatus_to_exitcode(status)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", help="JSON: addresses, peers, key, out, config (one life)")
    parser.add_argument("--kill", default=None, help="POINT:STEP or random+SECONDS:STEP (none: run to the end)")
    parser.add_argument("--serve", action="store_true", help="fork a life per request line on stdin (see serve)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        serve()
    elif args.spec:
        life(json.loads(args.spec), args.kill)
    else:
        parser.error("--spec or --serve")


if __name__ == "__main__":
    main()
