"""Each stage call bound to itself (`swarm.runtime.policy.bind_calls`, `swarm.net.auth` proofs), in process: a
captured call sent again, or its token and proof put on another method or other fields, is refused with
UNAUTHENTICATED before the stage changes anything, and the plan's own calls still train."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.net.auth import CallSigner
from swarm.net.connect import LocalRpcError, _LocalContext, method_path
from swarm.net.stream import tokens_to_wire
from swarm.proto import stage_pb2
from swarm.runtime.inprocess import LocalPipeline

TINY = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=32, n_layers=3, n_heads=2)


def batch(n: int = 4) -> Batch:
    w = torch.randint(0, 64, (n, 9), generator=torch.Generator().manual_seed(0))
    return Batch(torch.arange(n), w[:, :-1], w[:, 1:])


def servicer_of(pipe: LocalPipeline, stage: int):
    registered = pipe.network._servicers[pipe.addresses[stage]]
    return getattr(registered, "target", registered)


def unauthenticated(fn, *args, match: str) -> None:
    with pytest.raises(LocalRpcError, match=match) as e:
        result = fn(*args)
        if hasattr(result, "__next__"):  # a server-streaming reply runs when read
            list(result)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()


def tokens_item(step: int, seed: int = 0) -> stage_pb2.StreamItem:
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    info = stage_pb2.CallInfo(step=step, micro_batch=0, stage=0, num_micro_batches=2)
    return stage_pb2.StreamItem(info=info, tokens=tokens_to_wire(tokens, torch.arange(2)))


@pytest.fixture
def pipe():
    pipe = LocalPipeline(TINY, 2)
    assert pipe.train_step(batch(), 2).loss > 0
    yield pipe
    pipe.close()


def test_a_captured_call_sent_again_is_refused_and_the_plan_still_trains(pipe):
    servicer, callee = servicer_of(pipe, 0), pipe.hosts[0].peer_id
    trainer = CallSigner(pipe.trainer)
    request = stage_pb2.Empty()
    metadata = trainer.metadata(callee, method_path("Status"), request)
    assert servicer.Status(request, _LocalContext(metadata)).stage == 0  # the trainer's own call
    unauthenticated(servicer.Status, request, _LocalContext(metadata), match="replayed call")
    assert pipe.train_step(batch(), 2).loss > 0


def test_a_captured_forward_cannot_become_a_step_abandon_or_grads(pipe):
    servicer, callee, host = servicer_of(pipe, 0), pipe.hosts[0].peer_id, pipe.hosts[0]
    trainer = CallSigner(pipe.trainer)
    item = tokens_item(step=7)
    forward = trainer.metadata(callee, method_path("Forward"), item.SerializeToString())
    steps_before = host.steps_done
    abandon = stage_pb2.StepRequest(step=7, abandon=True)
    unauthenticated(servicer.Step, abandon, _LocalContext(forward), match="bad call proof")
    unauthenticated(servicer.Grads, abandon, _LocalContext(forward), match="bad call proof")
    # a captured Step's proof does not carry over to another Step's fields either
    step = trainer.metadata(callee, method_path("Step"), stage_pb2.StepRequest(step=7))
    unauthenticated(servicer.Step, abandon, _LocalContext(step), match="bad call proof")
    assert host.steps_done == steps_before and host.open_step is None
    assert pipe.train_step(batch(), 2).loss > 0


def test_a_stream_whose_first_item_is_not_the_signed_one_is_refused_before_admission(pipe):
    servicer, callee, host = servicer_of(pipe, 0), pipe.hosts[0].peer_id, pipe.hosts[0]
    trainer = CallSigner(pipe.trainer)
    signed, sent = tokens_item(step=pipe._step, seed=1), tokens_item(step=pipe._step, seed=2)
    metadata = trainer.metadata(callee, method_path("Forward"), signed.SerializeToString())
    unauthenticated(servicer.Forward, iter([sent]), _LocalContext(metadata), match="bad call proof")
    assert host.open_step is None, "the refused stream opened no step"
    # the Sink (link probes) answers a bad proof alike, not as an internal error
    unauthenticated(servicer.Sink, iter([sent]), _LocalContext(metadata), match="bad call proof")
    assert pipe.train_step(batch(), 2).loss > 0


def test_a_token_without_a_proof_is_refused_on_every_method(pipe):
    servicer, callee = servicer_of(pipe, 1), pipe.hosts[1].peer_id
    token = CallSigner(pipe.trainer).metadata(callee)  # what a relay sees of the Attach it carries, say
    context = _LocalContext(token)
    unary = {
        "Status": stage_pb2.Empty(), "Ping": stage_pb2.PingRequest(), "Grads": stage_pb2.StepRequest(),
        "Step": stage_pb2.StepRequest(abandon=True), "GetState": stage_pb2.StateRequest(stage=1),
        "Probe": stage_pb2.ProbeRequest(), "Reduce": stage_pb2.ReduceRequest(),
        "PutLabels": stage_pb2.LabelsRequest(),
    }  # fmt: skip
    for name, request in unary.items():
        unauthenticated(getattr(servicer, name), request, context, match="missing call proof")
    for name in ("Forward", "Backward", "Sink", "Average"):
        unauthenticated(getattr(servicer, name), iter([tokens_item(0)]), context, match="missing call proof")


def test_without_auth_nothing_is_checked():
    pipe = LocalPipeline(TINY, 2, auth=False)
    assert servicer_of(pipe, 0).Status(stage_pb2.Empty(), _LocalContext()).stage == 0
    assert pipe.train_step(batch(), 2).loss > 0
    pipe.close()
