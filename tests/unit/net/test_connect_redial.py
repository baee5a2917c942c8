"""A stage client held across a change of its address's dial target (a peer announces a relay) follows it."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from swarm.net.connect import GrpcConnector
from swarm.proto import stage_pb2

pytestmark = pytest.mark.timeout(30)


def _server(seen: list[str], name: str) -> tuple[grpc.Server, str]:
    def status(request, context):
        seen.append(name)
        return stage_pb2.StatusReply()

    handler = grpc.method_handlers_generic_handler(
        "swarm.Stage",
        {
            "Status": grpc.unary_unary_rpc_method_handler(
                status, stage_pb2.Empty.FromString, stage_pb2.StatusReply.SerializeToString
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_held_client_follows_a_new_dial_target():
    seen: list[str] = []
    (a, at_a), (b, at_b) = _server(seen, "a"), _server(seen, "b")
    target = {"peer:1": at_a}
    connector = GrpcConnector(dial=lambda address: target[address])
    try:
        client = connector.stage("peer:1")  # held, as a driver holds its clients for a whole plan
        client.Status(stage_pb2.Empty(), timeout=5)
        target["peer:1"] = at_b  # the peer now announces a relay: its address dials a tunnel
        assert connector.stage("peer:1") is client
        client.Status(stage_pb2.Empty(), timeout=5)  # before: "Cannot invoke RPC on closed channel!"
        assert seen == ["a", "b"]
        with pytest.raises(AttributeError):
            client.NoSuchCall  # noqa: B018
    finally:
        connector.close()
        a.stop(None)
        b.stop(None)
