"""What `swarm experiment nat --netns` reads from a namespace testbed before it goes down: the relays' bytes per
link (each peer's /metrics, read in its namespace: the host has no address on the bridge), each peer process's CPU
seconds (/proc), and with `--ping N` per-call latencies (`swarm.experiments.nat_ping`, run in the trainer's
namespace and in each relay's)."""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

from swarm.experiments.nat import relayed_by_link, relayed_connections_of

__all__ = ["names_of_ids", "ping_targets", "probe", "process_cpu_s", "relayed_by_link", "relayed_connections_of"]

_READ_METRICS = (
    "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
)


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds a live process has used so far (/proc/<pid>/stat), or None."""
    import os

    try:
        fields = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


_ID_LINES = (re.compile(r"joined the DHT as ([0-9a-f]{8,64})"), re.compile(r"trainer ([0-9a-f]{8,64}) announced"))


def names_of_ids(logs: Path) -> dict[str, str]:
    """Peer id -> the testbed's service name ("peer1", "trainer"), from the first lines of each one's log."""
    out = {}
    for log in sorted(logs.glob("*.log")):
        with contextlib.suppress(OSError), open(log, errors="replace") as f:
            head = f.read(1 << 16)
        for pattern in _ID_LINES:
            if m := pattern.search(head):
                out[m.group(1)] = log.stem
                break
    return out


_RELAY_LINE = re.compile(r"attached to relay ([0-9a-f]{8,64}) at (\S+)")


def ping_targets(testbed, names: dict[str, str]) -> list[dict]:
    """What `swarm.experiments.nat_ping` pings: every peer's stage, and for a NAT'd one the relay it attached to
    last (from its log)."""
    from swarm.testbed.services import PEER_PORT

    ids = {name: peer_id for peer_id, name in names.items()}
    targets = []
    for node in testbed.layout.nodes:
        name = node.service.name
        if not name.startswith("peer") or name not in ids:
            continue
        target = {"name": name, "address": f"{node.service.address}:{PEER_PORT}", "peer_id": ids[name]}
        with contextlib.suppress(OSError):
            log = (Path(testbed.run_dir) / "logs" / f"{name}.log").read_text(errors="replace")
            if found := _RELAY_LINE.findall(log):
                relay_id, relay_address = found[-1]
                target |= {"relay_id": relay_id, "relay_address": relay_address, "relay_name": names.get(relay_id)}
        targets.append(target)
    return targets


def _ping_ns(testbed, names: dict[str, str], calls: int) -> dict:
    """Per-call latency (`nat_ping`) from the trainer's namespace to every stage, and from each relay's namespace
    to the peers it relays and to one reachable peer."""
    import subprocess

    targets = ping_targets(testbed, names)
    relays = sorted({t["relay_name"] for t in targets if t.get("relay_name")})
    direct = [t for t in targets if not t.get("relay_id")]
    out = {}
    for source in ["trainer", *relays]:
        mine = targets if source == "trainer" else [t for t in targets if t.get("relay_name") == source]
        mine += [] if source == "trainer" else [t for t in direct if t["name"] != source][:1]
        node = testbed.layout.node(source)
        argv = ["ip", "netns", "exec", node.namespace, sys.executable, "-m", "swarm.experiments.nat_ping"]
        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
            done = subprocess.run([*argv, str(calls), json.dumps(mine)], capture_output=True, text=True, timeout=120)
            out[f"from {source}"] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def probe(testbed, ping: int = 0) -> dict:
    """What the peers of a namespace testbed measured, read before it goes down: `relayed_bytes` (summed),
    `relayed_by_link` (per "<relay>:<src>-><dst>"; read in each peer's namespace: the host has no address on
    the bridge; a NAT'd peer relays for nobody), `relayed_connections` (by path: "data-port" or "frames"), and
    `peer_cpu_s` (each peer process's CPU seconds so far, from /proc: what relaying costs shows as the difference
    to the all-reachable run)."""
    import subprocess

    from swarm.testbed.lifecycle import read_state
    from swarm.testbed.services import METRICS_PORT

    pids = {n.get("name"): n.get("pid") for n in (read_state(testbed.run_dir) or {}).get("nodes", [])}
    names = names_of_ids(Path(testbed.run_dir) / "logs")
    total, links, cpu, conns = 0, {}, {}, {}
    for node in testbed.layout.nodes:
        name = node.service.name
        if not name.startswith("peer"):
            continue
        cpu[name] = process_cpu_s(pids.get(name))
        url = f"http://{node.service.address}:{METRICS_PORT}/metrics"
        argv = ["ip", "netns", "exec", node.namespace, sys.executable, "-c", _READ_METRICS, url]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
            by_link = relayed_by_link(done.stdout)
            for path, n in relayed_connections_of(done.stdout).items():
                conns[path] = conns.get(path, 0) + n
            total += sum(by_link.values())
            for link, n in by_link.items():
                src, _, dst = link.partition("->")
                links[f"{name}:{names.get(src, src)}->{names.get(dst, dst)}"] = n
    found = {"relayed_bytes": total, "relayed_by_link": links, "peer_cpu_s": cpu, "relayed_connections": conns}
    return found | ({"ping_ms": _ping_ns(testbed, names, ping)} if ping else {})
