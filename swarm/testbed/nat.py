"""Peers behind NAT in the namespace testbed (`swarm testbed up --nat 1,3`): a home router as a namespace.

The NAT'd peers do not sit on the testbed's bridge. Each has a veth to a LAN bridge inside one router
namespace (`<prefix>nat`), an address in `TestbedConfig.nat_subnet` and a default route through the router
(`.4` of that subnet; docker's gateway takes .1 in the compose testbed). The router's uplink is one more node
on the testbed bridge (`.4` of the subnet), and iptables in the router
namespace does what a home router does:

    nat POSTROUTING -o uplink -j MASQUERADE           (outgoing connections leave with the router's address)
    FORWARD policy DROP
    FORWARD -i lan -o uplink -j ACCEPT                (the LAN dials out)
    FORWARD -i uplink -o lan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT   (replies come back)

with no port forwarding: nobody outside can open a connection to a NAT'd peer (its private address has no
route on the bridge, and the router forwards nothing new inwards; tests/integration/test_nat_netns.py checks
both). A NAT'd peer's egress is shaped on its own veth as every node's is. Everything is named with the
testbed's prefix, so `sweep` removes it with the rest.

Everything here is argv lists built from the plan (unit-tested without root); `swarm.testbed.netns` runs them.
"""

from __future__ import annotations

import ipaddress
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.testbed.netns import Node, TestbedPlan

__all__ = [
    "IPTABLES_HINT",
    "ROUTER_OFFSET",
    "nat_node_commands",
    "nat_unavailable_reason",
    "router_addresses",
    "router_commands",
    "router_names",
]

ROUTER_OFFSET = 4
"""The router's addresses, uplink and LAN: .4 of each subnet (bootstrap .2, trainer .3, peers .10 on)."""
IPTABLES_HINT = "`iptables` is not installed; the NAT router needs it: apt-get install iptables"


def nat_unavailable_reason() -> str | None:
    """Why the NAT router can't be built here (no iptables), or None."""
    return IPTABLES_HINT if shutil.which("iptables") is None else None


def router_names(prefix: str) -> dict[str, str]:
    """The router's namespace, its uplink veth (root end on the bridge, router end) and its LAN bridge."""
    return {"namespace": f"{prefix}nat", "uplink_root": f"{prefix}nu", "uplink": f"{prefix}nw", "lan": f"{prefix}nl"}


def router_addresses(subnet: str, nat_subnet: str) -> tuple[str, str]:
    """(uplink address on the testbed subnet, LAN gateway address in the NAT subnet)."""
    net, lan = ipaddress.ip_network(subnet), ipaddress.ip_network(nat_subnet)
    return str(net.network_address + ROUTER_OFFSET), str(lan.network_address + ROUTER_OFFSET)


def router_commands(plan: TestbedPlan) -> list[list[str]]:
    """The router namespace: uplink on the testbed bridge, LAN bridge, forwarding and the iptables rules."""
    cfg = plan.config
    n = router_names(cfg.prefix)
    ns, lan, up = n["namespace"], n["lan"], n["uplink"]
    uplink_address, gateway = router_addresses(cfg.subnet, cfg.nat_subnet)
    lan_len = ipaddress.ip_network(cfg.nat_subnet).prefixlen
    ipt = ["ip", "netns", "exec", ns, "iptables", "-w", "5"]
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", n["uplink_root"], "type", "veth", "peer", "name", up, "netns", ns],
        ["ip", "link", "set", n["uplink_root"], "addrgenmode", "none"],
        ["ip", "link", "set", n["uplink_root"], "master", plan.bridge, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{uplink_address}/{plan.prefix_len}", "dev", up],
        ["ip", "-n", ns, "link", "set", up, "up"],
        ["ip", "-n", ns, "link", "add", lan, "type", "bridge"],
        ["ip", "-n", ns, "addr", "add", f"{gateway}/{lan_len}", "dev", lan],
        ["ip", "-n", ns, "link", "set", lan, "up"],
        ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
        [*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", up, "-j", "MASQUERADE"],
        [*ipt, "-P", "FORWARD", "DROP"],
        [*ipt, "-A", "FORWARD", "-i", lan, "-o", up, "-j", "ACCEPT"],
        [*ipt, "-A", "FORWARD", "-i", up, "-o", lan, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
         "-j", "ACCEPT"],
    ]  # fmt: skip


def nat_node_commands(plan: TestbedPlan, node: Node) -> list[list[str]]:
    """A NAT'd node's namespace on the router's LAN bridge, with its default route through the router
    (its shaping is added by the caller, as for every node)."""
    cfg = plan.config
    n = router_names(cfg.prefix)
    router, ns, a, b = n["namespace"], node.namespace, node.veth_root, node.veth_ns
    _, gateway = router_addresses(cfg.subnet, cfg.nat_subnet)
    lan_len = ipaddress.ip_network(cfg.nat_subnet).prefixlen
    return [
        ["ip", "netns", "add", ns],
        ["ip", "-n", router, "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns],
        ["ip", "-n", router, "link", "set", a, "addrgenmode", "none"],
        ["ip", "-n", router, "link", "set", a, "master", n["lan"], "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{node.service.address}/{lan_len}", "dev", b],
        ["ip", "-n", ns, "link", "set", b, "up"],
        ["ip", "-n", ns, "route", "add", "default", "via", gateway],
    ]
