"""`--reach auto`'s DHT node: it joins in client mode and serves records only once found reachable.

Two real hivemind DHT processes on loopback (started and shut down here, each bounded by the DHT's own timeouts).
"""

from __future__ import annotations

import functools

import pytest

from swarm.daemon.peer import build_parser
from swarm.daemon.peer_config import config_from_args
from swarm.net.dhtmode import serve_records
from swarm.peers.dht import SwarmDHT, quiet_hivemind
from swarm.peers.dht_config import DHTConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_auto_and_relay_join_the_dht_in_client_mode():
    client = {r: config_from_args(build_parser().parse_args(["--reach", r])).dht.client_mode for r in ("auto", "relay")}
    assert client == {"auto": True, "relay": True}  # before: auto joined as a server, even behind NAT
    assert not config_from_args(build_parser().parse_args(["--reach", "direct"])).dht.client_mode


async def _ping(peer_id: str, _dht, node):
    from hivemind.p2p import PeerID

    found = await node.protocol.call_ping(PeerID.from_base58(peer_id))
    return None if found is None else found.to_bytes()


def _served(boot: SwarmDHT, other: SwarmDHT) -> bool:
    """Whether `boot`'s node gets a DHT answer (a node id) from `other`'s: only a server node answers."""
    target = other._request("id", lambda: other._dht.run_coroutine(_peer_id, return_future=True))
    ping = functools.partial(_ping, target)
    return boot._request("ping", lambda: boot._dht.run_coroutine(ping, return_future=True)) is not None


async def _peer_id(_dht, node) -> str:
    return node.peer_id.to_base58()


def test_a_client_node_found_reachable_serves_records():
    quiet_hivemind()
    with SwarmDHT(DHTConfig(host="127.0.0.1", request_timeout_s=15.0)) as boot:
        initial = tuple(boot.visible_maddrs())
        with SwarmDHT(DHTConfig(initial_peers=initial, client_mode=True, host="127.0.0.1")) as auto:
            assert not _served(boot, auto)  # a client answers nobody: nothing stalls on it behind NAT
            assert serve_records(auto) is True
            assert _served(boot, auto)
            assert serve_records(auto) is False  # a second call changes nothing
