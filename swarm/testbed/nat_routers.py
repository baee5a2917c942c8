"""Peers behind NAT in the namespace testbed (`swarm testbed up --nat 1,3`): home routers as a namespace.

The NAT'd peers do not sit on the testbed's bridge. Each has a veth of its own to one router namespace
(`<prefix>nat`), its own LAN (`services.nat_lan`: a /28 of `TestbedConfig.nat_subnet`, the router at .4,
the peer at .10) and a default route through the router. The router's uplink is one more node on the
testbed bridge (`.4` of the subnet), and iptables in the router namespace does what home routers do:

    nat POSTROUTING -o uplink -j MASQUERADE             (outgoing connections leave with the router's address)
    FORWARD policy DROP
    FORWARD ! -i uplink -o uplink -j ACCEPT             (a LAN dials out, and only out: not into another LAN)
    FORWARD -i uplink -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT     (replies come back)

with no port forwarding: nobody outside can open a connection to a NAT'd peer (its private address has no
route on the bridge, and the router forwards nothing new inwards), and two NAT'd peers cannot reach each
other either, as two volunteers behind two home routers (tests/integration/test_nat_netns.py checks all
three). One router namespace serves every NAT'd peer: they share its public address, as peers behind one
carrier-grade NAT do. A NAT'd peer's egress is shaped on its own veth as every node's is. Everything is named
with the testbed's prefix, so `sweep` removes it with the rest.

Everything here is argv lists built from the layout (unit-tested without root); `swarm.testbed.netns` runs them.
"""

from __future__ import annotations

import ipaddress
import shutil
from typing import TYPE_CHECKING

from swarm.testbed.services import TestbedConfig, nat_lan

if TYPE_CHECKING:
    from swarm.testbed.netns import Node, TestbedLayout

__all__ = [
    "IPTABLES_HINT",
    "ROUTER_OFFSET",
    "iptables_rules",
    "lan_gateway",
    "nat_node_commands",
    "nat_unavailable_reason",
    "router_commands",
    "router_names",
    "uplink_address",
]

ROUTER_OFFSET = 4
"""The router's addresses, uplink and each LAN's: .4 of each (bootstrap .2, trainer .3, peers .10 on)."""
IPTABLES_HINT = "`iptables` is not installed; the NAT router needs it: apt-get install iptables"


def nat_unavailable_reason() -> str | None:
    """Why the NAT router can't be built here (no iptables), or None."""
    return IPTABLES_HINT if shutil.which("iptables") is None else None


def router_names(prefix: str) -> dict[str, str]:
    """The router's namespace and its uplink veth (root end on the bridge, router end)."""
    return {"namespace": f"{prefix}nat", "uplink_root": f"{prefix}nu", "uplink": f"{prefix}nw"}


def uplink_address(cfg: TestbedConfig) -> str:
    """The router's (public) address on the testbed subnet."""
    return str(ipaddress.ip_network(cfg.subnet).network_address + ROUTER_OFFSET)


def lan_gateway(cfg: TestbedConfig, peer: int) -> str:
    """The router's address on NAT'd peer `peer`'s LAN: that peer's default gateway."""
    return str(nat_lan(cfg, peer).network_address + ROUTER_OFFSET)


def iptables_rules(uplink: str) -> list[list[str]]:
    """The router's rules (after `iptables`), the same in the namespace and in docker/nat-router.sh."""
    return [
        ["-t", "nat", "-A", "POSTROUTING", "-o", uplink, "-j", "MASQUERADE"],
        ["-P", "FORWARD", "DROP"],
        ["-A", "FORWARD", "!", "-i", uplink, "-o", uplink, "-j", "ACCEPT"],
        ["-A", "FORWARD", "-i", uplink, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
    ]


def router_commands(layout: TestbedLayout) -> list[list[str]]:
    """The router namespace: uplink on the testbed bridge, forwarding and the iptables rules."""
    n = router_names(layout.config.prefix)
    ns, up = n["namespace"], n["uplink"]
    ipt = ["ip", "netns", "exec", ns, "iptables", "-w", "5"]
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", n["uplink_root"], "type", "veth", "peer", "name", up, "netns", ns],
        ["ip", "link", "set", n["uplink_root"], "addrgenmode", "none"],
        ["ip", "link", "set", n["uplink_root"], "master", layout.bridge, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{uplink_address(layout.config)}/{layout.prefix_len}", "dev", up],
        ["ip", "-n", ns, "link", "set", up, "up"],
        ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
        *([*ipt, *rule] for rule in iptables_rules(up)),
    ]


def nat_node_commands(layout: TestbedLayout, node: Node) -> list[list[str]]:
    """A NAT'd node's namespace on a LAN of its own to the router, with its default route through it (its
    shaping is added by the caller, as for every node)."""
    cfg = layout.config
    peer = int(node.service.name.removeprefix("peer"))
    router, ns, a, b = router_names(cfg.prefix)["namespace"], node.namespace, node.veth_root, node.veth_ns
    gateway, lan_len = lan_gateway(cfg, peer), nat_lan(cfg, peer).prefixlen
    return [
        ["ip", "netns", "add", ns],
        ["ip", "-n", router, "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns],
        ["ip", "-n", router, "link", "set", a, "addrgenmode", "none"],
        ["ip", "-n", router, "addr", "add", f"{gateway}/{lan_len}", "dev", a],
        ["ip", "-n", router, "link", "set", a, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{node.service.address}/{lan_len}", "dev", b],
        ["ip", "-n", ns, "link", "set", b, "up"],
        ["ip", "-n", ns, "route", "add", "default", "via", gateway],
    ]
