"""A real stage behind NAT, reached only through its relay: the trainer's and the neighbour's calls (Forward,
Backward, PutLabels, Grads, Step, all signed by their callers and checked by the stage) run through tunnels,
and training gives the same losses and weights as the all-direct run, to float equality (issue 16's first
target). Two shapes: a separate relay peer, and the stage's pipeline neighbour as its relay (reverse
connection: the neighbour's own calls take no extra hop)."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.compression import CodecConfig
from swarm.metrics import Metrics
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.net.connect import GrpcConnector
from swarm.net.relay import Attachment, RelayRoute, RelayServicer, Tunnels
from swarm.peers.transport import make_server
from swarm.proto import stage_pb2_grpc
from swarm.runtime.driver import PipelineDriver
from tests.integration.swarm_fixtures import loopback_stages, remote, trainer_of
from tests.integration.test_stage_service import batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FW, BW = CodecConfig("aqsgd", bits=4), CodecConfig("gradq", bits=8)


def train_direct(data) -> tuple[list[float], list[dict]]:
    with loopback_stages(2, FW, BW) as (hosts, _, addresses):
        pipe = remote(addresses)
        losses = [pipe.train_step(step, b).loss for step, b in enumerate(data)]
        pipe.close()
        return losses, [h.worker.module.state_dict() for h in hosts]


def train_relayed(data, relay_is_neighbour: bool) -> tuple[list[float], list[dict], dict]:
    metrics = Metrics()
    with loopback_stages(2, FW, BW) as (hosts, _, addresses):
        peers, trainer = trainer_of(addresses)
        stage0, stage1 = hosts[0].outbox.connector.signer, hosts[1].outbox.connector.signer
        relay_identity = stage0.identity if relay_is_neighbour else Identity.generate()
        relay_id = relay_identity.peer_id
        relay = RelayServicer(relay_id, CallVerifier(relay_id), {peers[1]}.__contains__, metrics=metrics)
        server, port = make_server(hosts[0].outbox.connector.channels.config)
        stage_pb2_grpc.add_RelayServicer_to_server(relay, server)
        server.start()
        relay_address = f"127.0.0.1:{port}"
        attachment = Attachment(lambda: (relay_id, relay_address), stage1, addresses[1]).start()
        route = RelayRoute(peers[1], relay_id, relay_address)

        def routes(address: str) -> RelayRoute | None:
            return route if address == addresses[1] else None

        trainer_tunnels = Tunnels(CallSigner(trainer), routes)
        neighbour_tunnels = Tunnels(stage0, routes, local=relay if relay_is_neighbour else None)
        try:
            assert attachment.attached.wait(10)
            old = hosts[0].outbox.connector  # stage 0 dials stage 1 through the relay from now on
            hosts[0].outbox.connector = GrpcConnector(
                old.channels.config, old.signer, old.resolve, neighbour_tunnels.dial
            )
            book = dict(zip(addresses, peers, strict=True))
            connector = GrpcConnector(signer=CallSigner(trainer), resolve=book.get, dial=trainer_tunnels.dial)
            pipe = PipelineDriver(addresses, peers, "1f1b", 2, deadline_s=30.0, connector=connector)
            losses = [pipe.train_step(step, b).loss for step, b in enumerate(data)]
            pipe.close()
            return losses, [h.worker.module.state_dict() for h in hosts], metrics.snapshot()
        finally:
            trainer_tunnels.close()
            neighbour_tunnels.close()
            attachment.close()
            server.stop(grace=None)


@pytest.mark.parametrize("relay_is_neighbour", [False, True], ids=["relay-peer", "neighbour"])
def test_a_stage_behind_nat_trains_exactly_as_a_reachable_one(relay_is_neighbour):
    data = [b for _ in range(2) for b in batches(2, seed=3)]  # samples come back: AQ-SGD deltas cross the tunnel
    started = time.monotonic()
    expected, weights = train_direct(data)
    losses, relayed_weights, counted = train_relayed(data, relay_is_neighbour)
    assert losses == expected  # float equality, step for step
    for a, b in zip(weights, relayed_weights, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    links = {k: v for k, v in counted.items() if k.startswith("swarm_relayed_bytes_total")}
    # the trainer's calls to stage 1 always cross the relay; stage 0's too unless it is the relay (then they do
    # not cross any wire twice, but the in-process pipe still counts them)
    assert len(links) == 4 and all(v > 0 for v in links.values()), links
    assert time.monotonic() - started < 60
