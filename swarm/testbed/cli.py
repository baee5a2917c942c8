"""`swarm testbed`: a swarm whose every process has its own network namespace, links shaped by the kernel.

`up` builds a bridge, one namespace per service (DHT bootstrap node, `--peers` swarm-peers, a trainer),
shapes each namespace's egress with tc, starts the services inside (logs in the run directory), waits
until every stage is announced in the DHT and, with `--train`, trains and prints the summary. The
testbed stays up until `down`, which stops every process and removes every namespace and link, also
after a crash of `up` itself (it sweeps everything named with the prefix). `compose` prints the docker
compose file running the same services, `shape` is the tc half of the container entrypoint, and
`measure` reports how closely a tc-shaped link holds its rate.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.testbed.netns import (
    ADDRESS_FILE,
    FALLBACK_HINT,
    CommandError,
    LinkRate,
    Service,
    TestbedConfig,
    TestbedPlan,
    list_links,
    list_namespaces,
    measure_rate,
    namespace_pids,
    plan_testbed,
    process_argv,
    qdisc_stats,
    run_command,
    setup_commands,
    shaped_pair,
    shaping_commands,
    sweep,
    testbed_services,
    unavailable_reason,
)

if TYPE_CHECKING:
    from swarm.testbed.procs import ProcessGroup
    from swarm.train.trainer import TrainConfig

__all__ = [
    "SHARED_DIR",
    "Testbed",
    "add_arguments",
    "bring_up",
    "compose_service",
    "config_from_args",
    "entrypoint_argv",
    "render_compose",
    "run",
    "run_in_testbed",
    "take_down",
]

SHARED_DIR = "/shared"
"""Where compose's shared volume is mounted: the address file, checkpoints and the trainer's outputs."""
DEFAULT_RUN_DIR = "runs/testbed"
_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Unavailable(RuntimeError):
    """No root or no `ip netns` here."""


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


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    d = TestbedConfig()
    g = parser.add_argument_group("swarm")
    g.add_argument("--peers", type=int, default=d.peers, help=f"swarm-peers, one stage each (default {d.peers})")
    g.add_argument("--fw-codec", default=d.fw_codec, help=f"activation codec (default {d.fw_codec})")
    g.add_argument("--bw-codec", default=d.bw_codec, help=f"gradient codec (default {d.bw_codec})")
    for flag, text in (("--layers", "transformer blocks"), ("--hidden", "width"), ("--heads", "attention heads")):
        g.add_argument(flag, type=int, default=None, help=f"model {text} (default: the entry points')")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the entry points')")
    g.add_argument("--epochs", type=int, default=d.epochs, help=f"trainer's passes over the data (default {d.epochs})")
    g.add_argument("--steps", type=int, default=None, help="trainer's optimizer steps (default: --epochs worth)")
    g.add_argument("--train-samples", type=int, default=d.train_samples, help="training samples")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per step")
    g.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per step")
    g = parser.add_argument_group("network (bandwidth by the kernel, delay by swarm-peer's shaper)")
    g.add_argument("--rate-mbit", type=float, default=d.rate_mbit, help="egress of every namespace, Mbit/s (0: none)")
    g.add_argument("--peer-rate-mbit", default="", metavar="R0,R1,...", help="egress of peer0, peer1, ..., Mbit/s")
    g.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SRC:DST=RATE[:DELAY]",
        help="one directed link, e.g. peer0:peer1=10:40 (RATE none keeps the sender's; delay peer to peer only)",
    )
    g.add_argument("--scenario", default=None, help="per-link rates and delays between peers from a DT-FM scenario")
    g.add_argument("--scenario-scale", type=float, default=1.0, help="multiply the scenario's bandwidths by this")
    g.add_argument("--delay-ms", type=float, default=d.delay_ms, help="one-way delay of every peer's links, ms")
    g.add_argument("--subnet", default=d.subnet, help=f"private IPv4 subnet of the bridge (default {d.subnet})")


def config_from_args(args: argparse.Namespace) -> TestbedConfig:
    links = tuple(LinkRate.parse(spec) for spec in args.link)
    if args.scenario:
        links = _scenario_links(args.scenario, args.peers, args.scenario_scale) + links
    return TestbedConfig(
        peers=args.peers,
        rate_mbit=args.rate_mbit,
        peer_rate_mbit=tuple(float(r) for r in args.peer_rate_mbit.split(",") if r.strip()),
        links=links,
        delay_ms=args.delay_ms,
        subnet=args.subnet,
        prefix=getattr(args, "prefix", None) or TestbedConfig.prefix,
        fw_codec=args.fw_codec,
        bw_codec=args.bw_codec,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq_len=args.seq_len,
        epochs=args.epochs,
        steps=args.steps,
        train_samples=args.train_samples,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
    )


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


# ---- lifecycle --------------------------------------------------------------------------------------------


@dataclass
class Testbed:
    plan: TestbedPlan
    run_dir: Path
    procs: ProcessGroup
    """The services' processes: they run on when `up` returns; `down` finds them by namespace."""


