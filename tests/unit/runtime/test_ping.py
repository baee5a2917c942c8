"""The trainer's liveness pings (`Ping`): Status's answer without Status's reply bytes. Heartbeats and suspect
checks used to ask Status for its whole metrics map (~1.4 KB a ping, counted in the step's control bytes)."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarm.net.auth import CallSigner, Identity
from swarm.proto import stage_pb2
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.runtime.test_replicas import CFG, FP32, batch

torch.set_num_threads(1)


@pytest.fixture
def pipe():
    p = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe")
    p.train_step(batch(), 2)  # metrics to report
    yield p
    p.close()


def test_a_ping_is_counted_and_costs_no_reply_bytes(pipe):
    driver = pipe.driver(2)
    peer = driver.replica_peers[1][0]
    status = driver.status()[1]
    assert status.ByteSize() > 500, "the reply a heartbeat used to ask for"
    driver._control = 0
    assert driver._alive(peer) and driver._alive(peer), "a live peer answers, twice alike"
    assert driver._control == 0, "a ping moves an empty request and an empty reply"


def test_a_killed_or_non_serving_peer_fails_its_ping_and_an_older_peer_counts_as_alive(pipe):
    driver = pipe.driver(2)
    peers = [row[0] for row in driver.replica_peers]
    servicer = pipe.switches[0][0].target
    host, servicer.host = servicer.host, None  # between plans: not serving a stage
    try:
        assert not driver._alive(peers[0], timeout_s=5)
    finally:
        servicer.host = host
    assert driver._alive(peers[0], timeout_s=5)

    class Older:  # a peer of an earlier version: no Ping method (a refusal is an answer: it is alive)
        def __getattr__(self, name):
            if name == "Ping":

                def unimplemented(request, context):
                    context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

                return unimplemented
            return getattr(servicer, name)

    pipe.switches[0][0].target = Older()
    assert driver._alive(peers[0], timeout_s=5)
    pipe.switches[0][0].target = servicer
    pipe.kill(1)
    assert not driver._alive(peers[1], timeout_s=5)


def test_strangers_and_anonymous_callers_are_refused_a_ping(pipe):
    peer = pipe.hosts[0].peer_id
    address = pipe.driver(2).replica_addresses[0][0]
    for connector, code in (
        (pipe.network.connector(None), grpc.StatusCode.UNAUTHENTICATED),
        (pipe.network.connector(CallSigner(Identity.generate())), None),  # any authenticated caller, as Status
    ):
        stub = connector.stage(address, peer)
        if code is None:
            assert stub.Ping(stage_pb2.PingRequest(), timeout=5) == stage_pb2.Empty()
            continue
        with pytest.raises(grpc.RpcError) as e:
            stub.Ping(stage_pb2.PingRequest(), timeout=5)
        assert e.value.code() == code
