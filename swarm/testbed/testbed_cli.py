"""`swarm testbed`: a swarm whose every process has its own network namespace, links shaped by the kernel.

`up` builds a bridge, one namespace per service (DHT bootstrap node, `--peers` swarm-peers, a trainer),
shapes each namespace's egress with tc, starts the services inside (logs in the run directory), waits
until every stage is announced in the DHT and, with `--train`, trains and prints the summary. The
testbed stays up until `down`, which stops every process and removes every namespace and link, also
after a crash of `up` itself (it sweeps everything named with the prefix). `compose` prints the docker
compose file running the same services, `shape` is the tc half of the container entrypoint, and
`measure` reports how closely a tc-shaped link holds its rate. `compose-run` builds the image and runs the
compose file end to end (`compose_run`).

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.flags import Flags, flag
from swarm.testbed.compose import render_compose
from swarm.testbed.compose_engine import EngineUnavailable
from swarm.testbed.compose_run import ComposeRunOptions, ComposeRunResult
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
from swarm.testbed.services import Egress, LinkRate, TestbedConfig
from swarm.testbed.testbed_status import collect_status, render_status

if TYPE_CHECKING:
    from swarm.daemon.peer_config import PeerConfig
    from swarm.train.trainer import TrainConfig

__all__ = ["ComposeRun", "Layout", "Location", "Shape", "add_arguments", "config_from_args", "run", "run_in_testbed"]

DEFAULT_RUN_DIR = "runs/testbed"


_NETWORK = "network (bandwidth by the kernel, delay by swarm-peer's shaper)"


@dataclass(frozen=True)
class Location:
    """Where a testbed keeps its state, and the names it gives the kernel's objects."""

    run_dir: str = DEFAULT_RUN_DIR
    """state, logs, outputs"""
    prefix: str | None = None
    """name prefix of namespaces and links (none: the state's, or swt-)"""


@dataclass(frozen=True)
class Layout:
    """The testbed `up` and `compose` run: its config, and the links a DT-FM scenario gives."""

    testbed: TestbedConfig = field(default_factory=TestbedConfig)
    scenario: str | None = field(default=None, metadata=flag(group=_NETWORK))
    """per-link rates and delays between peers from a DT-FM scenario"""
    scenario_scale: float = field(default=1.0, metadata=flag(group=_NETWORK))
    """multiply the scenario's bandwidths by this"""

    def config(self, prefix: str | None = None) -> TestbedConfig:
        """The TestbedConfig, with the scenario's links before the --link ones and `prefix` (None: the default)."""
        cfg = self.testbed
        links = _scenario_links(self.scenario, cfg.peers, self.scenario_scale) if self.scenario else ()
        return replace(cfg, links=links + cfg.links, prefix=prefix or TestbedConfig.prefix)


@dataclass(frozen=True)
class Up:
    """`swarm testbed up`."""

    layout: Layout = field(default_factory=Layout)
    location: Location = field(default_factory=Location)
    train: bool = field(default=False, metadata=flag(group="lifecycle"))
    """also run the trainer in its namespace and print its summary"""
    down: bool = field(default=False, metadata=flag(group="lifecycle"))
    """take the testbed down again before returning"""
    ready_timeout_s: float = field(default=120.0, metadata=flag(group="lifecycle"))
    """bound on every stage being announced"""
    train_timeout_s: float = field(default=1800.0, metadata=flag(group="lifecycle"))
    """bound on the trainer's run"""


@dataclass(frozen=True)
class Status:
    """`swarm testbed status`."""

    location: Location = field(default_factory=Location)
    json: bool = False
    """print one JSON object"""


@dataclass(frozen=True)
class Down:
    """`swarm testbed down`."""

    location: Location = field(default_factory=Location)
    grace_s: float = 10.0
    """seconds between SIGTERM and SIGKILL"""


