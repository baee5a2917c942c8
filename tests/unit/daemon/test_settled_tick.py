"""A peer that serves the plan it follows and plans nothing looks at the DHT every `SETTLED_TICK_S`, every other
peer every `FOLLOW_TICK_S`; a call that follows a newer plan than its stage's wakes the plan loop at once."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, make_codec
from swarm.daemon.peer import FOLLOW_TICK_S, SETTLED_AFTER_S, SETTLED_TICK_S, PeerDaemon
from swarm.daemon.peer_config import PeerConfig
from swarm.model.gpt import ModelConfig
from swarm.net.connect import LocalNetwork, LocalRpcError
from swarm.net.stream import PLAN_MISMATCH, tensor_items
from swarm.proto import stage_pb2
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig

TINY = ModelConfig(vocab_size=256, seq_len_tokens=16, hidden_dim=32, n_layers=2, n_heads=2)
FP32 = CodecConfig("fp32")


def _daemon(version: int = 3, serving: int | None = 3, leading: bool = False, adopted_s_ago: float = 60.0):
    daemon = PeerDaemon(PeerConfig())
    daemon.following = SimpleNamespace(version=version)
    host = None if serving is None else SimpleNamespace(role=SimpleNamespace(plan_version=serving))
    daemon.servicer = SimpleNamespace(host=host)
    daemon._adopted_at = time.monotonic() - adopted_s_ago
    return daemon, SimpleNamespace(leading=leading)


def test_a_settled_peer_looks_rarely_and_every_other_often():
    assert SETTLED_TICK_S > FOLLOW_TICK_S
    daemon, planner = _daemon()
    assert daemon._tick_s(planner) == SETTLED_TICK_S
    assert daemon._tick_s(SimpleNamespace(leading=True)) == FOLLOW_TICK_S, "the planner"
    assert _daemon(serving=None)[0]._tick_s(planner) == FOLLOW_TICK_S, "on standby or joining: no stage"
    assert _daemon(serving=2)[0]._tick_s(planner) == FOLLOW_TICK_S, "its stage still on the plan before"
    assert _daemon(adopted_s_ago=SETTLED_AFTER_S / 2)[0]._tick_s(planner) == FOLLOW_TICK_S, "a plan just adopted"
    none = PeerDaemon(PeerConfig())
    none.servicer = SimpleNamespace(host=None)
    assert none._tick_s(planner) == FOLLOW_TICK_S, "no plan yet"
    leaving, _ = _daemon()
    leaving.leave()
    assert leaving._tick_s(planner) == FOLLOW_TICK_S
    assert leaving._wake.is_set(), "a leave wakes the loop"
    stopping, _ = _daemon()
    stopping.stop()
    assert stopping._wake.is_set(), "a stop wakes the loop"


def test_a_call_on_a_newer_plan_wakes_the_daemon_and_is_still_refused():
    network = LocalNetwork()
    host = StageHost(StageRole(1, 2, 1, 2, plan_version=3), TINY, StageConfig(), LinkEnds(FP32, FP32), "p1", network)
    servicer = StageServicer(host)
    network.register("local:1", servicer)
    told = []
    servicer.on_newer_plan = told.append
    stub = network.stage("local:1")

    def forward(version: int):
        info = stage_pb2.CallInfo(step=0, micro_batch=0, stage=1, num_micro_batches=1, schedule="gpipe",
                                  route=["local:0", "local:1"], route_peers=["p0", "p1"], deadline_s=5,
                                  plan_version=version)  # fmt: skip
        items = list(tensor_items(info, make_codec(FP32).encode(torch.randn(2, 16, 32), sample_ids=[0, 1]), 0, None))
        with pytest.raises(LocalRpcError) as err:
            stub.Forward(items)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and PLAN_MISMATCH in err.value.details()

    forward(2)
    assert told == [], "an older plan's call tells nothing"
    forward(5)
    assert told == [5]