def _state_path(run_dir: Path) -> Path:
    return run_dir / "state.json"


def _write_state(run_dir: Path, plan: TestbedPlan, pids: dict[str, int]) -> None:
    state = {
        "prefix": plan.config.prefix,
        "subnet": plan.config.subnet,
        "bridge": plan.bridge,
        "testbed_pid": os.getpid(),
        "started_at": time.time(),
        "config": asdict(plan.config),
        "nodes": [
            {
                "name": n.service.name,
                "namespace": n.namespace,
                "address": n.service.address,
                "veth_root": n.veth_root,
                "veth_ns": n.veth_ns,
                "rate_mbit": n.service.rate_mbit,
                "link_rate_mbit": [list(x) for x in n.service.link_rate_mbit],
                "argv": list(n.service.argv),
                "pid": pids.get(n.service.name),
            }
            for n in plan.nodes
        ],
    }
    tmp = _state_path(run_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(_state_path(run_dir))


def _read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads(_state_path(run_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def bring_up(
    cfg: TestbedConfig, run_dir: Path, say: Callable[[str], None] = print, ready_timeout_s: float = 120.0
) -> Testbed:
    """Creates the namespaces and links, starts bootstrap and peers, waits until every stage is announced.
    On any failure (or interrupt) it removes everything it made before re-raising."""
    from swarm.testbed.procs import ProcessGroup

    reason = unavailable_reason()
    if reason:
        raise Unavailable(reason)
    if list_namespaces(cfg.prefix) or list_links(cfg.prefix):
        raise RuntimeError(f"a testbed with prefix {cfg.prefix!r} is already up: `swarm testbed down` first")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ADDRESS_FILE).unlink(missing_ok=True)
    plan = plan_testbed(cfg, str(run_dir))
    _write_state(run_dir, plan, {})  # before anything exists: a crash from here on leaves a findable trail
    procs = ProcessGroup(run_dir / "logs")
    try:
        say(f"creating {len(plan.nodes)} namespaces on bridge {plan.bridge} ({cfg.subnet})")
        for command in setup_commands(plan):
            run_command(command)
        pids = {}
        for node in plan.nodes[:-1]:  # every service but the trainer
            argv = ["ip", "netns", "exec", node.namespace, *process_argv(node.service.argv)]
            pids[node.service.name] = procs.start(node.service.name, argv, env=_ENV).pid
            _write_state(run_dir, plan, pids)
            if node.service.name == "bootstrap":
                procs.wait_for_file(run_dir / ADDRESS_FILE, 60)
                say(f"bootstrap node up at {node.service.address}; starting {cfg.peers} peers")
        _wait_for_stages(plan, run_dir, procs, ready_timeout_s, say)
        return Testbed(plan, run_dir, procs)
    except BaseException:
        say("start failed: taking down what was made")
        sweep(cfg.prefix, grace_s=5)
        _state_path(run_dir).unlink(missing_ok=True)
        raise


def _wait_for_stages(plan: TestbedPlan, run_dir: Path, procs, timeout_s: float, say) -> None:
    """Asks the DHT from the trainer's namespace (`swarm status`) until every stage is announced, so the
    check crosses the bridge exactly as the trainer will."""
    trainer = plan.node("trainer")
    argv = [
        "ip", "netns", "exec", trainer.namespace,
        *process_argv(("swarm", "status", "--address-file", str(run_dir / ADDRESS_FILE),
                       "--host", trainer.service.address, "--json", "--timeout-s", "15")),
    ]  # fmt: skip
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        procs.check_alive()
        result = run_command(argv, timeout_s=60, check=False)
        try:
            peers = json.loads(result.stdout)["peers"] if result.returncode == 0 else []
        except (json.JSONDecodeError, KeyError):
            peers = []
        stages = sorted({p["stage"] for p in peers if p.get("stage") is not None})
        line = f"{len(stages)}/{plan.config.peers} stages announced"
        if line != last:
            say(line)
            last = line
        if len(stages) >= plan.config.peers:
            (run_dir / "dht_status.json").write_text(result.stdout)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {line} after {timeout_s:.0f} s (logs in {run_dir / 'logs'})")
        time.sleep(1.0)


def train_in(testbed: Testbed, timeout_s: float, say: Callable[[str], None] = print) -> int:
    """Runs the trainer in its namespace until it exits; returns its exit code."""
    node = testbed.plan.node("trainer")
    argv = ["ip", "netns", "exec", node.namespace, *process_argv(node.service.argv)]
    say(f"training from {node.service.address} (log: {testbed.run_dir / 'logs' / 'trainer.log'})")
    proc = testbed.procs.start("trainer", argv, env=_ENV)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise TimeoutError(f"the trainer ran longer than {timeout_s:.0f} s") from None


def take_down(run_dir: Path, prefix: str | None = None, grace_s: float = 10.0, say=print) -> tuple[int, int, int]:
    """Stops a running `up` and everything in the prefix's namespaces, removes namespaces and links;
    returns (processes, namespaces, links)."""
    state = _read_state(run_dir) or {}
    prefix = prefix or state.get("prefix") or TestbedConfig.prefix
    owner = state.get("testbed_pid")
    if owner and owner != os.getpid() and _is_testbed_process(owner):
        say(f"stopping the testbed process {owner}")
        os.kill(owner, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 10
        while time.monotonic() < deadline and _is_testbed_process(owner):
            time.sleep(0.2)
    report = sweep(prefix, grace_s, say)
    if state.get("prefix", prefix) == prefix:
        _state_path(run_dir).unlink(missing_ok=True)
    return len(report.pids), len(report.namespaces), len(report.links)


def _is_testbed_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return b"testbed" in cmdline and state != "Z"


# ---- docker compose ---------------------------------------------------------------------------------------


def compose_service(service: Service) -> tuple[list[str], dict[str, str]]:
    """A service's compose `command` and `environment`: the one-way delay moves from argv to DELAY (the
    entrypoint hands it back as --delay-ms), rates to RATE and LINKS (the entrypoint's tc shaping)."""
    command, delay = list(service.argv), "0"
    if "--delay-ms" in command:
        i = command.index("--delay-ms")
        delay = command[i + 1]
        del command[i : i + 2]
    links = " ".join(f"{address}={rate:g}" for address, rate in service.link_rate_mbit)
    return command, {"RATE": f"{service.rate_mbit or 0:g}", "DELAY": delay, "LINKS": links}


def entrypoint_argv(command: list[str], env: dict[str, str]) -> list[str]:
    """What docker/entrypoint.sh runs for `command` under `env` (the inverse of compose_service)."""
    delay = env.get("DELAY", "")
    if command and command[0] == "swarm-peer" and delay not in ("", "0"):
        return [*command, "--delay-ms", delay]
    return list(command)


def render_compose(cfg: TestbedConfig) -> str:
    """docker/compose.yaml for `cfg`: the same services, argv, addresses and rates as the namespace testbed."""
    q = json.dumps
    lines = [
        "# The namespace testbed's swarm as docker compose services. Generated by `swarm testbed compose`",
        "# (same options as `swarm testbed up`); tests/unit/test_testbed.py checks it matches; regenerate, don't",
        "# edit. Run from the repository root, see README.md (Testbeds):",
        "#   docker compose -f docker/compose.yaml up --build --abort-on-container-exit --exit-code-from trainer",
        "# Peers and trainer serve /metrics on a free port of the host's loopback: `docker compose port peer0 9400`.",
        "name: swarm-testbed",
        "",
        "x-swarm: &swarm",
        "  build: {context: .., dockerfile: docker/Dockerfile}",
        "  image: swarm-testbed:latest",
        "  cap_add: [NET_ADMIN]  # the entrypoint shapes eth0 with tc",
        f"  volumes: [{q('shared:' + SHARED_DIR)}]",
        "",
        "services:",
    ]
    services = testbed_services(cfg, SHARED_DIR)
    for service in services:
        command, env = compose_service(service)
        lines += [f"  {service.name}:", "    <<: *swarm", f"    command: {q(command)}", "    environment:"]
        lines += [f"      {key}: {q(value)}" for key, value in env.items()]
        lines += ["    networks:", "      swarm:", f"        ipv4_address: {service.address}"]
        if service.name == "bootstrap":
            test = q(["CMD", "test", "-s", f"{SHARED_DIR}/{ADDRESS_FILE}"])
            lines += ["    healthcheck:", f"      test: {test}", "      interval: 1s", "      retries: 120"]
        else:
            lines += ["    depends_on:", "      bootstrap: {condition: service_healthy}"]
        if service.name == "trainer":
            lines += [f"      {s.name}: {{condition: service_started}}" for s in services if s.name.startswith("peer")]
            lines += ['    restart: "no"']
        port = _metrics_port(command)
        if port is not None:  # /metrics, published on a free port of the host's loopback (`docker compose port`)
            lines += [f"    expose: [{q(str(port))}]", f"    ports: [{q(f'127.0.0.1::{port}')}]"]
    lines += [
        "",
        "networks:",
        "  swarm:",
        "    ipam:",
        f"      config: [{{subnet: {cfg.subnet}}}]",
        "",
        "volumes:",
        "  shared: {}",
        "",
    ]
    return "\n".join(lines)


# ---- the experiment hook ----------------------------------------------------------------------------------


def run_in_testbed(cell, peer_flags: list[str], train: TrainConfig, peers: int):
    """One cell of `swarm experiment throttled --netns`: a fresh testbed of `peers` peers with every link
    shaped by tc to `cell.rate_mbit` (None: unshaped), the trainer `train` describes run inside, the testbed
    taken down; returns the rows of the trainer's steps.csv. `--rate-mbit` in `peer_flags` is dropped: the
    kernel shapes instead."""
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
        peer_flags=(*flags, "--model-seed", str(model.init_seed)),
        trainer_flags=tuple(trainer_flags),
    )
    run_dir = Path(train.out)
    quiet = lambda _: None  # noqa: E731
    try:
        testbed = bring_up(cfg, run_dir, quiet)
        code = train_in(testbed, 3600.0, quiet)
        if code:
            raise RuntimeError(f"the trainer exited with code {code}; log: {run_dir / 'logs' / 'trainer.log'}")
        with open(run_dir / "train" / "steps.csv") as f:
            return list(csv.DictReader(f))
    finally:
        take_down(run_dir, cfg.prefix, say=quiet)


def _metrics_port(argv: list[str] | tuple[str, ...]) -> int | None:
    """The --metrics-port a service's argv gives (the last one, as argparse takes it); None: not served."""
    ports = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--metrics-port"]
    return int(ports[-1]) if ports else None


def _pop_flag(flags: list[str], name: str) -> str | None:
    value = None
    while name in flags:
        i = flags.index(name)
        value = flags[i + 1]
        del flags[i : i + 2]
    return value


# ---- commands ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    handlers = {"up": _up, "status": _status, "down": _down, "compose": _compose, "shape": _shape}
    handlers["measure"] = _measure
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


def _check_available() -> None:
    reason = unavailable_reason()
    if reason:
        raise Unavailable(reason)


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
        print(_render_status(_collect_status(testbed.run_dir, cfg.prefix)))
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
    _check_available()
    counts = take_down(Path(args.run_dir), args.prefix, args.grace_s, _say)
    print("down: stopped {} processes, removed {} namespaces and {} links".format(*counts))
    return 0


def _status(args: argparse.Namespace) -> int:
    _check_available()
    status = _collect_status(Path(args.run_dir), args.prefix)
    print(json.dumps(status, indent=1) if args.json else _render_status(status))
    return 0 if status["namespaces"] else 1


def _collect_status(run_dir: Path, prefix: str | None) -> dict:
    state = _read_state(run_dir) or {}
    prefix = prefix or state.get("prefix") or TestbedConfig.prefix
    namespaces = list_namespaces(prefix)
    known = {n["namespace"]: n for n in state.get("nodes", [])}
    rows = []
    for ns in sorted(namespaces, key=lambda n: (n not in known, list(known).index(n) if n in known else 0, n)):
        node = known.get(ns, {})
        dev = node.get("veth_ns") or _namespace_device(ns, prefix)
        qdisc = qdisc_stats(ns, dev) if dev else None
        pids = namespace_pids(ns)
        rows.append(
            {
                "service": node.get("name", "(leftover)"),
                "namespace": ns,
                "address": node.get("address", "?"),
                "device": dev,
                "shaping": _describe_shaping(qdisc, node),
                "sent_bytes": (qdisc or {}).get("bytes"),
                "drops": (qdisc or {}).get("drops"),
                "processes": [_describe_process(pid) for pid in pids],
                "metrics_url": _metrics_url(node),
            }
        )
    summary = run_dir / "train" / "summary.json"
    return {
        "prefix": prefix,
        "run_dir": str(run_dir),
        "namespaces": rows,
        "links": list_links(prefix),
        "trained": json.loads(summary.read_text()) if summary.exists() and state else None,
        "train_command": " ".join(["ip", "netns", "exec", f"{prefix}trainer", *known[f"{prefix}trainer"]["argv"]])
        if f"{prefix}trainer" in known
        else None,
    }


def _render_status(status: dict) -> str:
    if not status["namespaces"] and not status["links"]:
        return f"no testbed with prefix {status['prefix']!r} is up"
    headers = ["service", "namespace", "address", "egress shaping", "sent", "processes"]
    table = [
        [
            r["service"], r["namespace"], r["address"], r["shaping"],
            "-" if r["sent_bytes"] is None else f"{r['sent_bytes'] / 1e6:.2f} MB ({r['drops']} drops)",
            ", ".join(r["processes"]) or "none",
        ]
        for r in status["namespaces"]
    ]  # fmt: skip
    widths = [max(len(str(row[i])) for row in [headers, *table]) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *table]]
    lines.append(f"links in the root namespace: {' '.join(status['links']) or 'none'}")
    served = [(r["service"], r["namespace"], r["metrics_url"]) for r in status["namespaces"] if r.get("metrics_url")]
    if served:  # the bridge has no address in the root namespace: scrape from inside one
        lines.append(f"metrics (from a namespace, e.g. ip netns exec {served[0][1]} curl -s URL):")
        lines += [f"  {service:<10} {url}" for service, _, url in served]
    if status["trained"]:
        t = status["trained"]
        lines.append(f"trained: {t['steps']} steps, loss {t['first_loss']:.3f} -> {t['final_loss']:.3f} ({t['csv']})")
    if status["train_command"]:
        lines.append(f"train by hand: {status['train_command']}")
    return "\n".join(lines)


def _metrics_url(node: dict) -> str | None:
    port = _metrics_port(node.get("argv", ()))
    return None if port is None or "address" not in node else f"http://{node['address']}:{port}/metrics"


def _namespace_device(ns: str, prefix: str) -> str | None:
    out = run_command(["ip", "-n", ns, "-o", "link", "show"], check=False).stdout
    names = [line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines() if ":" in line]
    return next((n for n in names if n.startswith(prefix)), None)


def _describe_shaping(qdisc: dict | None, node: dict) -> str:
    """The root qdisc's kind with the rates the state file says it applies (tc's JSON has htb's rates
    only per class)."""
    if not qdisc or qdisc.get("kind") not in ("tbf", "htb"):
        return "unshaped"
    rate = node.get("rate_mbit") if node else qdisc.get("options", {}).get("rate", 0) * 8 / 1e6
    parts = [f"{rate:g} Mbit/s" if rate else "unshaped"]
    parts += [f"to {address} {r:g} Mbit/s" for address, r in node.get("link_rate_mbit", [])]
    return f"{qdisc['kind']} {', '.join(parts)}"


def _describe_process(pid: int) -> str:
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return f"{pid} (gone)"
    if "-m" in argv[:-1]:
        module, rest = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2 :]
        name = {"swarm.daemon.peer": "swarm-peer"}.get(module, f"swarm {rest[0]}" if rest else module)
    else:
        name = os.path.basename(argv[0]) if argv else "?"
    return f"{name} [{pid}]"


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
    _check_available()
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
