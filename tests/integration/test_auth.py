"""Authentication and authorization over real gRPC loopback stages: strangers are refused on every method
with the rule they broke, plan neighbours may make only their own calls, a forged route is refused without
opening a step, state goes only to plan peers, and the next legitimate step is served after each."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, frame, make_codec
from swarm.model.data import Batch
from swarm.net.auth import CallSigner, Identity
from swarm.net.connect import GrpcConnector
from swarm.net.stream import tokens_to_wire
from swarm.proto import stage_pb2
from tests.integration.swarm_fixtures import loopback_stages, remote, trainer_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FP32 = CodecConfig("fp32")


def batch(seed: int = 0) -> Batch:
    w = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    return Batch(torch.arange(2), w[:, :-1], w[:, 1:])


def info(addresses, peers, stage: int, step: int = 0) -> stage_pb2.CallInfo:
    return stage_pb2.CallInfo(
        step=step, micro_batch=0, stage=stage, num_micro_batches=1, schedule="gpipe",
        route=addresses, route_peers=peers, deadline_s=10,
    )  # fmt: skip


def token_item(call_info) -> bytes:
    tokens = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long), torch.arange(2))
    return stage_pb2.StreamItem(info=call_info, tokens=tokens).SerializeToString()


def activation_items(call_info) -> list[bytes]:
    msg = make_codec(FP32).encode(torch.randn(2, 16, 32), sample_ids=[0, 1])
    chunks = list(frame(msg, zstd_level=0))
    first = stage_pb2.StreamItem(info=call_info, chunk=chunks[0]).SerializeToString()
    return [first] + [stage_pb2.StreamItem(chunk=c).SerializeToString() for c in chunks[1:]]


def calls(addresses, peers, stage: int) -> dict:
    """Every method of stage `stage`, as a call with a plausible request."""
    last = len(addresses) - 1
    fw = token_item(info(addresses, peers, 0)) if stage == 0 else None
    return {
        "Forward": lambda s: s.Forward(iter([fw] if fw else activation_items(info(addresses, peers, stage))), 10),
        "Backward": lambda s: s.Backward(iter(activation_items(info(addresses, peers, stage))), 10),
        "PutLabels": lambda s: s.PutLabels(
            stage_pb2.LabelsRequest(info=info(addresses, peers, last), labels=tokens_to_wire(torch.zeros(2, 16))), 10
        ),
        "Grads": lambda s: s.Grads(stage_pb2.StepRequest(step=0), 10),
        "Step": lambda s: s.Step(stage_pb2.StepRequest(step=0, abandon=True), 10),
        "GetState": lambda s: list(s.GetState(stage_pb2.StateRequest(stage=stage), timeout=10)),
        "Status": lambda s: s.Status(stage_pb2.Empty(), 10),
        "Ping": lambda s: s.Ping(stage_pb2.PingRequest(), 10),
        "Probe": lambda s: s.Probe(stage_pb2.ProbeRequest(reply_bytes=8), 10),
        "Sink": lambda s: s.Sink(iter(activation_items(info(addresses, peers, stage))), 10),
    }


def outcome(call, stub) -> tuple[grpc.StatusCode, str]:
    try:
        call(stub)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


EXPECTED_RULE = {
    (0, "Forward"): "Forward into stage 0 only from a trainer",
    (1, "Forward"): "Forward into stage 1 only from the plan's peer of stage 0",
    (0, "Backward"): "Backward into stage 0 only from the plan's peer of stage 1",
    (1, "Backward"): "Backward into the last stage only from a trainer",
    (0, "PutLabels"): "PutLabels only from a trainer",
    (1, "PutLabels"): "PutLabels only from a trainer",
    (0, "Grads"): "Grads only from a trainer",
    (1, "Grads"): "Grads only from a trainer",
    (0, "Step"): "Step only from a trainer",
    (1, "Step"): "Step only from a trainer",
    (0, "GetState"): "GetState only to a peer of the plan",
    (1, "GetState"): "GetState only to a peer of the plan",
}


def test_strangers_are_refused_on_every_method_and_the_next_step_is_served():
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        peers = [h.peer_id for h in hosts]
        stranger = GrpcConnector(signer=CallSigner(Identity.generate()))
        anonymous = GrpcConnector()
        for stage in (0, 1):
            for method, call in calls(addresses, peers, stage).items():
                code, details = outcome(call, anonymous.stage(addresses[stage], peers[stage]))
                assert code == grpc.StatusCode.UNAUTHENTICATED and "missing call token" in details, (method, details)
                code, details = outcome(call, stranger.stage(addresses[stage], peers[stage]))
                rule = EXPECTED_RULE.get((stage, method))
                if rule is None:  # Status, Ping, Probe, Sink: any authenticated caller
                    assert code == grpc.StatusCode.OK, (stage, method, details)
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED and rule in details, (stage, method, details)
            # a token for another callee is refused too
            code, details = outcome(calls(addresses, peers, stage)["Status"], stranger.stage(addresses[stage], "x"))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "wrong audience" in details
        assert [h.open_step for h in hosts] == [None, None], "no refused call opened a step"
        pipe = remote(addresses, "gpipe", n_micro=1)
        assert pipe.train_step(0, batch()).loss > 0
        pipe.close()
        stranger.close()
        anonymous.close()


def test_a_plan_neighbour_may_make_only_its_own_calls():
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        peers = [h.peer_id for h in hosts]
        # stage 0's own key (as a compromised or buggy stage 0 would use it) against stage 1
        stage0 = GrpcConnector(signer=CallSigner(hosts[0].outbox.connector.signer.identity))
        stub = stage0.stage(addresses[1], peers[1])
        refused = {}
        for method, call in calls(addresses, peers, 1).items():
            code, details = outcome(call, stub)
            refused[method] = code == grpc.StatusCode.PERMISSION_DENIED
            if refused[method]:
                assert EXPECTED_RULE[(1, method)] in details
        # its own call (Forward into stage 1) and state transfer pass authorization
        assert refused == {
            "Forward": False, "Backward": True, "PutLabels": True, "Grads": True, "Step": True,
            "GetState": False, "Status": False, "Ping": False, "Probe": False, "Sink": False,
        }  # fmt: skip
        stage0.close()


def test_a_forged_route_is_refused_and_the_next_step_is_served():
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        peers, trainer = trainer_of(addresses)
        client = GrpcConnector(signer=CallSigner(trainer))
        stage0 = client.stage(addresses[0], peers[0])
        # the trainer (or whoever holds its key) names an attacker's address as stage 1
        for route, route_peers in (([addresses[0], "127.0.0.1:1"], peers), (addresses, [peers[0], "evil"])):
            forged = info(route, route_peers, 0)
            code, details = outcome(lambda s, f=forged: s.Forward(iter([token_item(f)]), 10), stage0)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "route" in details, details
        assert hosts[0].open_step is None, "the forged call opened no step"
        pipe = remote(addresses, "gpipe", n_micro=1)
        assert pipe.train_step(0, batch()).loss > 0
        pipe.close()
        client.close()


def test_state_goes_only_to_plan_peers():
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        peers, trainer = trainer_of(addresses)
        request = stage_pb2.StateRequest(stage=0)
        neighbour = GrpcConnector(signer=CallSigner(hosts[1].outbox.connector.signer.identity))
        assert list(neighbour.stage(addresses[0], peers[0]).GetState(request, timeout=10))
        named = GrpcConnector(signer=CallSigner(trainer))  # the trainer the roster names referees disputes with it
        assert list(named.stage(addresses[0], peers[0]).GetState(request, timeout=10))
        named.close()
        outsider = GrpcConnector(signer=CallSigner(Identity.generate()))  # neither a plan peer nor a trainer
        with pytest.raises(grpc.RpcError, match="GetState only to a peer of the plan") as e:
            list(outsider.stage(addresses[0], peers[0]).GetState(request, timeout=10))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        neighbour.close()
        outsider.close()


def test_a_private_run_serves_only_secret_holders():
    with loopback_stages(1, FP32, FP32, run_secret="s3cret") as (_, _, addresses):
        peers, trainer = trainer_of(addresses)
        outsider = GrpcConnector(signer=CallSigner(Identity.generate()))
        with pytest.raises(grpc.RpcError, match="run secret") as e:
            outsider.stage(addresses[0], peers[0]).Status(stage_pb2.Empty(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        insider = GrpcConnector(signer=CallSigner(Identity.generate(), run_secret="s3cret"))
        assert insider.stage(addresses[0], peers[0]).Status(stage_pb2.Empty(), timeout=10).stage == 0
        trainer_without = GrpcConnector(signer=CallSigner(trainer))
        with pytest.raises(grpc.RpcError, match="run secret"):
            trainer_without.stage(addresses[0], peers[0]).Step(stage_pb2.StepRequest(step=0, abandon=True), timeout=10)
        for c in (outsider, insider, trainer_without):
            c.close()


def test_a_malformed_or_oversized_ping_is_refused_and_the_stage_still_answers():
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        with grpc.insecure_channel(addresses[1]) as channel:
            raw = channel.unary_unary("/swarm.Stage/Ping")  # bytes in, bytes out: no client-side checks
            for body in (b"\xff\xff\xff", b"\x0a\x05abc", bytes(8 << 20)):  # garbage, truncated, past the limit
                with pytest.raises(grpc.RpcError) as e:
                    raw(body, timeout=10)
                assert e.value.code() != grpc.StatusCode.OK
        stranger = GrpcConnector(signer=CallSigner(Identity.generate()))
        assert stranger.stage(addresses[1], hosts[1].peer_id).Ping(stage_pb2.PingRequest(), 10) == stage_pb2.Empty()
        stranger.close()


def test_a_replayed_or_repurposed_call_is_refused_over_grpc_and_signed_channels_sign_each_call():
    from swarm.net.connect import SignedChannels, method_path, status_of
    from swarm.net.stream import TensorStreams
    from swarm.peers.transport import Channels, TransportConfig
    from swarm.proto import stage_pb2_grpc

    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        peers, trainer = trainer_of(addresses)
        signer = CallSigner(trainer)
        with grpc.insecure_channel(addresses[0]) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            captured = signer.metadata(peers[0], method_path("Status"), stage_pb2.Empty())
            assert stub.Status(stage_pb2.Empty(), metadata=captured, timeout=10).stage == 0
            with pytest.raises(grpc.RpcError, match="replayed call") as e:
                stub.Status(stage_pb2.Empty(), metadata=captured, timeout=10)  # the same call, sent again
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            abandon = stage_pb2.StepRequest(step=0, abandon=True)
            forward = signer.metadata(peers[0], method_path("Forward"), token_item(info(addresses, peers, 0)))
            with pytest.raises(grpc.RpcError, match="bad call proof") as e:
                stub.Step(abandon, metadata=forward, timeout=10)  # a captured Forward turned into an abandon
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # raw stubs on SignedChannels (link probes, state transfers): every call, unary or stream, its own proof
        signed = SignedChannels(
            Channels(TransportConfig()), CallSigner(Identity.generate()), dict(zip(addresses, peers, strict=True)).get
        )
        for _ in range(2):
            assert status_of(signed.get(addresses[1]), 10).stage == 1
            sink = TensorStreams(signed.get(addresses[1])).Sink(
                iter(activation_items(info(addresses, peers, 1))), timeout=10
            )
            assert sink.wire_bytes > 0
        signed.close()
        pipe = remote(addresses, "gpipe", n_micro=1)
        assert pipe.train_step(0, batch()).loss > 0
        pipe.close()
