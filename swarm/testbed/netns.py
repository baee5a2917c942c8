"""Network-namespace testbed mechanics: the services, the `ip`/`tc` commands that build their links, a sweep.

Everything is data first: a frozen `TestbedConfig` gives the services (`testbed_services`, the one list
both this testbed and docker/compose.yaml run), a `TestbedPlan` names every namespace, veth and bridge,
and `setup_commands` / `shaping_commands` are plain argv lists, unit-tested without root. A thin runner
executes them. Every name starts with the config's prefix, so `sweep` finds and removes what a testbed
left behind, also after the testbed process itself was killed.

The kernel shapes bandwidth on each namespace's egress (`tbf`, or `htb` with one class per destination
when links differ); one-way delay stays in the peers' application shaper (`swarm-peer --delay-ms`),
because `netem` is missing on this machine kind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "ADDRESS_FILE",
    "BOOTSTRAP_PORT",
    "FALLBACK_HINT",
    "GSO_MAX_BYTES",
    "METRICS_PORT",
    "PEER_PORT",
    "CommandError",
    "LinkRate",
    "Node",
    "Service",
    "SweepReport",
    "TestbedConfig",
    "TestbedPlan",
    "list_links",
    "list_namespaces",
    "measure_rate",
    "namespace_address",
    "namespace_pids",
    "plan_testbed",
    "process_argv",
    "qdisc_stats",
    "run_command",
    "service_addresses",
    "setup_commands",
    "shaped_pair",
    "shaping_commands",
    "sweep",
    "tbf_burst_bytes",
    "tbf_limit_bytes",
    "testbed_services",
    "unavailable_reason",
]

BOOTSTRAP_PORT = 31337
"""DHT port of the bootstrap node: fixed (each namespace or container has its own ports), so with its
identity file its multiaddr survives a restart."""
PEER_PORT = 50051
"""gRPC port of every peer's stage service: fixed, so per-link delays can name `ADDR:PORT` up front."""
METRICS_PORT = 9400
"""Port of every peer's and the trainer's /metrics (each at its own address)."""
ADDRESS_FILE = "bootstrap.addr"
GSO_MAX_BYTES = 16384
"""Largest GSO packet on a shaped interface (see shaping_commands)."""
FALLBACK_HINT = (
    "use the application-level shaper instead, which needs no privileges: "
    "`swarm demo --rate-mbit 10 --delay-ms 20` (or swarm-peer --rate-mbit/--delay-ms/--link)"
)
_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,5}-")
_NAME_RE = re.compile(r"bootstrap|trainer|peer\d+")


@dataclass(frozen=True)
class LinkRate:
    """One directed link shaped differently from its sender's default."""

    src: str
    """Sending service: bootstrap, trainer or peerI."""
    dst: str
    """Receiving service."""
    rate_mbit: float | None = None
    """Bandwidth of this link, Mbit/s (kernel, an htb class on the sender's egress); None keeps the default."""
    delay_ms: float = 0.0
    """One-way delay of this link, ms (the sending peer's application shaper); peers at both ends only."""

    def __post_init__(self) -> None:
        for end in (self.src, self.dst):
            if not _NAME_RE.fullmatch(end):
                raise ValueError(f"LinkRate: {end!r} is not a service (bootstrap, trainer, peerI)")
        if self.src == self.dst:
            raise ValueError(f"LinkRate: {self.src} -> {self.dst} is not a link")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"LinkRate.rate_mbit: expected > 0, got {self.rate_mbit}")
        if self.delay_ms < 0:
            raise ValueError(f"LinkRate.delay_ms: expected >= 0, got {self.delay_ms}")
        if self.delay_ms and not (self.src.startswith("peer") and self.dst.startswith("peer")):
            raise ValueError(f"LinkRate {self.src}:{self.dst}: a per-link delay needs peers at both ends")

    @classmethod
    def parse(cls, text: str) -> LinkRate:
        """`SRC:DST=RATE[:DELAY]`, e.g. `peer0:peer1=10:40`; RATE `none` keeps the sender's default rate."""
        ends, sep, shape = text.partition("=")
        src, colon, dst = ends.partition(":")
        if not sep or not colon:
            raise ValueError(f"link {text!r}: expected SRC:DST=RATE[:DELAY], e.g. peer0:peer1=10:40")
        rate, _, delay = shape.partition(":")
        rate_mbit = None if rate.strip().lower() in ("", "none") else float(rate)
        return cls(src.strip(), dst.strip(), rate_mbit, float(delay) if delay else 0.0)


