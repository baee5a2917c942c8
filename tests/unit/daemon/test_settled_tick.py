"""A peer that serves the plan it follows and plans nothing takes its whole look at the DHT every `SETTLED_TICK_S`
and reads nothing in between; every other peer looks whole every `FOLLOW_TICK_S`; a call that follows a newer plan
than its stage's, or a ping that says one (the planner's heartbeat), makes it look at its next tick and wakes the
plan loop at most once a tick."""

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


def _daemon(
    version: int = 3, serving: int | None = 3, leading: bool = False, adopted_s_ago: float = 60.0, quiet: bool = False
):
    daemon = PeerDaemon(PeerConfig())
    daemon.following = SimpleNamespace(version=version)
    host = None if serving is None else SimpleNamespace(role=SimpleNamespace(plan_version=serving))
    daemon.servicer = SimpleNamespace(host=host)
    daemon._adopted_at = time.monotonic() - adopted_s_ago
    daemon.dht = SimpleNamespace()  # a settled peer's look reads nothing between its whole looks
    return daemon, SimpleNamespace(leading=leading, quiet_for=lambda seconds: quiet and seconds == SETTLED_AFTER_S)


def test_a_settled_peer_looks_whole_rarely_and_every_other_often():
    assert SETTLED_TICK_S > FOLLOW_TICK_S
    later = time.monotonic() + 60.0  # the next whole look of a settled peer is a minute away
    daemon, planner = _daemon()
    assert daemon._settled(planner) and not daemon._look_due(planner, False, later)
    assert daemon._look_due(planner, False, time.monotonic()), "its whole look is due"
    assert daemon._look_due(planner, True, later), "something woke it"
    daemon._told_newer(3)
    assert not daemon._look_due(planner, False, later) and not daemon._wake.is_set(), "its own plan is no news"
    daemon._told_newer(4)
    assert daemon._look_due(planner, False, later) and daemon._wake.is_set(), "a newer plan is out: looked at now"
    planning, its_planner = _daemon(leading=True, quiet=True)
    assert planning._settled(its_planner), "the planner of a swarm quiet for SETTLED_AFTER_S"
    standby, its_planner = _daemon(serving=None, leading=True, quiet=True)
    assert standby._settled(its_planner), "... its standby too: it hears of its own plans first"
    behind, its_planner = _daemon(serving=2, leading=True, quiet=True)
    assert not behind._settled(its_planner), "a planner whose own stage is still on the plan before"
    unsettled = {
        "the planner of a swarm that changed lately": _daemon(leading=True),
        "no stage (standby, joining)": _daemon(serving=None),
        "its stage on the plan before": _daemon(serving=2),
        "a plan just adopted": _daemon(adopted_s_ago=SETTLED_AFTER_S / 2),
    }
    for why, (peer, its_planner) in unsettled.items():
        assert not peer._settled(its_planner) and peer._look_due(its_planner, False, later), why
    none = PeerDaemon(PeerConfig())
    none.servicer = SimpleNamespace(host=None)
    assert not none._settled(planner), "no plan yet"
    leaving, _ = _daemon()
    leaving.leave()
    assert not leaving._settled(planner) and leaving._wake.is_set(), "a leave wakes the loop and unsettles it"
    stopping, _ = _daemon()
    stopping.stop()
    assert stopping._wake.is_set(), "a stop wakes the loop"


def test_news_of_a_newer_plan_wakes_the_loop_at_most_once_a_tick_and_is_kept_for_the_next():
    daemon, planner = _daemon()
    later = time.monotonic() + 60.0
    daemon._told_newer(9)
    assert daemon._wake.is_set()
    daemon._wake.clear()
    daemon._told = False  # the whole look it woke for began
    for version in range(10, 50):  # a liar (or a burst of heartbeats) within one tick
        daemon._told_newer(version)
    assert not daemon._wake.is_set(), "woken once a tick at most"
    assert daemon._look_due(planner, False, later), "the news waits for the loop's next tick"
    daemon._told_woke_at -= FOLLOW_TICK_S
    daemon._told_newer(51)
    assert daemon._wake.is_set(), "a tick later it wakes the loop again"


def _stage_on_plan_3() -> tuple[object, list[int]]:
    """An in-process stage 1 of 2 serving plan 3: its client, and the versions its `on_newer_plan` was told."""
    network = LocalNetwork()
    host = StageHost(StageRole(1, 2, 1, 2, plan_version=3), TINY, StageConfig(), LinkEnds(FP32, FP32), "p1", network)
    servicer = StageServicer(host)
    network.register("local:1", servicer)
    told: list[int] = []
    servicer.on_newer_plan = told.append
    return network.stage("local:1"), told


def test_a_ping_that_says_a_newer_plan_tells_the_daemon():
    stub, told = _stage_on_plan_3()
    assert stub.Ping(stage_pb2.PingRequest(), timeout=5) == stage_pb2.Empty()
    assert told == [], "a plain ping (the trainer's, an older planner's) says nothing"
    stub.Ping(stage_pb2.PingRequest(newest_plan=7), timeout=5)
    assert told == [7]


def test_a_call_on_a_newer_plan_wakes_the_daemon_and_is_still_refused():
    stub, told = _stage_on_plan_3()

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


def test_a_strangers_ping_saying_a_newer_plan_is_refused_before_it_tells_anything():
    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.connect import _LocalContext, method_path

    me = Identity.generate()
    servicer = StageServicer(None, CallVerifier(me.peer_id))
    told = []
    servicer.on_newer_plan = told.append
    request = stage_pb2.PingRequest(newest_plan=1 << 62)
    with pytest.raises(LocalRpcError) as err:  # no token: a stranger
        servicer.Ping(request, _LocalContext(()))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and told == []
    caller = CallSigner(Identity.generate())
    metadata = caller.metadata(me.peer_id, method_path("Ping"), request)
    with pytest.raises(LocalRpcError):  # authenticated, but this peer serves no stage: refused, yet it was told
        servicer.Ping(request, _LocalContext(metadata))
    assert told == [1 << 62]
    with pytest.raises(LocalRpcError) as err:  # the same ping again: its proof was spent
        servicer.Ping(request, _LocalContext(metadata))
    assert told == [1 << 62], err.value.details()