@dataclass(frozen=True)
class Shape:
    """`swarm testbed shape`: the testbed's tc shaping of one interface (the docker entrypoint's half)."""

    dev: str = "eth0"
    """interface to shape"""
    egress: Egress = field(default_factory=lambda: Egress(0.0))
    to: tuple[str, ...] = field(default=(), metadata=flag(repeat=True, metavar="ADDR=RATE"))
    """rate to one address (repeat)"""
    dry_run: bool = False
    """print the tc commands instead of running them"""

    def links(self) -> tuple[tuple[str, float], ...]:
        """(address, Mbit/s) of every --to."""
        links = []
        for spec in self.to:
            address, sep, rate = spec.partition("=")
            if not sep:
                raise ValueError(f"--to {spec!r}: expected ADDR=RATE")
            links.append((address, float(rate)))
        return tuple(links)


@dataclass(frozen=True)
class ComposeRun:
    """`swarm testbed compose-run`: the swarm of `compose`, built and run under docker compose."""

    layout: Layout = field(default_factory=Layout)
    options: ComposeRunOptions = field(default_factory=ComposeRunOptions)


@dataclass(frozen=True)
class Measure:
    """`swarm testbed measure`: goodput of a tc-shaped veth link at several rates."""

    rates: str = "10,100,1000"
    """comma-separated rates, Mbit/s"""
    seconds: float = 1.5
    """data per rate: this long at the rate, >= 1 MB"""
    qdiscs: str = "tbf,htb"
    """tbf (one rate) and/or htb (per-link class)"""
    prefix: str = "swt-"
    """name prefix of the two namespaces"""
    json: bool = False
    """print the rows as JSON"""


