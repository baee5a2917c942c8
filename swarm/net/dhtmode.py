"""A DHT node that joined in client mode starts serving records once its peer is found reachable.

`swarm-peer --reach auto` cannot know its reach before its DHT node starts: the dial-back helper reads the
address to dial from the peer's DHT announcement. A server-mode node behind NAT stalls others' stores for 6 s
each (docs/NAT.md), so under auto the node joins in client mode (as under `--reach relay`) and is upgraded here
when the dial-back succeeds. Upgrading (not downgrading) is the safe direction: a client's requests carry an
empty `NodeInfo`, so no other node has it in a routing table yet; after the upgrade its requests carry its node
id and others add it as they would a node that joined as a server. The DHT's process is forked before the gRPC
server starts (peer.py) and stays the same process: nothing is forked beside gRPC's threads.

This reaches into hivemind 1.1.12's `DHTProtocol` (what its `create` does for a server), the version
docs/NAT.md checked; `tests/integration/test_dht_mode.py` checks it against the installed hivemind.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.peers.dht import SwarmDHT

__all__ = ["serve_records"]


async def _serve(_dht, node) -> bool:
    from hivemind.dht.protocol import AuthRole, AuthRPCWrapper
    from hivemind.proto import dht_pb2

    protocol = node.protocol
    if not protocol.client_mode:
        return False
    await protocol.add_p2p_handlers(protocol.p2p, AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer))
    protocol.node_info = dht_pb2.NodeInfo(node_id=node.node_id.to_bytes())
    protocol.client_mode = False
    # tell the nodes it knows (its bootstrap among them) that it serves now: a ping with its node id adds it
    known = [peer_id for _, peer_id in protocol.routing_table.get_nearest_neighbors(node.node_id, 32)]
    await asyncio.gather(*(protocol.call_ping(peer_id) for peer_id in known), return_exceptions=True)
    return True


def serve_records(dht: SwarmDHT) -> bool:
    """Turns `dht`'s client-mode node into a server (it then stores others' records and answers their finds).
    Returns whether it changed (False: it was a server already). Raises TimeoutError like any DHT request."""
    return bool(dht._request("serve records", lambda: dht._dht.run_coroutine(_serve, return_future=True)))
