"""The NAT router of the namespace and compose testbeds, as data (no root, no Docker): `swarm.testbed.nat`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.testbed import cli as testbed
from swarm.testbed import nat, services
from swarm.testbed.compose import SHARED_DIR, compose_service, render_compose
from swarm.testbed.netns import plan_testbed, setup_commands, shaping_commands

DOCKER = Path(__file__).resolve().parents[2] / "docker"
CFG = services.TestbedConfig(peers=4, nat=(1, 3), rate_mbit=50.0)


def test_nat_config_is_validated():
    for bad in ({"nat": (4,)}, {"nat": (1, 1)}, {"nat": (-1,)}, {"nat": ("1",)}):
        with pytest.raises(ValueError, match="nat"):
            services.TestbedConfig(peers=4, **bad)
    for subnet in ("10.77.0.0/25", "8.8.8.0/24", "192.168.77.0/29"):  # overlaps, public, too small
        with pytest.raises(ValueError, match="nat_subnet"):
            services.TestbedConfig(peers=4, nat=(1,), nat_subnet=subnet)


def test_nat_peers_get_private_addresses_behind_the_router():
    addresses = services.service_addresses(CFG)
    assert addresses["peer1"] == "192.168.77.11" and addresses["peer3"] == "192.168.77.13"
    assert addresses["peer0"] == "10.77.0.10" and addresses["bootstrap"] == "10.77.0.2"
    assert nat.router_addresses(CFG.subnet, CFG.nat_subnet) == ("10.77.0.4", "192.168.77.4")
    peer1 = next(s for s in services.testbed_services(CFG, "/run") if s.name == "peer1")
    assert "192.168.77.11" in peer1.argv  # it binds and announces its private address, as behind a home router


def test_setup_puts_nat_peers_behind_a_masquerading_router():
    plan = plan_testbed(CFG, "/run")
    commands = [" ".join(c) for c in setup_commands(plan)]
    router = "ip netns add swt-nat"
    assert router in commands
    ipt = "ip netns exec swt-nat iptables -w 5"
    rules = [
        f"{ipt} -t nat -A POSTROUTING -o swt-nw -j MASQUERADE",
        f"{ipt} -P FORWARD DROP",
        f"{ipt} -A FORWARD -i swt-nl -o swt-nw -j ACCEPT",
        f"{ipt} -A FORWARD -i swt-nw -o swt-nl -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
    ]
    assert all(r in commands for r in rules)
    assert not any("DNAT" in c or "PREROUTING" in c for c in commands)  # no port forwarding
    assert "ip link set swt-nu master swt-br0 up" in commands  # the router's uplink is on the bridge
    for node in plan.nodes:
        behind = node.service.name in ("peer1", "peer3")
        on_bridge = f"ip link set {node.veth_root} master swt-br0 up"
        on_lan = f"ip -n swt-nat link set {node.veth_root} master swt-nl up"
        assert (on_bridge in commands) != behind and (on_lan in commands) == behind, node.service.name
        if behind:
            assert f"ip -n {node.namespace} route add default via 192.168.77.4" in commands
            assert commands.index(router) < commands.index(on_lan)
        shaping = [" ".join(c) for c in shaping_commands(node.veth_ns, 50.0, netns=node.namespace)]
        assert all(s in commands for s in shaping), f"{node.service.name} is shaped as today"


def test_without_nat_the_testbed_is_unchanged():
    commands = setup_commands(plan_testbed(services.TestbedConfig(peers=4), "/run"))
    assert not any("swt-nat" in " ".join(c) or "iptables" in c for c in commands)


def test_cli_parses_nat():
    parser = testbed.argparse.ArgumentParser()
    testbed.add_arguments(parser)
    args = parser.parse_args(["up", "--peers", "4", "--nat", "1,3"])
    assert testbed.config_from_args(args).nat == (1, 3)


def test_nat_unavailable_says_how_to_install(monkeypatch):
    monkeypatch.setattr(nat.shutil, "which", lambda _: None)
    assert "apt-get install iptables" in nat.nat_unavailable_reason()


def test_compose_has_a_nat_router_and_a_lan():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(render_compose(CFG))
    router = doc["services"]["natrouter"]
    assert router["networks"] == {"swarm": {"ipv4_address": "10.77.0.4"}, "lan": {"ipv4_address": "192.168.77.4"}}
    assert router["sysctls"] == {"net.ipv4.ip_forward": 1} and "NET_ADMIN" in router["cap_add"]
    assert doc["networks"]["lan"]["internal"] is True
    assert doc["networks"]["lan"]["ipam"]["config"] == [{"subnet": CFG.nat_subnet}]
    for name in ("peer1", "peer3"):
        svc = doc["services"][name]
        assert list(svc["networks"]) == ["lan"] and svc["environment"]["GATEWAY"] == "192.168.77.4"
    assert list(doc["services"]["peer0"]["networks"]) == ["swarm"]
    assert "natrouter" not in yaml.safe_load(render_compose(services.TestbedConfig()))["services"]


def _dry_run(script: str, args: list[str], env: dict[str, str]) -> list[str]:
    result = subprocess.run(
        ["sh", str(DOCKER / script), *args],
        env={"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SWARM_DRY_RUN": "1", **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_compose_router_applies_the_namespace_routers_rules():
    lines = _dry_run("nat-router.sh", [], {"UPLINK_ADDRESS": "10.77.0.4", "LAN_ADDRESS": "192.168.77.4"})
    plan = plan_testbed(CFG, "/run")
    expected = [
        " ".join(["iptables", *c[7:]]).replace("swt-nw", "$up").replace("swt-nl", "$lan")
        for c in nat.router_commands(plan)
        if "iptables" in c
    ]
    assert lines == expected


def test_entrypoint_routes_a_nat_peer_through_the_router():
    peer1 = next(s for s in services.testbed_services(CFG, SHARED_DIR) if s.name == "peer1")
    command, env = compose_service(peer1)
    lines = _dry_run("entrypoint.sh", command, {**env, "GATEWAY": "192.168.77.4"})
    assert "ip route replace default via 192.168.77.4" in lines[: lines.index("--")]