_ACTIONS: dict[str, tuple[Flags, str, str]] = {
    "up": (
        Flags(Up), "create the namespaces and links, start the swarm (needs root)",
        "Create a bridge and one namespace per service, shape every link with tc, start the swarm.",
    ),
    "status": (
        Flags(Status), "namespaces, addresses, qdisc counters, live processes",
        "Show the testbed's namespaces, addresses, shaping with byte counts, and processes.",
    ),
    "down": (
        Flags(Down), "stop every process, remove every namespace and link of the prefix",
        "Stop every testbed process and remove its namespaces and links (also leftovers of a crash).",
    ),
    "compose": (
        Flags(Layout), "print the docker compose file running the same services",
        "Print docker/compose.yaml for these options: `swarm testbed compose > docker/compose.yaml`.",
    ),
    "shape": (
        Flags(Shape), "shape one interface's egress with tc (the docker entrypoint's half)",
        "Apply the testbed's tc shaping to one interface of this namespace (or print it).",
    ),
    "compose-run": (
        Flags(ComposeRun), "build the image and run the compose testbed end to end (docker)",
        "Build docker/Dockerfile (offline base image and host CA certificates where needed), run the compose file "
        "until the trainer exits, collect its steps.csv, plot and summary, measure a shaped link between two "
        "containers, and take everything down. Starts dockerd if it is installed but not running.",
    ),
    "measure": (
        Flags(Measure), "goodput of a tc-shaped veth link at several rates (needs root)",
        "Shape a veth pair between two namespaces at each rate and measure TCP goodput.",
    ),
}  # fmt: skip
"""Each action's flags, help and description."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, (flags, help_text, description) in _ACTIONS.items():
        flags.add_to(actions.add_parser(name, help=help_text, description=description))


def config_from_args(args: argparse.Namespace) -> TestbedConfig:
    """The TestbedConfig of `up`'s or `compose`'s flags, with a --scenario's links before the --link ones and
    the --prefix of the location flags."""
    flags = _ACTIONS[args.action][0].from_args(args)
    if isinstance(flags, Up):
        return flags.layout.config(flags.location.prefix)
    return flags.config()


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


def run_in_testbed(
    rate_mbit: float | None, peer: PeerConfig, train: TrainConfig, peers: int, nat: tuple[int, ...] = (),
    before_down=None, prefix: str = TestbedConfig.prefix,
):  # fmt: skip
    """One cell of `swarm experiment throttled --netns`: a fresh testbed of `peers` peers whose every namespace's
    egress tc shapes to `rate_mbit` (None: unshaped), the trainer `train` describes run inside, the testbed
    taken down; returns the rows of the trainer's steps.csv. The peers are told `peer` but for what the testbed
    sets itself: their bandwidth (the kernel shapes it instead), codecs and delay (the testbed's own flags) and
    total and warm-up steps (the testbed derives both from the trainer's steps); the model is the trainer's.
    `nat`: peers behind the testbed's NAT router (`swarm experiment nat --netns`); `prefix`: of its namespaces and
    links (`TestbedConfig.prefix`), so that two experiments can run at once."""
    from swarm.daemon.peer_config import PeerConfig, peer_flags
    from swarm.options import CodecFlags, LinkShaping
    from swarm.peers.shaper import LinkShape
    from swarm.train.trainer import train_flags

    codecs = CodecFlags.of(peer.fw_codec, peer.bw_codec)
    delay_ms = LinkShaping.of(peer.link_shape, peer.link_shapes).delay_ms
    unset = PeerConfig()
    rest = replace(
        peer, model=train.model, link_shape=LinkShape(),
        optim=replace(peer.optim, total_steps=unset.optim.total_steps, warmup_steps=unset.optim.warmup_steps),
        **replace(codecs, fw_codec=CodecFlags.fw_codec, bw_codec=CodecFlags.bw_codec).build(),
    )  # fmt: skip
    trainer_flags = train_flags()
    trainer = replace(
        trainer_flags.base, model=train.model, schedule=train.schedule, seed=train.seed, setting=train.setting,
        deadline_s=train.deadline_s, data=train.data,
    )  # fmt: skip
    model = train.model
    cfg = TestbedConfig(
        peers=peers,
        egress=Egress(rate_mbit or 0.0),
        delay_ms=delay_ms,
        fw_codec=codecs.fw_codec,
        bw_codec=codecs.bw_codec,
        layers=model.n_layers,
        hidden=model.hidden_dim,
        heads=model.n_heads,
        seq_len=model.seq_len_tokens,
        epochs=train.epochs,
        steps=train.steps,
        train_samples=train.train_samples,
        batch_size=train.batch_size,
        micro_batches=train.micro_batches,
        # the model seed named even at its default: peers and trainer start from the same weights
        peer_flags=tuple(peer_flags().to_argv(rest, always=["--model-seed"])),
        trainer_flags=tuple(
            trainer_flags.to_argv(trainer, always=["--schedule", "--seed", "--setting", "--deadline-s", "--model-seed"])
        ),
        nat=nat,
        prefix=prefix,
    )
    run_dir = Path(train.out)
    quiet = lambda _: None  # noqa: E731
    try:
        testbed = bring_up(cfg, run_dir, quiet, ready_timeout_s=600.0)  # peers start slowly on a loaded machine
        code = train_in(testbed, 3600.0, quiet)
        if code:
            raise RuntimeError(f"the trainer exited with code {code}; log: {run_dir / 'logs' / 'trainer.log'}")
        if before_down is not None:  # e.g. read the peers' /metrics while they still serve
            before_down(testbed)
        with open(run_dir / "train" / "steps.csv") as f:
            return list(csv.DictReader(f))
    finally:
        take_down(run_dir, cfg.prefix, say=quiet)


# ---- commands ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    handlers = {"up": _up, "status": _status, "down": _down, "compose": _compose, "shape": _shape, "measure": _measure}
    handlers["compose-run"] = _compose_run
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
    up: Up = _ACTIONS["up"][0].from_args(args)
    cfg = up.layout.config(up.location.prefix)
    run_dir = Path(up.location.run_dir)
    take_down_after = up.down
    signal.signal(signal.SIGTERM, _interrupt)  # `down` or a supervisor: clean up like on Ctrl-C
    try:
        testbed = bring_up(cfg, run_dir, _say, up.ready_timeout_s)
    except KeyboardInterrupt:
        return 130
    code = 0
    try:
        _say(f"up: {cfg.peers} peers serving; logs in {testbed.run_dir / 'logs'}")
        print(render_status(collect_status(testbed.run_dir, cfg.prefix)))
        if up.train:
            code = train_in(testbed, up.train_timeout_s, _say)
            print(_train_summary(testbed.run_dir) if code == 0 else (testbed.procs.tail("trainer") or ""))
            if code:
                _say(f"the trainer exited with code {code}")
    except KeyboardInterrupt:
        take_down_after, code = True, 130
    finally:
        if take_down_after:
            counts = take_down(testbed.run_dir, cfg.prefix, say=_say)
            _say("down: stopped {} processes, removed {} namespaces and {} links".format(*counts))
        else:
            _say("stays up: `swarm testbed status`, `swarm testbed down`")
    return code


def _train_summary(run_dir: Path) -> str:
    from swarm.train.trainer import TrainSummary, format_summary

    return format_summary(TrainSummary(**json.loads((run_dir / "train" / "summary.json").read_text())))


def _down(args: argparse.Namespace) -> int:
    down: Down = _ACTIONS["down"][0].from_args(args)
    check_available()
    counts = take_down(Path(down.location.run_dir), down.location.prefix, down.grace_s, _say)
    print("down: stopped {} processes, removed {} namespaces and {} links".format(*counts))
    return 0


def _status(args: argparse.Namespace) -> int:
    flags: Status = _ACTIONS["status"][0].from_args(args)
    check_available()
    status = collect_status(Path(flags.location.run_dir), flags.location.prefix)
    print(json.dumps(status, indent=1) if flags.json else render_status(status))
    return 0 if status["namespaces"] else 1


def _compose(args: argparse.Namespace) -> int:
    sys.stdout.write(render_compose(config_from_args(args)))
    return 0


def _compose_run(args: argparse.Namespace) -> int:
    from swarm.testbed.compose_run import compose_run, find_repo

    flags: ComposeRun = _ACTIONS["compose-run"][0].from_args(args)
    try:
        result = compose_run(flags.layout.config(), flags.options, find_repo(), _say)
    except EngineUnavailable as e:
        print(f"swarm testbed compose-run: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result)) if flags.options.json else _compose_run_summary(result))
    return 0 if result.exit_code == 0 else result.exit_code or 1


def _compose_run_summary(r: ComposeRunResult) -> str:
    size = f"{r.image_bytes / 1e9:.2f} GB" if r.image_bytes else "?"
    rate = f"{r.measured_rate_mbit:.1f}" if r.measured_rate_mbit is not None else f"not measured ({r.rate_error})"
    loss = f"{r.first_loss:.4f} -> {r.final_loss:.4f}" if r.final_loss is not None and r.first_loss else "none"
    return "\n".join([
        f"compose run: trainer exit code {r.exit_code}, {r.steps} steps, loss {loss}",
        f"image: {size} from {r.base_image}, built in {r.build_s or 0:.0f} s (torch: {r.torch_wheel or 'index'})",
        f"run: {r.up_s or 0:.0f} s; shaped rate in a container: {rate} Mbit/s of {r.rate_mbit:g}",
        f"outputs: {r.run_dir} (steps.csv, plot, summary.json, logs, result.json)",
        *([f"host settings put back: {', '.join(r.restored)}"] if r.restored else []),
    ])  # fmt: skip


def _shape(args: argparse.Namespace) -> int:
    shape: Shape = _ACTIONS["shape"][0].from_args(args)
    commands = shaping_commands(shape.dev, shape.egress.rate_mbit or None, shape.links())
    for command in commands:
        if shape.dry_run:
            print(" ".join(command))
        else:
            try:
                run_command(command)
            except CommandError as e:
                raise CommandError(f"{e} (a container needs cap_add: [NET_ADMIN])") from None
    return 0


def _measure(args: argparse.Namespace) -> int:
    measure: Measure = _ACTIONS["measure"][0].from_args(args)
    check_available()
    rows = []
    for qdisc, text in itertools.product(measure.qdiscs.split(","), measure.rates.split(",")):
        rate = float(text)
        nbytes = int(max(1e6, rate * 1e6 / 8 * measure.seconds))
        with shaped_pair(rate, measure.prefix, qdisc=qdisc) as (a, b):
            started = time.perf_counter()
            goodput_mbit = measure_rate(a, b, nbytes) * 8 / 1e6
            seconds = time.perf_counter() - started
        rows.append(
            {"qdisc": qdisc, "rate_mbit": rate, "goodput_mbit": goodput_mbit, "ratio": goodput_mbit / rate,
             "bytes": nbytes, "seconds": seconds}
        )  # fmt: skip
    if measure.json:
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
