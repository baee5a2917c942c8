"""Authorization by the plan's roster, on the in-process pipeline: each rule refuses by name, the plan's
own calls pass, and `auth=False` (measurement only) lets everything through."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.net.auth import CallSigner, Identity
from swarm.net.connect import LocalRpcError
from swarm.net.stream import CallRefused
from swarm.proto import stage_pb2
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.policy import CallPolicy, Roster

TINY = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=32, n_layers=3, n_heads=2)
ROSTER = Roster(("p0", "p1", "p2"), ("a0", "a1", "a2"), frozenset({"t"}), frozenset({"spare"}))


CHAIN0 = ROSTER.route(0)


def info(route=CHAIN0[0], peers=CHAIN0[1]) -> stage_pb2.CallInfo:
    return stage_pb2.CallInfo(route=list(route), route_peers=list(peers))


def denied(fn, *args, match: str) -> None:
    with pytest.raises(CallRefused, match=match) as e:
        fn(*args)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_roster_rules():
    policy = CallPolicy(ROSTER)
    policy.check_sender("Forward", 0, "t")
    policy.check_sender("Forward", 1, "p0")
    policy.check_sender("Backward", 2, "t")
    policy.check_sender("Backward", 0, "p1")
    policy.check_sender("PutLabels", 2, "t")
    policy.check_step("Step", "t")
    policy.check_state("spare")
    policy.check_state("p1")
    policy.check_route(info())
    denied(policy.check_sender, "Forward", 0, "p0", match="Forward into stage 0 only from a trainer")
    denied(policy.check_sender, "Forward", 2, "p0", match="Forward into stage 2 only from the plan's peer of stage 1")
    denied(policy.check_sender, "Backward", 0, "p2", match="Backward into stage 0 only from the plan's peer of stage 1")
    denied(policy.check_sender, "Backward", 2, "p1", match="Backward into the last stage only from a trainer")
    denied(policy.check_sender, "PutLabels", 2, "p1", match="PutLabels only from a trainer")
    denied(policy.check_step, "Step", "p0", match="Step only from a trainer")
    policy.check_state("t")  # the named trainer referees a dispute with the stage's weights (swarm.runtime.referee)
    denied(policy.check_state, "x", match="GetState only to a peer of the plan")
    denied(CallPolicy(dataclasses.replace(ROSTER, trainers=None)).check_state, "t", match="GetState only to a peer")
    denied(policy.check_route, info(route=("a0", "evil", "a2")), match="route")
    denied(policy.check_route, info(peers=("p0", "evil", "p2")), match="route")


def test_public_roster_lets_any_authenticated_caller_train_but_not_relay():
    policy = CallPolicy(Roster(("p0", "p1"), ("a0", "a1"), None, frozenset()))
    policy.check_sender("Forward", 0, "anyone")
    policy.check_step("Grads", "anyone")
    denied(policy.check_sender, "Forward", 1, "anyone", match="peer of stage 0")


def test_no_roster_serves_no_data_calls():
    denied(CallPolicy(None).check_sender, "Forward", 0, "t", match="no plan roster")
    denied(CallPolicy(None).check_state, "t", match="no plan roster")


def batch(n: int = 4) -> Batch:
    w = torch.randint(0, 64, (n, 9), generator=torch.Generator().manual_seed(0))
    return Batch(torch.arange(n), w[:, :-1], w[:, 1:])


def test_local_pipeline_authenticates_every_call():
    pipe = LocalPipeline(TINY, 2)
    assert pipe.train_step(batch(), 2).loss > 0  # the plan's own calls pass
    addr = pipe.addresses[0]
    anonymous = pipe.network.stage(addr)
    with pytest.raises(LocalRpcError, match="missing call token") as e:
        anonymous.Status(stage_pb2.Empty())
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stranger = pipe.network.connector(CallSigner(Identity.generate())).stage(addr)
    stranger.Status(stage_pb2.Empty())  # any authenticated caller may ask
    with pytest.raises(LocalRpcError, match="Step only from a trainer"):
        stranger.Step(stage_pb2.StepRequest(step=1, abandon=True))
    with pytest.raises(LocalRpcError, match="GetState only to a peer of the plan"):
        list(stranger.GetState(stage_pb2.StateRequest(stage=0)))
    assert pipe.train_step(batch(), 2).loss > 0
    pipe.close()


def test_auth_off_is_anonymous():
    pipe = LocalPipeline(TINY, 2, auth=False)
    pipe.network.stage(pipe.addresses[0]).Status(stage_pb2.Empty())
    assert pipe.train_step(batch(), 2).loss > 0
    pipe.close()


def test_an_unauthenticated_or_unauthorized_stream_is_refused_before_its_body_is_read():
    pipe = LocalPipeline(TINY, 2)
    pulled = []

    def body():
        for i in range(1000):  # stands for a huge stream
            pulled.append(i)
            yield stage_pb2.StreamItem().SerializeToString()

    anonymous = pipe.network.stage(pipe.addresses[1])
    with pytest.raises(LocalRpcError, match="not authenticated"):
        anonymous.Forward(body())
    stranger = pipe.network.connector(CallSigner(Identity.generate())).stage(pipe.addresses[1])
    with pytest.raises(LocalRpcError, match="only from the plan's peer of stage 0"):
        stranger.Forward(body())
    assert pulled == [0], "the stranger's own client took its first item to sign it; the stage read nothing"
    pipe.close()
