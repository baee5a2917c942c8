"""The namespace testbed under a docker engine's firewall, for real but without touching the host's: a
private "host" namespace gets FORWARD policy DROP (what dockerd sets) with br_netfilter on, and a testbed
built inside it still carries traffic across its bridge because of its own ACCEPT rule, which `sweep` then
removes. The same testbed without the rule is cut off: the check can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from swarm.testbed.firewall import iptables_available
from swarm.testbed.netns import run_command, unavailable_reason

PREFIX = "swf-"
HOST = f"cmpfw{os.getpid()}"
"""The private host namespace (not named with PREFIX: the sweep inside must not remove it)."""

_REASON = unavailable_reason() or (None if iptables_available() else "iptables is not installed")
pytestmark = [
    pytest.mark.netns,
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_REASON is not None, reason=f"namespace testbed unavailable: {_REASON}"),
]

_INSIDE = textwrap.dedent(
    """
    import json, sys
    from swarm.testbed import services
    from swarm.testbed.netns import CommandError, lay_out_testbed, measure_rate, run_command, setup_commands, sweep

    prefix, with_rule = sys.argv[1], sys.argv[2] == "1"
    out = {"bridge_nf": open("/proc/sys/net/bridge/bridge-nf-call-iptables").read().strip()}
    run_command(["iptables", "-w", "5", "-P", "FORWARD", "DROP"])
    cfg = services.TestbedConfig(peers=1, prefix=prefix, egress=services.Egress(0.0))
    layout = lay_out_testbed(cfg, "/nonexistent")
    try:
        for command in setup_commands(layout, iptables=with_rule):
            run_command(command)
        try:
            out["rate"] = measure_rate(f"{prefix}trainer", f"{prefix}bootstrap", 200_000, timeout_s=4.0)
        except CommandError as e:
            out["error"] = str(e)[:300]
        out["rules_up"] = run_command(["iptables", "-S", "FORWARD"]).stdout
    finally:
        out["swept"] = list(sweep(prefix, grace_s=2).namespaces)
    out["rules_down"] = run_command(["iptables", "-S", "FORWARD"]).stdout
    print(json.dumps(out))
    """
)


def _run_inside(with_rule: bool) -> dict:
    argv = ["ip", "netns", "exec", HOST, sys.executable, "-c", _INSIDE, PREFIX, "1" if with_rule else "0"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=140, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def private_host():
    run_command(["ip", "netns", "add", HOST])
    try:
        yield HOST
    finally:
        run_command(["ip", "netns", "del", HOST], check=False)
        for ns in run_command(["ip", "netns", "list"]).stdout.split():
            if ns.startswith(PREFIX):  # left only if the child was killed before its sweep
                run_command(["ip", "netns", "del", ns], check=False)


def test_a_testbed_bridge_forwards_under_dockers_forward_drop(private_host):
    opened = _run_inside(with_rule=True)
    if opened["bridge_nf"] != "1":
        pytest.skip("br_netfilter is not on in a new namespace here: FORWARD does not see bridged frames")
    assert "error" not in opened, opened
    assert opened["rate"] > 1e6, "unshaped veths carry megabytes a second"
    assert "swarm-testbed:swf-br0" in opened["rules_up"]
    assert "swarm-testbed" not in opened["rules_down"], "sweep removes the rule"
    assert len(opened["swept"]) == 3
    cut = _run_inside(with_rule=False)
    assert "rate" not in cut and "error" in cut, "without its rule, DROP cuts the bridge (the check can fail)"
    assert "swarm-testbed" not in cut["rules_up"]
