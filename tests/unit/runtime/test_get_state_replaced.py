"""GetState never serves a host its peer replaced in place: a replica swapped out because it fell behind keeps
its stale weights as `previous`, and once the current host moved on to the next plan, a request for the old
plan's state found only the stale one (the churn test's joiner took step 17 while the stage had applied 20)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from swarm.model.gpt import ModelConfig
from swarm.net.connect import LocalRpcError, _LocalContext, method_path
from swarm.proto import stage_pb2
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.daemon.test_held import decode, servicer_of

TINY = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=32, n_layers=3, n_heads=2)


def at_version(host, version: int, steps: int):
    host.apply(dataclasses.replace(host.assignment, role=dataclasses.replace(host.role, plan_version=version)))
    host.restore(steps)
    return host


def get_state(pipe, servicer, stage: int, version: int) -> int:
    """The steps of the state `servicer` serves for (`stage`, `version`), asked by a peer of the plan."""
    request = stage_pb2.StateRequest(stage=stage, plan_version=version)
    signer, callee = pipe.hosts[1].outbox.connector.signer, pipe.hosts[0].peer_id
    metadata = signer.metadata(callee, method_path("GetState"), request)
    return int(decode(servicer.GetState(request, _LocalContext(metadata)))["meta.steps_done"].item())


def test_a_host_replaced_in_place_is_not_served_and_the_current_one_is_served_now():
    pipe, stale_pipe = LocalPipeline(TINY, 2), LocalPipeline(TINY, 2)
    try:
        servicer = servicer_of(pipe, 0)
        at_version(servicer.host, 4, 20)  # the current host: same stage and layers, moved on to plan 4
        servicer.previous = at_version(stale_pipe.hosts[0], 3, 17)  # swapped out at plan 3, retired (behind)
        with pytest.raises(LocalRpcError) as refused:
            get_state(pipe, servicer, 0, 3)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, "never the stale host's 17 steps"
        assert get_state(pipe, servicer, 0, 0) == 20, "as it is now: the current host"
        assert get_state(pipe, servicer, 0, 4) == 20
    finally:
        pipe.close()
        stale_pipe.close()


def test_a_previous_host_of_other_layers_still_hands_its_state_over():
    pipe, old_pipe = LocalPipeline(TINY, 2), LocalPipeline(TINY, 2)
    try:
        servicer = servicer_of(pipe, 0)
        at_version(servicer.host, 4, 20)
        servicer.previous = at_version(old_pipe.hosts[1], 3, 19)  # the stage this peer served before plan 4
        assert get_state(pipe, servicer, 1, 3) == 19, "a taker of the old stage gets it"
        assert get_state(pipe, servicer, 0, 4) == 20
    finally:
        pipe.close()
        old_pipe.close()
