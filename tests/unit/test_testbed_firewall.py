"""The namespace testbed's own FORWARD rule (swarm.testbed.firewall), as argv lists: added right after the
bridge, found again in `iptables -S` output among a docker engine's rules, and only the testbed's own."""

from __future__ import annotations

from swarm.testbed import firewall, services
from swarm.testbed.netns import lay_out_testbed, setup_commands

# `iptables -S FORWARD` on a host with a docker engine and two testbeds up (prefixes swt- and swz-)
DOCKER_FORWARD = """-P FORWARD DROP
-A FORWARD -i swt-br0 -o swt-br0 -m comment --comment swarm-testbed:swt-br0 -j ACCEPT
-A FORWARD -i swz-br0 -o swz-br0 -m comment --comment "swarm-testbed:swz-br0" -j ACCEPT
-A FORWARD -j DOCKER-USER
-A FORWARD -j DOCKER-ISOLATION-STAGE-1
-A FORWARD -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A FORWARD -i docker0 -o docker0 -m comment --comment "not ours: swarm-testbed-like" -j ACCEPT
-A FORWARD -i swt-br0 -j ACCEPT
-A FORWARD -m comment --comment "unbalanced
"""


def test_setup_opens_the_bridge_right_after_making_it():
    commands = setup_commands(lay_out_testbed(services.TestbedConfig(peers=2), "/run"), iptables=True)
    rule = ["iptables", "-w", "5", "-I", "FORWARD", "-i", "swt-br0", "-o", "swt-br0"]
    rule += ["-m", "comment", "--comment", "swarm-testbed:swt-br0", "-j", "ACCEPT"]
    assert commands[3] == rule, "before any namespace joins the bridge"
    assert commands[2] == ["ip", "link", "set", "swt-br0", "up"]
    assert sum("iptables" in c for c in commands) == 1
    without = setup_commands(lay_out_testbed(services.TestbedConfig(peers=2), "/run"), iptables=False)
    assert without == commands[:3] + commands[4:]


def test_removal_finds_exactly_the_prefixs_rules():
    removals = firewall.remove_rule_commands(DOCKER_FORWARD, "swt-")
    assert removals == [
        ["iptables", "-w", "5", "-D", "FORWARD", "-i", "swt-br0", "-o", "swt-br0", "-m", "comment", "--comment",
         "swarm-testbed:swt-br0", "-j", "ACCEPT"],
    ]  # fmt: skip
    (other,) = firewall.remove_rule_commands(DOCKER_FORWARD, "swz-")
    assert "swarm-testbed:swz-br0" in other  # the quoted comment is unquoted, as -D needs it
    assert firewall.remove_rule_commands(DOCKER_FORWARD, "swq-") == []
    assert firewall.remove_rule_commands("", "swt-") == []


def test_the_rule_added_is_the_rule_removed():
    (add,) = firewall.accept_bridge_commands("swk-br0")
    listed = " ".join(["-A", *add[add.index("FORWARD") :]])
    (remove,) = firewall.remove_rule_commands(listed, "swk-")
    assert remove[remove.index("FORWARD") + 1 :] == add[add.index("FORWARD") + 1 :]
    assert remove[:5] == ["iptables", "-w", "5", "-D", "FORWARD"]