@dataclass(frozen=True)
class TestbedConfig:
    """A testbed: one DHT bootstrap node, `peers` swarm-peers and a trainer, each in its own namespace."""

    peers: int = 2
    """swarm-peer services, one pipeline stage each."""
    rate_mbit: float = 100.0
    """Egress bandwidth of every namespace, Mbit/s; 0 leaves it unshaped."""
    peer_rate_mbit: tuple[float, ...] = ()
    """Egress bandwidth of peer i (entry i, 0 = unshaped); peers past the end get `rate_mbit`."""
    links: tuple[LinkRate, ...] = ()
    """Directed links shaped differently from their sender's default."""
    delay_ms: float = 0.0
    """One-way delay of every peer's outgoing links, ms, applied by swarm-peer's application shaper."""
    subnet: str = "10.77.0.0/24"
    """Private IPv4 subnet of the bridge; bootstrap .2, trainer .3, peer i .(10+i) (Docker's gateway is .1)."""
    prefix: str = "swt-"
    """Start of every namespace and link name, so `down` finds leftovers; 2-7 characters ending in '-'."""
    fw_codec: str = "aqsgd2"
    """Activation codec of the peers."""
    bw_codec: str = "gradq4"
    """Gradient codec of the peers."""
    layers: int | None = None
    """Transformer blocks (None: the entry points' default; likewise hidden, heads, seq_len)."""
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    epochs: int = 4
    """Passes of the trainer over its samples (ignored when `steps` is set)."""
    steps: int | None = None
    """Optimizer steps of the trainer; None: `epochs` worth."""
    train_samples: int = 64
    """Training samples."""
    batch_size: int = 8
    """Samples per optimizer step."""
    micro_batches: int = 4
    """Micro-batches per step."""
    peer_flags: tuple[str, ...] = ()
    """Extra flags for every swarm-peer, verbatim (checked against swarm-peer's parser by the tests)."""
    trainer_flags: tuple[str, ...] = ()
    """Extra flags for `swarm train`, verbatim."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_rate_mbit", tuple(float(r) for r in self.peer_rate_mbit))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "peer_flags", tuple(self.peer_flags))
        object.__setattr__(self, "trainer_flags", tuple(self.trainer_flags))
        if not 1 <= self.peers <= 200:
            raise ValueError(f"TestbedConfig.peers: expected 1-200, got {self.peers}")
        if len(self.peer_rate_mbit) > self.peers:
            raise ValueError(f"TestbedConfig.peer_rate_mbit: {len(self.peer_rate_mbit)} rates for {self.peers} peers")
        if self.rate_mbit < 0 or any(r < 0 for r in self.peer_rate_mbit) or self.delay_ms < 0:
            raise ValueError("TestbedConfig: rates and delay must be >= 0")
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"TestbedConfig.prefix: expected [a-z][a-z0-9]{{0,5}}- (e.g. 'swt-'), got {self.prefix!r}")
        net = ipaddress.ip_network(self.subnet)  # raises ValueError on junk
        if net.version != 4 or not net.is_private:
            raise ValueError(f"TestbedConfig.subnet: expected a private IPv4 subnet, got {self.subnet}")
        if net.num_addresses < 12 + self.peers:
            raise ValueError(f"TestbedConfig.subnet: {self.subnet} is too small for {self.peers} peers")
        names = set(service_addresses(self))
        for link in self.links:
            if link.src not in names or link.dst not in names:
                raise ValueError(f"TestbedConfig.links: {link.src}:{link.dst} names a service that does not exist")
        for name in ("epochs", "train_samples", "batch_size", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"TestbedConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.train_samples < self.batch_size:
            raise ValueError("TestbedConfig.train_samples: fewer samples than one batch")

    @property
    def total_steps(self) -> int:
        return self.steps or self.epochs * (self.train_samples // self.batch_size)

    def model_flags(self) -> tuple[str, ...]:
        given = {"--layers": self.layers, "--hidden": self.hidden, "--heads": self.heads, "--seq-len": self.seq_len}
        return tuple(x for flag, value in given.items() if value is not None for x in (flag, str(value)))

    def egress_mbit(self, name: str) -> float | None:
        """Default egress bandwidth of a service, Mbit/s; None when unshaped."""
        rate = self.rate_mbit
        if name.startswith("peer") and int(name[4:]) < len(self.peer_rate_mbit):
            rate = self.peer_rate_mbit[int(name[4:])]
        return rate or None


@dataclass(frozen=True)
class Service:
    """One process of the testbed, as both the namespace testbed and docker compose run it."""

    name: str
    """bootstrap, peerI or trainer."""
    address: str
    """Its IPv4 address in the subnet (the namespace's or the container's)."""
    argv: tuple[str, ...]
    """Installed entry point and flags: ('swarm', 'bootstrap', ...), ('swarm-peer', ...), ('swarm', 'train', ...)."""
    rate_mbit: float | None
    """Default egress bandwidth, Mbit/s (None: unshaped)."""
    link_rate_mbit: tuple[tuple[str, float], ...] = ()
    """Egress bandwidth to particular destination addresses, Mbit/s."""


def service_addresses(cfg: TestbedConfig) -> dict[str, str]:
    """Service name -> address, in start order (bootstrap, peers, trainer)."""
    net = ipaddress.ip_network(cfg.subnet)
    names = {"bootstrap": 2, **{f"peer{i}": 10 + i for i in range(cfg.peers)}, "trainer": 3}
    return {name: str(net.network_address + offset) for name, offset in names.items()}


def testbed_services(cfg: TestbedConfig, shared_dir: str) -> list[Service]:
    """Every service of the testbed with its argv; `shared_dir` holds the address file and outputs
    (the run directory here, the shared volume in docker compose)."""
    addresses = service_addresses(cfg)
    address_file = f"{shared_dir}/{ADDRESS_FILE}"
    total = cfg.total_steps
    services = []
    for name, address in addresses.items():
        if name == "bootstrap":
            argv = [
                "swarm", "bootstrap", "--address-file", address_file, "--host", address,
                "--port", str(BOOTSTRAP_PORT), "--identity-path", f"{shared_dir}/bootstrap.id",
            ]  # fmt: skip
        elif name == "trainer":
            argv = [
                "swarm", "train", "--address-file", address_file, "--num-stages", str(cfg.peers), "--host", address,
                "--epochs", str(cfg.epochs), "--train-samples", str(cfg.train_samples),
                "--batch-size", str(cfg.batch_size), "--micro-batches", str(cfg.micro_batches),
                "--out", f"{shared_dir}/train", "--metrics-port", str(METRICS_PORT),
                *cfg.model_flags(), *cfg.trainer_flags,
            ]  # fmt: skip
            if cfg.steps:
                argv += ["--steps", str(cfg.steps)]
        else:
            argv = [
                "swarm-peer", "--address-file", address_file, "--num-stages", str(cfg.peers), "--host", address,
                "--grpc-port", str(PEER_PORT), "--fw-codec", cfg.fw_codec, "--bw-codec", cfg.bw_codec,
                "--total-steps", str(total), "--warmup-steps", str(max(1, total // 10)),
                "--checkpoint-dir", f"{shared_dir}/checkpoints", "--metrics-port", str(METRICS_PORT),
                *cfg.model_flags(), *cfg.peer_flags,
            ]  # fmt: skip
            for link in cfg.links:
                if link.src == name and link.delay_ms:
                    argv += ["--link", f"{addresses[link.dst]}:{PEER_PORT}=none:{link.delay_ms:g}"]
            if cfg.delay_ms:
                argv += ["--delay-ms", f"{cfg.delay_ms:g}"]
        per_link = tuple(
            (addresses[link.dst], link.rate_mbit) for link in cfg.links if link.src == name and link.rate_mbit
        )
        services.append(Service(name, address, tuple(argv), cfg.egress_mbit(name), per_link))
    return services


@dataclass(frozen=True)
class Node:
    """A service placed in its namespace: veth `veth_root` on the bridge, `veth_ns` inside the namespace."""

    service: Service
    namespace: str
    veth_root: str
    veth_ns: str


@dataclass(frozen=True)
class TestbedPlan:
    config: TestbedConfig
    bridge: str
    prefix_len: int
    nodes: tuple[Node, ...] = field(default=())

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.service.name == name)


def plan_testbed(cfg: TestbedConfig, shared_dir: str) -> TestbedPlan:
    nodes = tuple(
        Node(service, f"{cfg.prefix}{service.name}", f"{cfg.prefix}{i}a", f"{cfg.prefix}{i}b")
        for i, service in enumerate(testbed_services(cfg, shared_dir))
    )
    return TestbedPlan(cfg, f"{cfg.prefix}br0", ipaddress.ip_network(cfg.subnet).prefixlen, nodes)


def setup_commands(plan: TestbedPlan) -> list[list[str]]:
    """Bridge, then per node: namespace, veth pair (one end on the bridge), loopback, address, shaping.
    The root side gets no IPv6 link-local address, so the host itself never talks on the bridge."""
    br = plan.bridge
    commands = [
        ["ip", "link", "add", br, "type", "bridge"],
        ["ip", "link", "set", br, "addrgenmode", "none"],
        ["ip", "link", "set", br, "up"],
    ]
    for node in plan.nodes:
        ns, a, b = node.namespace, node.veth_root, node.veth_ns
        commands += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns],
            ["ip", "link", "set", a, "addrgenmode", "none"],
            ["ip", "link", "set", a, "master", br, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{node.service.address}/{plan.prefix_len}", "dev", b],
            ["ip", "-n", ns, "link", "set", b, "up"],
        ]
        commands += shaping_commands(b, node.service.rate_mbit, node.service.link_rate_mbit, netns=ns)
    return commands


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Bucket size: 4 ms at the rate (a timer tick or two, so high rates are reachable), at least 10 frames."""
    return max(15140, int(rate_mbit * 1e6 / 8 * 0.004))


