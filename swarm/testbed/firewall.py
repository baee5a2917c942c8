"""The namespace testbed's own firewall rule: its bridge forwards its own traffic whatever the host's policy.

With `br_netfilter` loaded (`net.bridge.bridge-nf-call-iptables = 1`, as a docker engine leaves it), frames
bridged between two namespaces on the testbed's bridge pass the root namespace's iptables FORWARD chain, and
a running dockerd sets that chain's policy to DROP: the testbed's services could no longer reach each other.
So the testbed inserts one explicit rule for its bridge,

    iptables -I FORWARD -i <bridge> -o <bridge> -m comment --comment swarm-testbed:<bridge> -j ACCEPT

when it builds the bridge, and removes every rule carrying that comment when it is taken down (`sweep` finds
them by the prefix, also after the testbed process was killed). Nothing else of the host's firewall changes:
the rule accepts only frames from one port of the testbed's bridge to another. Where iptables is missing, no
rule is needed (nothing can set a DROP policy either) and none is added.

Everything here is argv lists and a parser of `iptables -S` (unit-tested without root); `swarm.testbed.netns`
runs them.
"""

from __future__ import annotations

import shlex
import shutil

__all__ = ["COMMENT_PREFIX", "accept_bridge_commands", "forward_rules", "iptables_available", "remove_rule_commands"]

COMMENT_PREFIX = "swarm-testbed:"
"""Every rule the testbed adds carries the comment `swarm-testbed:<bridge>`; `sweep` removes them by it."""
_IPTABLES = ["iptables", "-w", "5"]


def iptables_available() -> bool:
    """Whether the root namespace has iptables (without it there is no FORWARD chain to open)."""
    return shutil.which("iptables") is not None


def accept_bridge_commands(bridge: str) -> list[list[str]]:
    """Insert the ACCEPT rule for traffic between the ports of `bridge` at the top of FORWARD."""
    return [[*_IPTABLES, "-I", "FORWARD", *_rule(bridge)]]


def _rule(bridge: str) -> list[str]:
    return ["-i", bridge, "-o", bridge, "-m", "comment", "--comment", COMMENT_PREFIX + bridge, "-j", "ACCEPT"]


def forward_rules(iptables_s: str, prefix: str) -> list[list[str]]:
    """The rules of `iptables -S FORWARD` output whose comment names a bridge with `prefix`, as the argv after
    `-A` (what `-D FORWARD` takes to delete exactly that rule)."""
    rules = []
    for line in iptables_s.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if words[:2] != ["-A", "FORWARD"] or "--comment" not in words:
            continue
        comment = words[words.index("--comment") + 1] if words.index("--comment") + 1 < len(words) else ""
        if comment.startswith(COMMENT_PREFIX + prefix):
            rules.append(words[2:])
    return rules


def remove_rule_commands(iptables_s: str, prefix: str) -> list[list[str]]:
    """Delete every FORWARD rule the testbeds of `prefix` added (found in `iptables -S FORWARD` output)."""
    return [[*_IPTABLES, "-D", "FORWARD", *rule] for rule in forward_rules(iptables_s, prefix)]
