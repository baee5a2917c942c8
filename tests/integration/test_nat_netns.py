"""The NAT router of the namespace testbed for real (root, `ip netns` and iptables needed): a NAT'd peer's
namespace reaches the outside, and the outside cannot open a TCP connection to it, not even with a route,
nor can another NAT'd peer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.testbed import services
from swarm.testbed.nat_routers import nat_unavailable_reason
from swarm.testbed.netns import (
    lay_out_testbed,
    list_links,
    list_namespaces,
    run_command,
    setup_commands,
    sweep,
    unavailable_reason,
)

PREFIX = "swn-"
CFG = services.TestbedConfig(
    peers=3, nat=(1, 2), egress=services.Egress(0.0), prefix=PREFIX, subnet="10.79.0.0/24", nat_subnet="10.80.0.0/24"
)


def _skip_reason() -> str | None:
    reason = unavailable_reason() or nat_unavailable_reason()
    if reason is None and (list_namespaces(PREFIX) or list_links(PREFIX)):
        reason = f"a testbed with prefix {PREFIX!r} is up already (`swarm testbed down --prefix {PREFIX}`)"
    return reason


_REASON = _skip_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(_REASON is not None, reason=f"NAT testbed unavailable: {_REASON}"),
]

# serves one connection on port 7000 and prints who connected, or "none" after 3 s
_SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 7000))
s.settimeout(3)
print("ready", flush=True)
try:
    conn, peer = s.accept()
    print(peer[0], flush=True)
except TimeoutError:
    print("none", flush=True)
"""
_CLIENT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 7000), timeout=2).close()
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""


def _in(namespace: str, script: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, sys.executable, "-I", "-c", script, *args]


def _serve_and_dial(server_ns: str, client_ns: str, target: str) -> tuple[str, str]:
    server = subprocess.Popen(_in(server_ns, _SERVER), stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        assert server.stdout.readline().strip() == "ready"
        client = run_command(_in(client_ns, _CLIENT, target), timeout_s=10).stdout.strip()
        seen = server.communicate(timeout=10)[0].strip()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(5)
    return client, seen


def test_nat_peers_dial_out_and_nobody_dials_in():
    plan = lay_out_testbed(CFG, "/tmp")
    outside, inside = plan.node("peer0"), plan.node("peer1")
    try:
        for command in setup_commands(plan):
            run_command(command)
        # out: the NAT'd peer reaches a reachable one, which sees the router's uplink address (masquerade)
        assert _serve_and_dial(outside.namespace, inside.namespace, outside.service.address) == (
            "connected",
            "10.79.0.4",
        )
        # in: no route to the private address...
        client, seen = _serve_and_dial(inside.namespace, outside.namespace, inside.service.address)
        assert client == "OSError"  # ENETUNREACH
        assert seen == "none"
        # ...nothing forwarded from the router's public address...
        client, seen = _serve_and_dial(inside.namespace, outside.namespace, "10.79.0.4")
        assert client == "ConnectionRefusedError" and seen == "none"
        # ...and even with a route through the router, it forwards nothing new inwards
        run_command(["ip", "-n", outside.namespace, "route", "add", CFG.nat_subnet, "via", "10.79.0.4"])
        client, seen = _serve_and_dial(inside.namespace, outside.namespace, inside.service.address)
        assert client == "TimeoutError" and seen == "none"
        # two NAT'd peers are behind two home routers: neither reaches the other
        other = plan.node("peer2")
        client, seen = _serve_and_dial(inside.namespace, other.namespace, inside.service.address)
        assert client == "TimeoutError" and seen == "none"
        # while the second one dials out as the first does
        out = _serve_and_dial(outside.namespace, other.namespace, outside.service.address)
        assert out == ("connected", "10.79.0.4")
    finally:
        sweep(PREFIX, grace_s=2)
    assert list_namespaces(PREFIX) == [] and list_links(PREFIX) == []
