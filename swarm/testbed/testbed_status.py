"""What `swarm testbed status` shows: the testbed's namespaces, addresses, shaping with byte counts, processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from swarm.testbed.lifecycle import read_state
from swarm.testbed.netns import list_links, list_namespaces, namespace_pids, qdisc_stats, run_command
from swarm.testbed.services import TestbedConfig, metrics_port

__all__ = ["collect_status", "metrics_url", "render_status"]


def collect_status(run_dir: Path, prefix: str | None) -> dict:
    """The testbed as the kernel and the state file show it, as one JSON object (`status --json`)."""
    state = read_state(run_dir) or {}
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
                "metrics_url": metrics_url(node),
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


def render_status(status: dict) -> str:
    """`collect_status`'s object as a table with a few lines after it."""
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


def metrics_url(node: dict) -> str | None:
    """Where a testbed service serves /metrics (None: it does not)."""
    port = metrics_port(node.get("argv", ()))
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
