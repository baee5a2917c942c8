"""Network-namespace testbed mechanics: the namespaces and links of the services, the `ip`/`tc` commands that
build and shape them, a thin runner, a sweep, and a goodput check of a shaped link.

Everything is data first: a `TestbedLayout` names every namespace, veth and bridge for the services of a
`TestbedConfig` (`swarm.testbed.services`), and `setup_commands` / `shaping_commands` are plain argv lists,
unit-tested without root. A thin runner executes them. Every name starts with the config's prefix, so `sweep`
finds and removes what a testbed left behind, also after the testbed process itself was killed.

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

from swarm.peers.shaper import default_burst_bytes
from swarm.testbed.firewall import accept_bridge_commands, iptables_available, remove_rule_commands
from swarm.testbed.nat_routers import nat_node_commands, router_commands
from swarm.testbed.services import Service, TestbedConfig, nat_names, testbed_services

__all__ = [
    "FALLBACK_HINT",
    "GSO_MAX_BYTES",
    "CommandError",
    "Node",
    "SweepReport",
    "TestbedLayout",
    "Unavailable",
    "check_available",
    "list_links",
    "list_namespaces",
    "measure_rate",
    "namespace_address",
    "namespace_pids",
    "lay_out_testbed",
    "qdisc_stats",
    "run_command",
    "setup_commands",
    "shaped_pair",
    "shaping_commands",
    "sweep",
    "tbf_burst_bytes",
    "tbf_limit_bytes",
    "unavailable_reason",
]

GSO_MAX_BYTES = 16384
"""Largest GSO packet on a shaped interface (see shaping_commands)."""
FALLBACK_HINT = (
    "use the application-level shaper instead, which needs no privileges: "
    "`swarm demo --rate-mbit 10 --delay-ms 20` (or swarm-peer --rate-mbit/--delay-ms/--link)"
)


@dataclass(frozen=True)
class Node:
    """A service placed in its namespace: veth `veth_root` on the bridge, `veth_ns` inside the namespace."""

    service: Service
    namespace: str
    veth_root: str
    veth_ns: str


@dataclass(frozen=True)
class TestbedLayout:
    config: TestbedConfig
    bridge: str
    prefix_len: int
    nodes: tuple[Node, ...] = field(default=())

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.service.name == name)


def lay_out_testbed(cfg: TestbedConfig, shared_dir: str) -> TestbedLayout:
    nodes = tuple(
        Node(service, f"{cfg.prefix}{service.name}", f"{cfg.prefix}{i}a", f"{cfg.prefix}{i}b")
        for i, service in enumerate(testbed_services(cfg, shared_dir))
    )
    return TestbedLayout(cfg, f"{cfg.prefix}br0", ipaddress.ip_network(cfg.subnet).prefixlen, nodes)


def setup_commands(layout: TestbedLayout, iptables: bool | None = None) -> list[list[str]]:
    """Bridge, then per node: namespace, veth pair (one end on the bridge), loopback, address, shaping.
    With NAT'd peers, first the NAT router, and those peers' veths end on its LAN (`swarm.testbed.nat_routers`).
    The root side gets no IPv6 link-local address, so the host itself never talks on the bridge. With
    `iptables` (None: where the host has it), an ACCEPT rule for the bridge's own traffic comes right after
    the bridge, so a docker engine's FORWARD DROP policy does not cut it (`swarm.testbed.firewall`)."""
    br = layout.bridge
    commands = [
        ["ip", "link", "add", br, "type", "bridge"],
        ["ip", "link", "set", br, "addrgenmode", "none"],
        ["ip", "link", "set", br, "up"],
    ]
    if iptables is None:
        iptables = iptables_available()
    if iptables:
        commands += accept_bridge_commands(br)
    behind_nat = nat_names(layout.config)
    if behind_nat:
        commands += router_commands(layout)
    for node in layout.nodes:
        ns, a, b = node.namespace, node.veth_root, node.veth_ns
        if node.service.name in behind_nat:
            commands += nat_node_commands(layout, node)
            commands += shaping_commands(b, node.service.rate_mbit, node.service.link_rate_mbit, netns=ns)
            continue
        commands += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns],
            ["ip", "link", "set", a, "addrgenmode", "none"],
            ["ip", "link", "set", a, "master", br, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{node.service.address}/{layout.prefix_len}", "dev", b],
            ["ip", "-n", ns, "link", "set", b, "up"],
        ]
        commands += shaping_commands(b, node.service.rate_mbit, node.service.link_rate_mbit, netns=ns)
    return commands


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Bucket size: the application shaper's rule (`peers.shaper.default_burst_bytes`), so both testbeds' links
    hold the same credit."""
    return default_burst_bytes(rate_mbit * 1e6 / 8)


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


class Unavailable(RuntimeError):
    """No root or no `ip netns` here."""


def check_available() -> None:
    """Raises `Unavailable` with the reason when namespaces can't be used here."""
    reason = unavailable_reason()
    if reason:
        raise Unavailable(reason)


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
    deletes those namespaces, every root-namespace link with the prefix and every FORWARD rule the testbed
    added for such a bridge. Needs no state file."""
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
    for command in _forward_rule_removals(prefix):
        run_command(command, check=False)
    left = list_namespaces(prefix) + list_links(prefix) + [" ".join(c) for c in _forward_rule_removals(prefix)]
    if left:
        raise CommandError(f"could not remove {', '.join(left)}")
    return SweepReport(tuple(pids), tuple(namespaces), tuple(links))


def _forward_rule_removals(prefix: str) -> list[list[str]]:
    """Commands deleting the FORWARD rules the testbeds of `prefix` added (none without iptables)."""
    if not iptables_available():
        return []
    return remove_rule_commands(run_command(["iptables", "-w", "5", "-S", "FORWARD"], check=False).stdout, prefix)


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
