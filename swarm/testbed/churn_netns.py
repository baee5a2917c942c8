"""A churn run's processes in the namespace testbed: one network namespace per process, kernel-shaped links.

The namespace testbed (swarm.testbed.netns) lays out a fixed set of services; churn adds peers while it
runs, so `NetnsPlacement` makes namespaces for every peer that may join up front (peer0..peerN-1 beside
bootstrap and trainer), runs each process in its own (`ip netns exec NS ... --host ADDR`), and asks the
DHT from the trainer's namespace, which this process cannot reach, with `swarm status --json`. Leaving the
`with` block removes every namespace and link it made (swarm.testbed.netns.sweep).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from swarm.testbed.netns import (
    check_available,
    lay_out_testbed,
    list_links,
    list_namespaces,
    run_command,
    setup_commands,
)
from swarm.testbed.netns import sweep as sweep_namespaces
from swarm.testbed.services import ADDRESS_FILE, Egress, TestbedConfig

__all__ = ["NetnsPlacement"]

PREFIX = "swc-"
"""Names of the churn testbed's namespaces and links (apart from `swarm testbed`'s swt-)."""
SUBNET = "10.79.0.0/24"


class NetnsPlacement:
    """Namespaces for bootstrap, trainer and `max_peers` peers, made on enter and removed on exit."""

    def __init__(self, run_dir: Path, max_peers: int, rate_mbit: float = 1000.0, say: Callable[[str], None] = print):
        self.run_dir, self.say = run_dir.resolve(), say
        cfg = TestbedConfig(peers=max_peers, egress=Egress(rate_mbit), prefix=PREFIX, subnet=SUBNET)
        self.layout = lay_out_testbed(cfg, str(self.run_dir))

    def __enter__(self) -> NetnsPlacement:
        check_available()
        if list_namespaces(PREFIX) or list_links(PREFIX):
            raise RuntimeError(f"namespaces or links named {PREFIX}* exist: another churn run, or a crashed one")
        self.say(f"creating {len(self.layout.nodes)} namespaces ({SUBNET})")
        try:
            for command in setup_commands(self.layout):
                run_command(command)
        except BaseException:
            sweep_namespaces(PREFIX, grace_s=5)
            raise
        return self

    def __exit__(self, *exc) -> None:
        sweep_namespaces(PREFIX, grace_s=5)

    def _node(self, name: str):
        try:
            return self.layout.node("trainer" if name == "clock" else name)
        except StopIteration:
            raise RuntimeError(f"no namespace left for {name}: the run made {len(self.layout.nodes)}") from None

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run in `name`'s namespace, listening on its address (the step clock: in the trainer's)."""
        node = self._node(name)
        host = [] if name == "clock" else ["--host", node.service.address]
        return ["ip", "netns", "exec", node.namespace, *argv, *host]

    def stages(self) -> dict[str, int | None]:
        """peer id -> announced stage, as the DHT answers `swarm status` in the trainer's namespace."""
        from swarm.daemon.status import status_argv

        node = self._node("trainer")
        status = status_argv(str(self.run_dir / ADDRESS_FILE), node.service.address, timeout_s=10.0)
        argv = [sys.executable, "-m", "swarm.cli", "status", *status]
        done = run_command(["ip", "netns", "exec", node.namespace, *argv], timeout_s=60, check=False)
        try:
            peers = json.loads(done.stdout)["peers"] if done.returncode == 0 else []
        except (json.JSONDecodeError, KeyError, TypeError):
            peers = []
        return {p["peer_id"]: p.get("stage") for p in peers if isinstance(p, dict) and "peer_id" in p}
