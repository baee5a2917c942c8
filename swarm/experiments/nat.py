"""`swarm experiment nat`: the same training run with every peer reachable, with half of them behind NAT, and
with two adjacent stages both behind NAT (their link through a relay).

Every setting starts a local swarm (bootstrap + `--peers` swarm-peers on app-shaped links, or the namespace
testbed with its NAT router with `--netns`) and trains the same steps from the same seed on the same even
stage boundaries, so only who can dial whom differs:

- `reachable`: every peer reachable (`--reach direct`);
- `half-nat`: every other peer behind NAT (peers 1, 3, ...): the relay-aware planner places reachable peers
  between them, so no two NAT'd stages meet (a link into a NAT'd peer from a neighbour that is not its
  relay still passes its relay: the transport's rule, see swarm/scheduler/relays.py);
- `relay`: one more peer behind NAT (peer 0 too): with 3 of 4 NAT'd, two adjacent stages are both NAT'd and
  their link goes through a relay (the planner makes exactly one such link, the reachable peer in the middle).

App-shaped runs emulate NAT by `--reach relay` on the NAT'd peers (they behave as undialable on loopback);
`--netns` puts them behind the real NAT router (`swarm testbed up --nat`) and lets them detect it (`--reach
auto`). Those flags belong to the relay transport (swarm/net/relay.py): where this swarm-peer lacks them, the
NAT settings are reported as not run, never run without them.

Rows (app-shaped and `--netns` alike): `setting`, `nat_peers`, `order` (pipeline order, R reachable / N NAT'd;
with --netns from the route's addresses, a NAT'd peer announcing its LAN's), `relayed_links` (adjacent N-N
stages), `steps`, `final_loss`, `mean_step_s` (the trainer's, steps after the first), `step_std_s` (their
per-step standard deviation: the two-legs judge prints the standard error of its difference with it),
`predicted_step_s` (the plan's, which prices a relayed link as its two legs, a relay shared by its links),
`relay_extra_s` (the plan's: what its relayed links add to `predicted_step_s`, the same layout priced with them
as their two legs minus priced all-direct, `swarm.scheduler.relays.relay_extra_s`; None: no link relayed),
`relayed_bytes` (the relays' `swarm_relayed_bytes_total`, summed over their /metrics; with --netns read inside
each peer's namespace before the testbed goes down), `total_wire_bytes`, `step_ratio` (over `reachable`).

Rounds (`--repeats`, 3; 1 with --quick): the settings run in interleaved rounds, round k starting at setting k
(`rotated`), so a loaded or quiet stretch of the machine falls on every setting alike. A row is the first round's
run with `mean_step_s` the median of the rounds' means and `step_ratio` the median of the rounds' paired ratios
(each round's run over the same round's `reachable` run), with `step_ratio_min`/`step_ratio_max`; `rounds_data`
keeps every round. The half-nat target reads that median ratio; the final-loss equality must hold in every round.

The two-legs target ("a relayed link costs no more than its two legs") is judged on the relay runs' own plans:
per round, measured extra = relay run's mean step - the same round's reachable run's, against the relay run's
`relay_extra_s` (one plan, one set of measurements: two rows' `predicted_step_s` come from two runs' plans, each
from compute speeds measured afresh, and their difference is mostly noise); the median of the rounds' extras is
compared with the median of their `relay_extra_s`. The extras are differences of runs' means, so the target is met
when extra <= relay_extra_s + 2 standard errors of the mean extra (`NOISE_STANDARD_ERRORS`, from the runs'
per-step std; a one-sided test at about 98%: the data do not show the link dearer than its legs); the target line
prints the margin, and whether extra <= relay_extra_s holds without it.

With --netns each row also carries what `swarm.experiments.nat_netns` read before the testbed went down:
`relayed_by_link` ("<relay>:<src>-><dst>" by service name), `peer_cpu_s`, and with `--ping N` `ping_ms` (per-call
latency to each stage, direct or through its relay, from the trainer's and each relay's namespace). Every row
carries `relayed_connections`: the relays' connections by path ("data-port": plain TCP, "frames": gRPC frames).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ipaddress
import json
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from swarm.experiments import rotated
from swarm.flags import Flags, flag
from swarm.metrics import RELAYED_BYTES
from swarm.report import emit, free_port

SETTINGS = ("reachable", "half-nat", "relay")
COLUMNS = [
    "setting", "nat_peers", "order", "relayed_links", "steps", "final_loss", "mean_step_s", "predicted_step_s",
    "relay_extra_s", "step_std_s", "relayed_bytes", "total_wire_bytes", "step_ratio", "step_ratio_min",
    "step_ratio_max", "rounds", "note",
]  # fmt: skip
HALF_NAT_TOLERANCE = 0.10
"""Target: half the peers behind NAT within 10% of the all-reachable step time."""
NOISE_STANDARD_ERRORS = 2.0
"""Target: the relayed run's measured extra within relay_extra_s + this many standard errors of it."""


