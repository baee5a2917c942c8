"""`swarm testbed`: a swarm whose every process has its own network namespace, links shaped by the kernel.

`up` builds a bridge, one namespace per service (DHT bootstrap node, `--peers` swarm-peers, a trainer),
shapes each namespace's egress with tc, starts the services inside (logs in the run directory), waits
until every stage is announced in the DHT and, with `--train`, trains and prints the summary. The
testbed stays up until `down`, which stops every process and removes every namespace and link, also
after a crash of `up` itself (it sweeps everything named with the prefix). `compose` prints the docker
compose file running the same services, `shape` is the tc half of the container entrypoint, and
`measure` reports how closely a tc-shaped link holds its rate.

This module parses the flags and prints; the work is in `lifecycle` (up, train, down), `status`,
`compose`, `netns` (namespaces, links, tc) and `services` (what runs).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.flags import Flags
from swarm.testbed.compose import render_compose
from swarm.testbed.lifecycle import bring_up, take_down, train_in
from swarm.testbed.netns import (
    FALLBACK_HINT,
    CommandError,
    Unavailable,
    check_available,
    measure_rate,
    run_command,
    shaped_pair,
    shaping_commands,
)
from swarm.testbed.services import LinkRate, TestbedConfig
from swarm.testbed.testbed_status import collect_status, render_status

if TYPE_CHECKING:
    from swarm.train.trainer import TrainConfig

__all__ = ["add_arguments", "config_from_args", "run", "run_in_testbed"]

DEFAULT_RUN_DIR = "runs/testbed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="create the namespaces and links, start the swarm (needs root)")
    up.description = "Create a bridge and one namespace per service, shape every link with tc, start the swarm."
    _add_location_arguments(up)
    _add_config_arguments(up)
    g = up.add_argument_group("lifecycle")
    g.add_argument("--train", action="store_true", help="also run the trainer in its namespace and print its summary")
    g.add_argument("--down", action="store_true", help="take the testbed down again before returning")
    g.add_argument("--ready-timeout-s", type=float, default=120.0, help="bound on every stage being announced")
    g.add_argument("--train-timeout-s", type=float, default=1800.0, help="bound on the trainer's run")
    status = actions.add_parser("status", help="namespaces, addresses, qdisc counters, live processes")
    status.description = "Show the testbed's namespaces, addresses, shaping with byte counts, and processes."
    _add_location_arguments(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    down = actions.add_parser("down", help="stop every process, remove every namespace and link of the prefix")
    down.description = "Stop every testbed process and remove its namespaces and links (also leftovers of a crash)."
    _add_location_arguments(down)
    down.add_argument("--grace-s", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    compose = actions.add_parser("compose", help="print the docker compose file running the same services")
    compose.description = "Print docker/compose.yaml for these options: `swarm testbed compose > docker/compose.yaml`."
    _add_config_arguments(compose)
    shape = actions.add_parser("shape", help="shape one interface's egress with tc (the docker entrypoint's half)")
    shape.description = "Apply the testbed's tc shaping to one interface of this namespace (or print it)."
    shape.add_argument("--dev", default="eth0", help="interface to shape (default eth0)")
    shape.add_argument("--rate-mbit", type=float, default=0.0, help="egress bandwidth, Mbit/s (0: unshaped)")
    shape.add_argument("--to", action="append", default=[], metavar="ADDR=RATE", help="rate to one address (repeat)")
    shape.add_argument("--dry-run", action="store_true", help="print the tc commands instead of running them")
    measure = actions.add_parser("measure", help="goodput of a tc-shaped veth link at several rates (needs root)")
    measure.description = "Shape a veth pair between two namespaces at each rate and measure TCP goodput."
    measure.add_argument("--rates", default="10,100,1000", help="comma-separated rates, Mbit/s (default 10,100,1000)")
    measure.add_argument("--seconds", type=float, default=1.5, help="data per rate: this long at the rate, >= 1 MB")
    measure.add_argument("--qdiscs", default="tbf,htb", help="tbf (one rate) and/or htb (per-link class)")
    measure.add_argument("--prefix", default="swt-", help="name prefix of the two namespaces")
    measure.add_argument("--json", action="store_true", help="print the rows as JSON")


def _add_location_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help=f"state, logs, outputs (default {DEFAULT_RUN_DIR})")
    parser.add_argument("--prefix", default=None, help="name prefix of namespaces and links (default: state or swt-)")


_TESTBED_FLAGS = Flags(TestbedConfig)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    _TESTBED_FLAGS.add_to(parser)
    g = parser.add_argument_group("network (bandwidth by the kernel, delay by swarm-peer's shaper)")
    g.add_argument("--scenario", default=None, help="per-link rates and delays between peers from a DT-FM scenario")
    g.add_argument("--scenario-scale", type=float, default=1.0, help="multiply the scenario's bandwidths by this")


def config_from_args(args: argparse.Namespace) -> TestbedConfig:
    """The TestbedConfig of the flags, with a --scenario's links before the --link ones and the --prefix of the
    location flags."""
    cfg = _TESTBED_FLAGS.from_args(args)
    links = _scenario_links(args.scenario, cfg.peers, args.scenario_scale) if args.scenario else ()
    return replace(cfg, links=links + cfg.links, prefix=getattr(args, "prefix", None) or TestbedConfig.prefix)


def _scenario_links(name: str, peers: int, scale: float) -> tuple[LinkRate, ...]:
    """Links between `peers` peers spread evenly over the scenario's (sorted by region) peers."""
    from swarm.scheduler.scenarios import load_scenario

    plan = load_scenario(name).plan_input
    picked = [i * plan.n_peers // peers for i in range(peers)]
    return tuple(
        LinkRate(
            f"peer{i}",
            f"peer{j}",
            float(plan.bandwidth_bytes_per_s[picked[i], picked[j]]) * 8 / 1e6 * scale,
            round(float(plan.delay_s[picked[i], picked[j]]) * 1e3, 3),
        )
        for i, j in itertools.permutations(range(peers), 2)
    )


# ---- the experiment hook ----------------------------------------------------------------------------------


def _model_seed_flags(seed: int) -> list[str]:
    """The peers' --model-seed: the trainer's init seed, so peers and trainer start from the same weights."""
    from swarm.options import ModelFlags

    return Flags(ModelFlags).to_argv(ModelFlags(model_seed=seed), always=["--model-seed"])


def run_in_testbed(
    cell, peer_flags: list[str], train: TrainConfig, peers: int, nat: tuple[int, ...] = (), before_down=None
):
    """One cell of `swarm experiment throttled --netns`: a fresh testbed of `peers` peers with every link
    shaped by tc to `cell.rate_mbit` (None: unshaped), the trainer `train` describes run inside, the testbed
    taken down; returns the rows of the trainer's steps.csv. `--rate-mbit` in `peer_flags` is dropped: the
    kernel shapes instead. `nat`: peers behind the testbed's NAT router (`swarm experiment nat --netns`)."""
    flags = list(peer_flags)
    popped = {name: _pop_flag(flags, name) for name in ("--rate-mbit", "--fw-codec", "--bw-codec", "--delay-ms")}
    for name in ("--total-steps", "--warmup-steps"):  # the testbed derives both from the trainer's steps
        _pop_flag(flags, name)
    model = train.model
    trainer_flags = ["--schedule", train.schedule, "--seed", str(train.seed)]
    trainer_flags += ["--setting", train.setting, "--deadline-s", str(train.deadline_s)]
    trainer_flags += ["--model-seed", str(model.init_seed)]
    if train.data:
        trainer_flags += ["--data", str(train.data)]
    cfg = TestbedConfig(
        peers=peers,
        rate_mbit=cell.rate_mbit or 0.0,
        delay_ms=float(popped["--delay-ms"] or 0.0),
        fw_codec=popped["--fw-codec"] or TestbedConfig.fw_codec,
        bw_codec=popped["--bw-codec"] or TestbedConfig.bw_codec,
        layers=model.n_layers,
        hidden=model.hidden_dim,
        heads=model.n_heads,
        seq_len=model.seq_len_tokens,
        epochs=train.epochs,
        steps=train.steps,
        train_samples=train.train_samples,
        batch_size=train.batch_size,
        micro_batches=train.micro_batches,
        peer_flags=(*flags, *_model_seed_flags(model.init_seed)),
        trainer_flags=tuple(trainer_flags),
        nat=nat,
    )
    run_dir = Path(train.out)
    quiet = lambda _: None  # noqa: E731
    try:
        testbed = bring_up(cfg, run_dir, quiet)
        code = train_in(testbed, 3600.0, quiet)
        if code:
            raise RuntimeError(f"the trainer exited with code {code}; log: {run_dir / 'logs' / 'trainer.log'}")
        if before_down is not None:  # e.g. read the peers' /metrics while they still serve
            before_down(testbed)
        with open(run_dir / "train" / "steps.csv") as f:
            return list(csv.DictReader(f))
    finally:
        take_down(run_dir, cfg.prefix, say=quiet)


def _pop_flag(flags: list[str], name: str) -> str | None:
    value = None
    while name in flags:
        i = flags.index(name)
        value = flags[i + 1]
        del flags[i : i + 2]
    return value


# ---- commands ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    handlers = {"up": _up, "status": _status, "down": _down, "compose": _compose, "shape": _shape, "measure": _measure}
    try:
        return handlers[args.action](args)
    except Unavailable as e:
        print(f"swarm testbed: {e}.\nThe namespace testbed is not available here; {FALLBACK_HINT}.", file=sys.stderr)
        return 2
    except (ValueError, CommandError, RuntimeError, TimeoutError) as e:
        print(f"swarm testbed {args.action}: error: {e}", file=sys.stderr)
        return 1


def _say(line: str) -> None:
    print(f"[testbed] {line}", file=sys.stderr, flush=True)


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def _up(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    run_dir = Path(args.run_dir)
    signal.signal(signal.SIGTERM, _interrupt)  # `down` or a supervisor: clean up like on Ctrl-C
    try:
        testbed = bring_up(cfg, run_dir, _say, args.ready_timeout_s)
    except KeyboardInterrupt:
        return 130
    code = 0
    try:
        _say(f"up: {cfg.peers} peers serving; logs in {testbed.run_dir / 'logs'}")
        print(render_status(collect_status(testbed.run_dir, cfg.prefix)))
        if args.train:
            code = train_in(testbed, args.train_timeout_s, _say)
            print(_train_summary(testbed.run_dir) if code == 0 else (testbed.procs.tail("trainer") or ""))
            if code:
                _say(f"the trainer exited with code {code}")
    except KeyboardInterrupt:
        args.down, code = True, 130
    finally:
        if args.down:
            counts = take_down(testbed.run_dir, cfg.prefix, say=_say)
            _say("down: stopped {} processes, removed {} namespaces and {} links".format(*counts))
        else:
            _say("stays up: `swarm testbed status`, `swarm testbed down`")
    return code


def _train_summary(run_dir: Path) -> str:
    from swarm.train.trainer import TrainSummary, format_summary

    return format_summary(TrainSummary(**json.loads((run_dir / "train" / "summary.json").read_text())))


def _down(args: argparse.Namespace) -> int:
    check_available()
    counts = take_down(Path(args.run_dir), args.prefix, args.grace_s, _say)
    print("down: stopped {} processes, removed {} namespaces and {} links".format(*counts))
    return 0


def _status(args: argparse.Namespace) -> int:
    check_available()
    status = collect_status(Path(args.run_dir), args.prefix)
    print(json.dumps(status, indent=1) if args.json else render_status(status))
    return 0 if status["namespaces"] else 1


def _compose(args: argparse.Namespace) -> int:
    sys.stdout.write(render_compose(config_from_args(args)))
    return 0


def _shape(args: argparse.Namespace) -> int:
    links = []
    for spec in args.to:
        address, sep, rate = spec.partition("=")
        if not sep:
            raise ValueError(f"--to {spec!r}: expected ADDR=RATE")
        links.append((address, float(rate)))
    commands = shaping_commands(args.dev, args.rate_mbit or None, tuple(links))
    for command in commands:
        if args.dry_run:
            print(" ".join(command))
        else:
            try:
                run_command(command)
            except CommandError as e:
                raise CommandError(f"{e} (a container needs cap_add: [NET_ADMIN])") from None
    return 0


def _measure(args: argparse.Namespace) -> int:
    check_available()
    rows = []
    for qdisc, text in itertools.product(args.qdiscs.split(","), args.rates.split(",")):
        rate = float(text)
        nbytes = int(max(1e6, rate * 1e6 / 8 * args.seconds))
        with shaped_pair(rate, args.prefix, qdisc=qdisc) as (a, b):
            started = time.perf_counter()
            goodput_mbit = measure_rate(a, b, nbytes) * 8 / 1e6
            seconds = time.perf_counter() - started
        rows.append(
            {"qdisc": qdisc, "rate_mbit": rate, "goodput_mbit": goodput_mbit, "ratio": goodput_mbit / rate,
             "bytes": nbytes, "seconds": seconds}
        )  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return 0
    print("qdisc  configured Mbit/s  TCP goodput Mbit/s  goodput/configured      bytes  seconds")
    for r in rows:
        print(
            f"{r['qdisc']:5}  {r['rate_mbit']:>17g}  {r['goodput_mbit']:>18.2f}  {r['ratio']:>18.3f}  "
            f"{r['bytes']:>9d}  {r['seconds']:>7.1f}"
        )
    print("(TCP payload only: a full 1514-byte frame carries 1448 bytes of it, 0.956 of the rate)")
    return 0
