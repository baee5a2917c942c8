"""The NAT router of the namespace and compose testbeds, as data (no root, no Docker): `swarm.testbed.nat_routers`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.testbed import nat_routers, services
from swarm.testbed import testbed_cli as testbed
from swarm.testbed.compose import SHARED_DIR, compose_config, render_compose
from swarm.testbed.netns import lay_out_testbed, setup_commands, shaping_commands

DOCKER = Path(__file__).resolve().parents[2] / "docker"
CFG = services.TestbedConfig(peers=4, nat=(1, 3), egress=services.Egress(50.0))


def test_nat_config_is_validated():
    for bad in ({"nat": (4,)}, {"nat": (1, 1)}, {"nat": (-1,)}, {"nat": ("1",)}):
        with pytest.raises(ValueError, match="nat"):
            services.TestbedConfig(peers=4, **bad)
    for subnet in ("10.77.0.0/25", "8.8.8.0/24", "192.168.77.0/27"):  # overlaps, public, too small
        with pytest.raises(ValueError, match="nat_subnet"):
            services.TestbedConfig(peers=4, nat=(1,), nat_subnet=subnet)


def test_nat_peers_get_private_addresses_behind_the_router():
    addresses = services.service_addresses(CFG)
    assert addresses["peer1"] == "10.78.0.26" and addresses["peer3"] == "10.78.0.58"  # .10 of their own /28
    assert addresses["peer0"] == "10.77.0.10" and addresses["bootstrap"] == "10.77.0.2"
    assert nat_routers.uplink_address(CFG) == "10.77.0.4"
    assert (nat_routers.lan_gateway(CFG, 1), nat_routers.lan_gateway(CFG, 3)) == ("10.78.0.20", "10.78.0.52")
    peer1 = next(s for s in services.testbed_services(CFG, "/run") if s.name == "peer1")
    assert "10.78.0.26" in peer1.argv  # it binds and announces its private address, as behind a home router


def test_setup_puts_nat_peers_behind_a_masquerading_router():
    plan = lay_out_testbed(CFG, "/run")
    commands = [" ".join(c) for c in setup_commands(plan, iptables=False)]  # the root's own rule: test_firewall
    router = "ip netns add swt-nat"
    assert router in commands
    ipt = "ip netns exec swt-nat iptables -w 5"
    rules = [
        f"{ipt} -t nat -A POSTROUTING -o swt-nw -j MASQUERADE",
        f"{ipt} -P FORWARD DROP",
        f"{ipt} -A FORWARD ! -i swt-nw -o swt-nw -j ACCEPT",  # out only: not into another LAN
        f"{ipt} -A FORWARD -i swt-nw -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
    ]
    assert [c for c in commands if "iptables" in c] == rules
    assert not any("DNAT" in c or "PREROUTING" in c for c in commands)  # no port forwarding
    assert "ip link set swt-nu master swt-br0 up" in commands  # the router's uplink is on the bridge
    for node in plan.nodes:
        behind = node.service.name in ("peer1", "peer3")
        on_bridge = f"ip link set {node.veth_root} master swt-br0 up"
        in_router = f"ip -n swt-nat link set {node.veth_root} up"
        assert (on_bridge in commands) != behind and (in_router in commands) == behind, node.service.name
        if behind:
            gateway = nat_routers.lan_gateway(CFG, int(node.service.name[4:]))
            assert f"ip -n swt-nat addr add {gateway}/28 dev {node.veth_root}" in commands
            assert f"ip -n {node.namespace} route add default via {gateway}" in commands
            assert commands.index(router) < commands.index(in_router)
        shaping = [" ".join(c) for c in shaping_commands(node.veth_ns, 50.0, netns=node.namespace)]
        assert all(s in commands for s in shaping), f"{node.service.name} is shaped as today"


def test_without_nat_the_testbed_is_unchanged():
    commands = setup_commands(lay_out_testbed(services.TestbedConfig(peers=4), "/run"), iptables=False)
    assert not any("swt-nat" in " ".join(c) or "iptables" in c for c in commands)


def test_cli_parses_nat():
    parser = testbed.argparse.ArgumentParser()
    testbed.add_arguments(parser)
    args = parser.parse_args(["up", "--peers", "4", "--nat", "1,3"])
    assert testbed.config_from_args(args).nat == (1, 3)


def test_nat_unavailable_says_how_to_install(monkeypatch):
    monkeypatch.setattr(nat_routers.shutil, "which", lambda _: None)
    assert "apt-get install iptables" in nat_routers.nat_unavailable_reason()


def test_compose_has_a_nat_router_and_a_lan_per_nat_peer():
    """In compose's own subnets (compose_config): the namespace testbed's shifted from 10.77/10.78 to 10.177/10.178."""
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(render_compose(CFG))
    router = doc["services"]["natrouter"]
    assert router["networks"] == {
        "swarm": {"ipv4_address": "10.177.0.4"},
        "lan1": {"ipv4_address": "10.178.0.20"},
        "lan3": {"ipv4_address": "10.178.0.52"},
    }
    assert router["sysctls"] == {"net.ipv4.ip_forward": 1} and "NET_ADMIN" in router["cap_add"]
    for i, subnet, gateway in ((1, "10.178.0.16/28", "10.178.0.20"), (3, "10.178.0.48/28", "10.178.0.52")):
        assert doc["networks"][f"lan{i}"]["internal"] is True
        assert doc["networks"][f"lan{i}"]["ipam"]["config"] == [{"subnet": subnet}]
        svc = doc["services"][f"peer{i}"]
        assert list(svc["networks"]) == [f"lan{i}"] and svc["environment"]["GATEWAY"] == gateway
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
    lines = _dry_run("nat-router.sh", [], {"UPLINK_ADDRESS": "10.77.0.4"})
    assert lines == [" ".join(["iptables", *rule]) for rule in nat_routers.iptables_rules("$up")]


def test_entrypoint_routes_a_nat_peer_through_the_router():
    yaml = pytest.importorskip("yaml")
    svc = yaml.safe_load(render_compose(CFG))["services"]["peer1"]
    lines = _dry_run("entrypoint.sh", svc["command"], {k: str(v) for k, v in svc["environment"].items()})
    assert "ip route replace default via 10.178.0.20" in lines[: lines.index("--")]
    peer1 = next(s for s in services.testbed_services(compose_config(CFG), SHARED_DIR) if s.name == "peer1")
    assert lines[lines.index("--") + 1 :] == list(peer1.argv)
