"""Lying stages over real gRPC (loopback stage servers): the refusal's blame and a stage's own failure reach the
trainer through gRPC status details naming the right peer; three strikes evict it."""

from __future__ import annotations

import pytest

from swarm.compression import CodecConfig
from swarm.runtime.routing import NoLiveRoute
from tests.integration.swarm_fixtures import loopback_stages, remote
from tests.integration.test_stage_service import batches
from tests.unit.runtime.test_liars import _Scaled

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FP32 = CodecConfig("fp32")


def test_scaled_activations_are_refused_naming_the_sender_over_grpc_and_evict_it(caplog):
    data = batches(16)
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        pipe = remote(addresses, n_micro=2)
        liar = pipe.peers[0]
        _Scaled(hosts[0], factor=300.0, after=4)  # from the host's step 4: 8 messages in the link's history
        try:
            results = [pipe.train_step(step, b) for step, b in enumerate(data[:6])]
            assert [r.skipped for r in results] == [False] * 4 + [True, True]
            with pytest.raises(NoLiveRoute, match="no live replica of stage 0"):
                pipe.train_step(6, data[6])
            assert pipe.suspects.banned_ids() == (liar,)
            assert all(h.steps_done == 4 and h.open_step is None for h in hosts)  # nothing of the lies applied
        finally:
            pipe.close()
    refusals = [r.getMessage() for r in caplog.records if "refused the activation" in r.getMessage()]
    assert refusals and all(f"from peer {liar}: RMS" in m and f"[suspect peer {liar}]" in m for m in refusals)


def test_nan_gradients_a_stage_refuses_to_send_name_it_over_grpc():
    data = batches(4)
    with loopback_stages(2, FP32, FP32) as (hosts, _, addresses):
        pipe = remote(addresses, n_micro=2)
        liar = pipe.peers[1]
        _Scaled(hosts[1], nan_grads=True)
        try:
            for step in range(2):
                assert pipe.train_step(step, data[step]).skipped
                assert pipe.suspects.strikes(liar) == step + 1 and pipe.suspects.strikes(pipe.peers[0]) == 0
            with pytest.raises(NoLiveRoute, match=f"stage 1 \\(peer {liar}"):
                pipe.train_step(2, data[2])
            assert all(h.steps_done == 0 and h.open_step is None for h in hosts)  # nothing of the NaNs applied
        finally:
            pipe.close()