def _settings(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


@dataclass(frozen=True)
class NatConfig:
    """`swarm experiment nat`: the same run reachable, half behind NAT, and through a relay."""

    peers: int = 4
    """swarm-peers, one stage each"""
    steps: int = 30
    """optimizer steps per setting and round. 3 rounds of 30 steps (87 timed steps a setting) fit ~7 minutes with
    --netns, where bringing a testbed up takes ~35 s of each run; 40-step single runs left a ~5% standard error per
    ratio"""
    train_samples: int = 32
    """training samples"""
    batch_size: int = 8
    """samples per step"""
    micro_batches: int = 4
    """micro-batches per step"""
    rate_mbit: float = 100.0
    """bandwidth, Mbit/s, shaped by one of two shapers: without --netns, the application's token bucket on each of a
    peer's outgoing links (every swarm-peer's --rate-mbit, `swarm.options.LinkShaping`; the trainer's links are not
    shaped); with --netns, tc on the egress of every namespace, the trainer's included, a peer's links sharing it
    (`swarm testbed up --rate-mbit`, `swarm.testbed.services.Egress`; the peers' own shaper then shapes no
    bandwidth). --delay-ms is the application's in both"""
    delay_ms: float = 5.0
    """one-way delay of every peer's links, ms"""
    settings: tuple[str, ...] = field(default=SETTINGS, metadata=flag(parse=_settings, render=",".join))
    """comma-separated settings"""
    repeats: int = 3
    """interleaved rounds of the settings (round k starts at setting k); ratios are the rounds' medians"""
    netns: bool = False
    """the namespace testbed with a real NAT router (root)"""
    ping: int = field(default=0, metadata=flag(value=lambda n: max(0, n)))
    """with --netns: time this many signed Pings per stage and path, from the trainer's namespace and each
    relay's (diagnosis; 0: none)"""
    frames: bool = False
    """relays carry relayed bytes as gRPC frames (`--relay-data-port -1` on every peer), not by their data ports:
    the older tunnel, to compare"""
    out: Path | None = None
    """output folder (none: runs/nat-<time>)"""

    def __post_init__(self) -> None:
        if self.peers < 3:
            raise ValueError("--peers: at least 3 (the relay setting needs two adjacent NAT'd stages and a relay)")
        for name in ("steps", "train_samples", "batch_size", "micro_batches", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected >= 1")
        if self.train_samples % self.batch_size:
            raise ValueError("--train-samples must be a multiple of --batch-size")
        if unknown := set(self.settings) - set(SETTINGS):
            raise ValueError(f"--settings: unknown {sorted(unknown)}; expected some of {', '.join(SETTINGS)}")


def nat_peers(setting: str, peers: int) -> tuple[int, ...]:
    """Peer processes behind NAT in a setting: none; every other one (1, 3, ...); those and peer 0."""
    if setting == "reachable":
        return ()
    odd = tuple(range(1, peers, 2))
    return odd if setting == "half-nat" else (0, *odd)


def reach_flags(behind_nat: bool, netns: bool, supported: bool = True) -> list[str]:
    """swarm-peer's reachability flags for one peer (the one place the experiment names them): on the real NAT
    router every peer detects its reach; app-shaped, a NAT'd peer declares itself undialable. None where
    swarm-peer lacks them (then only the all-reachable setting runs, where they change nothing)."""
    if not supported:
        if behind_nat:
            raise ValueError("a NAT'd peer needs swarm-peer's --reach (the relay transport)")
        return []
    from swarm.daemon.peer_config import PeerConfig, peer_flags

    reach = "auto" if netns else "relay" if behind_nat else "direct"
    return peer_flags().to_argv(PeerConfig(reach=reach), always=["--reach"])


def reach_supported() -> bool:
    """Whether this swarm-peer has the relay transport's --reach flag."""
    from swarm.daemon.peer import build_parser

    return "--reach" in build_parser()._option_string_actions


def relayed_links(order: str | None) -> int | None:
    """Adjacent stages both NAT'd in an order like "R-N-N-R"."""
    if order is None:
        return None
    marks = order.split("-")
    return sum(a == b == "N" for a, b in zip(marks, marks[1:], strict=False))


def _counter_by_label(text: str, name: str, label: str) -> dict[str, int]:
    """Counter `name`'s samples per value of `label` in a Prometheus text exposition (malformed lines skipped)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] != name or f'{label}="' not in line:
            continue
        with contextlib.suppress(ValueError, IndexError):
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def relayed_by_link(text: str) -> dict[str, int]:
    """`swarm_relayed_bytes_total` per `link` label ("<src>-><dst>") of a Prometheus text exposition."""
    return _counter_by_label(text, RELAYED_BYTES, "link")


def relayed_connections_of(text: str) -> dict[str, int]:
    """`swarm_relayed_connections_total` per `path` label ("data-port" or "frames") of a text exposition."""
    return _counter_by_label(text, "swarm_relayed_connections_total", "path")


def relayed_bytes_of(text: str) -> int:
    """The sum of every `swarm_relayed_bytes_total{link=...}` sample in a Prometheus text exposition."""
    return sum(relayed_by_link(text).values())


def _scrape(ports: list[int]) -> tuple[int, dict[str, int]]:
    """Relayed bytes, and relayed connections by path, summed over the peers' /metrics."""
    total, conns = 0, {}
    for port in ports:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read(1 << 22).decode(errors="replace")
            total += relayed_bytes_of(text)
            for path, n in relayed_connections_of(text).items():
                conns[path] = conns.get(path, 0) + n
    return total, conns


def common_flags(cfg: NatConfig) -> list[str]:
    """Every peer's flags (`common_peer`)."""
    from swarm.daemon.peer_config import peer_flags

    return peer_flags().to_argv(common_peer(cfg))


def common_peer(cfg: NatConfig):
    """What every peer is told: even stage boundaries (the same split in every setting, so the math is the same),
    the shaped links, the schedule."""
    from swarm.experiments.throttled import planned_peer

    return planned_peer(
        batch_size=cfg.batch_size, micro_batches=cfg.micro_batches, steps=cfg.steps, rate_mbit=cfg.rate_mbit,
        delay_ms=cfg.delay_ms, relay_data_port=None if cfg.frames else 0,
    )  # fmt: skip


def _train_config(cfg: NatConfig, out: Path):
    from swarm.train.trainer import TrainConfig

    return TrainConfig(
        train_samples=cfg.train_samples, batch_size=cfg.batch_size, micro_batches=cfg.micro_batches,
        schedule="1f1b", steps=cfg.steps, seed=0, deadline_s=300.0, out=str(out),
    )  # fmt: skip


def run_setting(setting: str, cfg: NatConfig, out: Path, supported: bool = True) -> dict:
    """One setting's row: a fresh swarm trained from the seed, its NAT'd peers flagged (`reach_flags`)."""
    nat = nat_peers(setting, cfg.peers)
    row = {"setting": setting, "nat_peers": len(nat)}
    if cfg.netns:
        return {**row, **_run_netns(cfg, nat, out / setting, supported)}
    from swarm.daemon.peer_config import PeerConfig, peer_flags
    from swarm.testbed.local import local_swarm
    from swarm.train.trainer import train

    grpc_ports = [free_port() for _ in range(cfg.peers)]
    metrics_ports = [free_port() for _ in range(cfg.peers)]
    ports = [
        peer_flags().to_argv(PeerConfig(grpc_port=port, metrics_port=metrics))
        for port, metrics in zip(grpc_ports, metrics_ports, strict=True)
    ]
    per_peer = [[*reach_flags(i in nat, False, supported), *own] for i, own in enumerate(ports)]
    with local_swarm(out / setting, cfg.peers, common_flags(cfg), per_peer_flags=per_peer) as swarm:
        summary = train(_train_config(cfg, out / setting), swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        relayed, conns = _scrape(metrics_ports)
        route = list(summary.route)
    port_of = {port: i for i, port in enumerate(grpc_ports)}
    order = "-".join("N" if port_of.get(int(a.rsplit(":", 1)[1])) in nat else "R" for a in route)
    spread = step_stats(_step_times(out / setting / "steps.csv"))  # the trainer's --out is the setting's folder
    return {
        **row, "order": order, "relayed_links": relayed_links(order), "steps": summary.steps,
        "final_loss": summary.final_loss, "mean_step_s": summary.mean_step_s,
        "step_std_s": spread["step_std_s"], "timed_steps": spread["timed_steps"],
        "predicted_step_s": summary.predicted_step_s, "relay_extra_s": summary.relay_extra_s, "relayed_bytes": relayed,
        "total_wire_bytes": summary.total_wire_bytes, "relayed_connections": conns,
    }  # fmt: skip


def _run_netns(cfg: NatConfig, nat: tuple[int, ...], out: Path, supported: bool) -> dict:
    from swarm.experiments.nat_netns import probe
    from swarm.testbed.testbed_cli import run_in_testbed

    if nat and not supported:
        raise ValueError("a NAT'd peer needs swarm-peer's --reach (the relay transport)")
    peer = common_peer(cfg)  # reach: the default, auto: on the real NAT router every peer detects its own
    probed: list[dict] = []
    keep = lambda testbed: probed.append(probe(testbed, cfg.ping))  # noqa: E731
    steps = run_in_testbed(cfg.rate_mbit, peer, _train_config(cfg, out), cfg.peers, nat=nat, before_down=keep)
    times = [float(s["step_s"]) for s in steps]
    summary = _read_json(out / "train" / "summary.json") or {}
    order = netns_order(summary.get("route") or [])
    return {
        "order": order, "relayed_links": relayed_links(order), "steps": len(steps),
        "final_loss": float(steps[-1]["train_loss"]), **step_stats(times),
        "predicted_step_s": summary.get("predicted_step_s"), "relay_extra_s": summary.get("relay_extra_s"),
        "relayed_bytes": None, **(probed[0] if probed else {}),
        "total_wire_bytes": sum(int(s.get("total_wire_bytes") or 0) for s in steps),
    }  # fmt: skip


def step_stats(times: list[float]) -> dict:
    """`mean_step_s` and `step_std_s` (per-step standard deviation) of the steps after the first (the first
    builds channels and tunnels)."""
    kept = times[1:] or times
    mean = sum(kept) / max(1, len(kept))
    std = (sum((t - mean) ** 2 for t in kept) / (len(kept) - 1)) ** 0.5 if len(kept) > 1 else 0.0
    return {"mean_step_s": mean, "step_std_s": std, "timed_steps": len(kept)}


def _step_times(path: Path) -> list[float]:
    with contextlib.suppress(OSError, ValueError, KeyError), open(path) as f:
        return [float(r["step_s"]) for r in csv.DictReader(f)]
    return []


def _read_json(path: Path):
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


def netns_order(route: list[str], nat_subnet: str | None = None) -> str | None:
    """The pipeline order (R/N) of a namespace testbed's route: a NAT'd peer announces its LAN address, inside
    the testbed's `nat_subnet` (default `TestbedConfig.nat_subnet`). None without a route or on a bad address."""
    from swarm.testbed.services import TestbedConfig

    lans = ipaddress.ip_network(nat_subnet or TestbedConfig.nat_subnet)
    marks = []
    for address in route:
        try:
            host = ipaddress.ip_address(str(address).rsplit(":", 1)[0].strip("[]"))
        except ValueError:
            return None
        marks.append("N" if host in lans else "R")
    return "-".join(marks) if marks else None


def rounds_of(row: dict) -> list[dict]:
    """A row's rounds (each a row of one run: `mean_step_s`, `step_std_s`, `timed_steps`, `final_loss`,
    `relay_extra_s`); a row of one run is its own only round."""
    return row.get("rounds_data") or [row]


def _paired(base: dict, r: dict) -> list[tuple[dict, dict]]:
    return list(zip(rounds_of(base), rounds_of(r), strict=False))


def combine_rounds(rounds: list[dict[str, dict]], settings: tuple[str, ...]) -> list[dict]:
    """One row per setting from interleaved rounds (each {setting: that run's row}): the first round's fields,
    `mean_step_s` the median of the rounds' means, `step_ratio` the median of the per-round ratios to the same
    round's `reachable` run with `step_ratio_min`/`step_ratio_max`, and every round kept in `rounds_data`."""
    rows = []
    for setting in settings:
        runs = [rd[setting] for rd in rounds if setting in rd]
        row = dict(runs[0])
        timed = [x for x in runs if x.get("mean_step_s")]
        if not timed:
            rows.append(row)
            continue
        row["rounds"] = len(runs)
        row["mean_step_s"] = statistics.median(x["mean_step_s"] for x in timed)
        row["mean_step_s_runs"] = [x["mean_step_s"] for x in timed]
        row["final_loss_runs"] = [x.get("final_loss") for x in runs]
        extras = [x["relay_extra_s"] for x in runs if x.get("relay_extra_s") is not None]
        row["relay_extra_s"] = statistics.median(extras) if extras else None
        ratios = [
            rd[setting]["mean_step_s"] / rd["reachable"]["mean_step_s"]
            for rd in rounds
            if rd.get(setting, {}).get("mean_step_s") and rd.get("reachable", {}).get("mean_step_s")
        ]
        if ratios:
            row["step_ratio"] = statistics.median(ratios)
            row["step_ratio_runs"], row["step_ratio_min"], row["step_ratio_max"] = ratios, min(ratios), max(ratios)
        row["rounds_data"] = [
            {k: x.get(k) for k in ("round", "mean_step_s", "step_std_s", "timed_steps", "final_loss", "relay_extra_s")}
            for x in runs
        ]
        rows.append(row)
    return rows


def check_targets(rows: list[dict]) -> list[tuple[str, bool | None]]:
    """The issue's targets, judged on the rows and, where they carry rounds, on every round paired with the same
    round's reachable run (None: not judged, a setting missing)."""
    by = {r["setting"]: r for r in rows if r.get("final_loss") is not None}
    base = by.get("reachable")
    out: list[tuple[str, bool | None]] = []
    for name in ("half-nat", "relay"):
        r = by.get(name)
        met = None
        if base is not None and r is not None:
            pairs = _paired(base, r)
            met = bool(pairs) and all(x["final_loss"] == b["final_loss"] for b, x in pairs)
        out.append((f"{name}: the same final loss as reachable, to float equality (every round)", met))
    r = by.get("half-nat")
    met, ratio = None, None
    if base is not None and r is not None:
        ratio = statistics.median(x["mean_step_s"] / b["mean_step_s"] for b, x in _paired(base, r))
        met = ratio <= 1 + HALF_NAT_TOLERANCE
    shown = "" if ratio is None else f" (median of the rounds' paired ratios {ratio:.3f})"
    out.append((f"half-nat: mean step within {HALF_NAT_TOLERANCE:.0%} of reachable{shown}", met))
    out.append(_two_legs(base, by.get("relay")))
    return out


def _two_legs(base: dict | None, r: dict | None) -> tuple[str, bool | None]:
    """The two-legs target on the relay runs' own plans (module docstring): the median of the rounds' measured
    extras (relay run minus the same round's reachable run) against the median of their `relay_extra_s`,
    allowing NOISE_STANDARD_ERRORS standard errors of the mean of those extras."""
    name = "relay: the relayed link costs no more than its two legs"
    if base is None or r is None:
        return name, None
    legs = r.get("relay_extra_s")
    if legs is None:
        return f"{name} (its plan carries no relay_extra_s: no relayed link planned)", None
    pairs = _paired(base, r)
    extra = statistics.median(x["mean_step_s"] - b["mean_step_s"] for b, x in pairs)
    ses = [standard_error(x, b) for b, x in pairs]
    se = None if None in ses else sum(e**2 for e in ses) ** 0.5 / len(ses)
    allowed = legs + NOISE_STANDARD_ERRORS * (se or 0.0)
    noise = "no standard error: judged strictly" if se is None else f"± {se:.4f} (standard error)"
    strict = "holds" if extra <= legs else "does not hold"
    return (
        f"{name}: measured extra {extra:.4f} {noise} s/step vs its plan's relay_extra_s {legs:.4f} s/step; met when "
        f"extra <= relay_extra_s + {NOISE_STANDARD_ERRORS:g} standard errors = {allowed:.4f} (strictly extra <= "
        f"relay_extra_s: {strict}; {len(pairs)} round(s))",
        extra <= allowed,
    )


def standard_error(r: dict, base: dict) -> float | None:
    """The standard error of a difference of two rows' mean steps (from their per-step std), or None."""
    try:
        return (r["step_std_s"] ** 2 / r["timed_steps"] + base["step_std_s"] ** 2 / base["timed_steps"]) ** 0.5
    except (KeyError, TypeError, ZeroDivisionError):
        return None


_FLAGS = Flags(NatConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)
    parser.add_argument("--quick", action="store_true", help="fewer steps and samples")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def config_from_args(args: argparse.Namespace) -> NatConfig:
    cfg = _FLAGS.from_args(args)
    if args.quick:
        return replace(cfg, steps=min(cfg.steps, 4), train_samples=min(cfg.train_samples, 16), repeats=1)
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = cfg.out or Path(f"runs/nat-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    supported = reach_supported()
    rounds = []
    for k in range(cfg.repeats):
        here = out if cfg.repeats == 1 else out / f"round{k}"
        done: dict[str, dict] = {}
        for setting in rotated(cfg.settings, k):
            if not supported and (nat := nat_peers(setting, cfg.peers)):  # never run a NAT setting without its flags
                note = "not run: this swarm-peer has no --reach (the relay transport)"
                done[setting] = {"setting": setting, "nat_peers": len(nat), "note": note}
                continue
            print(f"[nat] round {k + 1}/{cfg.repeats}: {setting} ...", file=sys.stderr, flush=True)
            done[setting] = {**run_setting(setting, cfg, here, supported), "round": k}
        rounds.append(done)
    rows = combine_rounds(rounds, cfg.settings)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    targets = check_targets(rows)
    emit(rows, COLUMNS, args.json, f"nat experiment ({cfg.peers} peers, {cfg.steps} steps, {cfg.rate_mbit:g} Mbit/s)")
    if not args.json:
        for statement, met in targets:
            print(f"[{'not judged' if met is None else 'met' if met else 'MISSED'}] {statement}")
        print(f"wrote {out}/results.json, results.csv")
    return 0
