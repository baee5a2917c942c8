"""The namespace testbed's lifecycle: bring it up, train in it, take it down, with a state file in between.

`bring_up` builds the bridge and one namespace per service, shapes each namespace's egress with tc,
starts the services inside (logs in the run directory) and waits until every stage is announced in the
DHT. `take_down` stops every process and removes every namespace and link, also after a crash of
`bring_up` itself: it sweeps everything named with the prefix, and the state file says which `up`
process to stop first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.testbed.nat_routers import nat_unavailable_reason
from swarm.testbed.netns import (
    TestbedLayout,
    Unavailable,
    check_available,
    lay_out_testbed,
    list_links,
    list_namespaces,
    run_command,
    setup_commands,
    sweep,
)
from swarm.testbed.services import ADDRESS_FILE, TestbedConfig, process_argv

if TYPE_CHECKING:
    from swarm.testbed.procs import ProcessGroup

__all__ = ["Testbed", "bring_up", "read_state", "take_down", "train_in"]

_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Testbed:
    layout: TestbedLayout
    run_dir: Path
    procs: ProcessGroup
    """The services' processes: they run on when `up` returns; `down` finds them by namespace."""


def _state_path(run_dir: Path) -> Path:
    return run_dir / "state.json"


def _write_state(run_dir: Path, layout: TestbedLayout, pids: dict[str, int]) -> None:
    state = {
        "prefix": layout.config.prefix,
        "subnet": layout.config.subnet,
        "bridge": layout.bridge,
        "testbed_pid": os.getpid(),
        "started_at": time.time(),
        "config": asdict(layout.config),
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
            for n in layout.nodes
        ],
    }
    tmp = _state_path(run_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(_state_path(run_dir))


def read_state(run_dir: Path) -> dict | None:
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

    check_available()
    if cfg.nat and (reason := nat_unavailable_reason()):
        raise Unavailable(reason)
    if list_namespaces(cfg.prefix) or list_links(cfg.prefix):
        raise RuntimeError(f"a testbed with prefix {cfg.prefix!r} is already up: `swarm testbed down` first")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ADDRESS_FILE).unlink(missing_ok=True)
    layout = lay_out_testbed(cfg, str(run_dir))
    _write_state(run_dir, layout, {})  # before anything exists: a crash from here on leaves a findable trail
    procs = ProcessGroup(run_dir / "logs")
    try:
        say(f"creating {len(layout.nodes)} namespaces on bridge {layout.bridge} ({cfg.subnet})")
        for command in setup_commands(layout):
            run_command(command)
        pids = {}
        for node in layout.nodes[:-1]:  # every service but the trainer
            argv = ["ip", "netns", "exec", node.namespace, *process_argv(node.service.argv)]
            pids[node.service.name] = procs.start(node.service.name, argv, env=_ENV).pid
            _write_state(run_dir, layout, pids)
            if node.service.name == "bootstrap":
                procs.wait_for_file(run_dir / ADDRESS_FILE, 60)
                say(f"bootstrap node up at {node.service.address}; starting {cfg.peers} peers")
        _wait_for_stages(layout, run_dir, procs, ready_timeout_s, say)
        return Testbed(layout, run_dir, procs)
    except BaseException:
        say("start failed: taking down what was made")
        sweep(cfg.prefix, grace_s=5)
        _state_path(run_dir).unlink(missing_ok=True)
        raise


def _wait_for_stages(layout: TestbedLayout, run_dir: Path, procs, timeout_s: float, say) -> None:
    """Asks the DHT from the trainer's namespace (`swarm status`) until every stage is announced, so the
    check crosses the bridge exactly as the trainer will."""
    from swarm.daemon.status import status_argv

    trainer = layout.node("trainer")
    status = status_argv(str(run_dir / ADDRESS_FILE), trainer.service.address, timeout_s=15.0)
    argv = ["ip", "netns", "exec", trainer.namespace, *process_argv(("swarm", "status", *status))]
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        procs.check_alive()
        result = run_command(argv, timeout_s=180, check=False)  # a loaded machine starts python slowly
        try:
            peers = json.loads(result.stdout)["peers"] if result.returncode == 0 else []
        except (json.JSONDecodeError, KeyError):
            peers = []
        stages = sorted({p["stage"] for p in peers if p.get("stage") is not None})
        line = f"{len(stages)}/{layout.config.peers} stages announced"
        if line != last:
            say(line)
            last = line
        if len(stages) >= layout.config.peers:
            (run_dir / "dht_status.json").write_text(result.stdout)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {line} after {timeout_s:.0f} s (logs in {run_dir / 'logs'})")
        time.sleep(1.0)


def train_in(testbed: Testbed, timeout_s: float, say: Callable[[str], None] = print) -> int:
    """Runs the trainer in its namespace until it exits; returns its exit code."""
    node = testbed.layout.node("trainer")
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
    state = read_state(run_dir) or {}
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