def tbf_limit_bytes(rate_mbit: float) -> int:
    """Queue size: 50 ms at the rate, at least 256 KiB. TCP small queues lets a local sender keep about two
    64 KiB GSO packets in the qdisc; a shorter queue drops them over and over, and the bursty recovery
    costs up to a fifth of the rate (measured: 0.80-0.97 of it at 10 Mbit/s with a 77 KB queue, a steady
    0.956, the TCP payload share, with 256 KiB)."""
    return max(256 * 1024, int(rate_mbit * 1e6 / 8 * 0.05))


def shaping_commands(
    dev: str, rate_mbit: float | None, link_rate_mbit: tuple[tuple[str, float], ...] = (), netns: str | None = None
) -> list[list[str]]:
    """Commands shaping the egress of `dev`: nothing when unshaped, `tbf` for one rate, `htb` with a class
    and a u32 filter per destination address when links differ (other traffic: the default rate, or
    unshaped when there is none). `swarm testbed shape` runs exactly these in docker's entrypoint.

    First, GSO packets are capped at 16 KiB: htb (unlike tbf) does not split them, and with 64 KiB ones a
    10 Mbit/s class carried 0.90-0.95 of the rate instead of 0.956 (the TCP payload share); at 4 KiB the
    1 Gbit/s links start to cost the 2 cores more than they carry."""
    if not rate_mbit and not link_rate_mbit:
        return []
    ip, tc = (["ip", "-n", netns], ["tc", "-n", netns]) if netns else (["ip"], ["tc"])
    commands = [[*ip, "link", "set", "dev", dev, "gso_max_size", str(GSO_MAX_BYTES)]]
    if not link_rate_mbit:
        return commands + [
            [*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
             "burst", str(tbf_burst_bytes(rate_mbit)), "limit", str(tbf_limit_bytes(rate_mbit))],
        ]  # fmt: skip
    commands.append([*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default"])
    commands[-1].append("1" if rate_mbit else "0")  # 0: unclassified traffic passes unshaped

    def add_class(classid: str, rate: float) -> None:
        burst = str(tbf_burst_bytes(rate))
        quantum = str(min(200_000, max(1514, int(rate * 1e6 / 8 / 100))))
        commands.append(
            [*tc, "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb", "rate", f"{rate:g}mbit",
             "burst", burst, "cburst", burst, "quantum", quantum]
        )  # fmt: skip

    if rate_mbit:
        add_class("1:1", rate_mbit)
    for i, (address, rate) in enumerate(link_rate_mbit):
        classid = f"1:{0x10 + i:x}"
        add_class(classid, rate)
        commands.append(
            [*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "dst", f"{address}/32", "flowid", classid]
        )  # fmt: skip
    return commands


def process_argv(argv: tuple[str, ...] | list[str], python: str = sys.executable) -> list[str]:
    """An installed entry point's argv as this interpreter runs it (no reliance on PATH)."""
    modules = {"swarm": "swarm.cli", "swarm-peer": "swarm.daemon.peer"}
    if argv[0] not in modules:
        raise ValueError(f"{argv[0]!r} is not a swarm entry point")
    return [python, "-m", modules[argv[0]], *argv[1:]]


# ---- running commands -------------------------------------------------------------------------------------


class CommandError(RuntimeError):
    pass


def run_command(argv: list[str], timeout_s: float = 15.0, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CommandError(f"{' '.join(argv)}: {e}") from None
    if check and result.returncode:
        raise CommandError(f"{' '.join(argv)}: {result.stderr.strip() or f'exit code {result.returncode}'}")
    return result


def unavailable_reason() -> str | None:
    """Why namespaces can't be used here (not root, no iproute2, no `ip netns`), or None."""
    if os.geteuid() != 0:
        return "the namespace testbed needs root (network namespaces, veth, bridges and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    try:
        run_command(["ip", "netns", "list"])
    except CommandError as e:
        return f"`ip netns` does not work here: {e}"
    return None


def list_namespaces(prefix: str) -> list[str]:
    out = run_command(["ip", "netns", "list"]).stdout
    return sorted(name for line in out.splitlines() if (name := line.split(" ", 1)[0]).startswith(prefix))


def list_links(prefix: str) -> list[str]:
    """Links of the root namespace named with `prefix` (`ip -o link` prints `5: swt-0a@if4: ...`)."""
    out = run_command(["ip", "-o", "link", "show"]).stdout
    names = (line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines() if ":" in line)
    return sorted(name for name in names if name.startswith(prefix))


def namespace_pids(namespace: str) -> list[int]:
    result = run_command(["ip", "netns", "pids", namespace], check=False)
    return sorted(int(p) for p in result.stdout.split() if p.isdigit())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@dataclass(frozen=True)
class SweepReport:
    pids: tuple[int, ...]
    namespaces: tuple[str, ...]
    links: tuple[str, ...]


def sweep(prefix: str, grace_s: float = 10.0, say: Callable[[str], None] = lambda _: None) -> SweepReport:
    """Stops every process in a namespace named with `prefix` (SIGTERM, then SIGKILL after `grace_s`),
    deletes those namespaces and every root-namespace link with the prefix. Needs no state file."""
    namespaces = list_namespaces(prefix)
    pids = sorted({pid for ns in namespaces for pid in namespace_pids(ns)})
    if pids:
        say(f"stopping {len(pids)} processes in {len(namespaces)} namespaces")
        _signal(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
    for _ in range(3):  # children forked meanwhile (hivemind's p2pd) are in the namespaces too
        rest = sorted({pid for ns in namespaces for pid in namespace_pids(ns)})
        if not rest:
            break
        _signal(rest, signal.SIGKILL)
        pids = sorted({*pids, *rest})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in rest):
            time.sleep(0.05)
    for ns in namespaces:
        run_command(["ip", "netns", "del", ns], check=False)
    links = list_links(prefix)
    for link in links:  # the bridge; veth ends went with their namespaces
        run_command(["ip", "link", "del", link], check=False)
    left = list_namespaces(prefix) + list_links(prefix)
    if left:
        raise CommandError(f"could not remove {', '.join(left)}")
    return SweepReport(tuple(pids), tuple(namespaces), tuple(links))


def qdisc_stats(namespace: str, dev: str) -> dict | None:
    """The root qdisc of `dev` in `namespace` with its counters (kind, bytes, packets, drops), or None."""
    result = run_command(["tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", dev], check=False)
    try:
        qdiscs = json.loads(result.stdout or "[]")
    except json.JSONDecodeError:
        return None
    return next((q for q in qdiscs if q.get("root")), None)


# ---- measuring a shaped link ------------------------------------------------------------------------------

_RECEIVER = """
import socket, sys, time
host, nbytes, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
server = socket.create_server((host, 0))
server.settimeout(timeout)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.settimeout(timeout)
got, n_mark, t_mark = 0, 0, 0.0
while got < nbytes:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    got += len(chunk)
    if not t_mark and got >= nbytes // 4:
        n_mark, t_mark = got, time.perf_counter()
print(got, n_mark, t_mark, time.perf_counter(), flush=True)
"""
_SENDER = """
import socket, sys
host, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
block = memoryview(bytes(1 << 16))
with socket.create_connection((host, port), timeout=timeout) as s:
    left = nbytes
    while left > 0:
        s.sendall(block[: min(left, len(block))])
        left -= len(block)
"""


def namespace_address(namespace: str) -> str:
    out = run_command(["ip", "-n", namespace, "-o", "-4", "addr", "show", "scope", "global"]).stdout
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    if match is None:
        raise CommandError(f"namespace {namespace} has no IPv4 address")
    return match.group(1)


def measure_rate(ns_a: str, ns_b: str, nbytes: int = 2_000_000, timeout_s: float = 30.0) -> float:
    """TCP goodput from namespace `ns_a` to `ns_b`, bytes/s: `nbytes` sent once, timed at the receiver over
    the last three quarters (past the bucket's burst and slow start). Payload only, so a link shaped to R
    carries about 0.96 R of it (Ethernet, IP and TCP headers take the rest of each 1514-byte frame)."""
    host = namespace_address(ns_b)
    python = [sys.executable, "-I", "-c"]
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", ns_b, *python, _RECEIVER, host, str(nbytes), str(timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        ready, _, _ = select.select([receiver.stdout], [], [], timeout_s)
        port = receiver.stdout.readline().strip() if ready else ""
        if not port.isdigit():
            raise CommandError(f"rate receiver in {ns_b} did not start: {receiver.stderr.read() if not ready else ''}")
        send = run_command(
            ["ip", "netns", "exec", ns_a, *python, _SENDER, host, port, str(nbytes), str(timeout_s)], timeout_s
        )
        del send
        out, err = receiver.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CommandError(f"rate measurement {ns_a} -> {ns_b} took over {timeout_s:.0f} s") from None
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(5)
    fields = out.split()
    if receiver.returncode or len(fields) != 4 or int(fields[0]) < nbytes:
        raise CommandError(f"rate measurement {ns_a} -> {ns_b} failed: {err.strip() or out.strip()}")
    got, n_mark, t_mark, t_end = int(fields[0]), int(fields[1]), float(fields[2]), float(fields[3])
    return (got - n_mark) / max(t_end - t_mark, 1e-9)


@contextlib.contextmanager
def shaped_pair(
    rate_mbit: float | None, prefix: str = "swt-", subnet: str = "10.77.254.0/30", qdisc: str = "tbf"
) -> Iterator[tuple[str, str]]:
    """Two namespaces `<prefix>rate-a` and `<prefix>rate-b` joined by one veth pair, a's egress shaped like a
    testbed link (`tbf`, or `htb` as for a per-link rate); yields their names, deletes both after (a `sweep`
    of the prefix also finds them)."""
    if qdisc not in ("tbf", "htb"):
        raise ValueError(f"shaped_pair: qdisc must be tbf or htb, got {qdisc!r}")
    a, b = f"{prefix}rate-a", f"{prefix}rate-b"
    net = ipaddress.ip_network(subnet)
    if net.num_addresses < 4 or not net.is_private:
        raise ValueError(f"shaped_pair: expected a private subnet of 4+ addresses, got {subnet}")
    addr_a, addr_b = (f"{net.network_address + i}/{net.prefixlen}" for i in (1, 2))
    commands = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "-n", a, "link", "add", f"{prefix}ra", "type", "veth", "peer", "name", f"{prefix}rb", "netns", b],
        *(["ip", "-n", ns, "link", "set", "lo", "up"] for ns in (a, b)),
        ["ip", "-n", a, "addr", "add", addr_a, "dev", f"{prefix}ra"],
        ["ip", "-n", b, "addr", "add", addr_b, "dev", f"{prefix}rb"],
        ["ip", "-n", a, "link", "set", f"{prefix}ra", "up"],
        ["ip", "-n", b, "link", "set", f"{prefix}rb", "up"],
        *(
            shaping_commands(f"{prefix}ra", None, ((addr_b.split("/")[0], rate_mbit),), netns=a)
            if qdisc == "htb" and rate_mbit
            else shaping_commands(f"{prefix}ra", rate_mbit, netns=a)
        ),
    ]
    try:
        for command in commands:
            run_command(command)
        yield a, b
    finally:
        for ns in (a, b):
            for pid in namespace_pids(ns):
                _signal([pid], signal.SIGKILL)
            run_command(["ip", "netns", "del", ns], check=False)
