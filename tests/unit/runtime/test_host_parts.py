"""The stage host's parts: what the plan assigns it (`apply`), its step ledger, its outbox, the driver's call
router, and the dataclasses the servicer turns into protobuf and back."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from swarm.compression import CodecConfig
from swarm.net.connect import LocalNetwork, LocalRpcError
from swarm.net.stream import PLAN_MISMATCH, CallRefused
from swarm.proto import stage_pb2
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.budget import StageBudget
from swarm.runtime.callinfo import info_from_wire, info_to_wire
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.gate import GateError
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.ledger import StepLedger
from swarm.runtime.messages import CallInfo, GradReport, ReduceOrder, ReduceReport, StageStatus, StepOrder
from swarm.runtime.outbox import Outbox
from swarm.runtime.service import StageServicer, reduce_order, step_order
from swarm.runtime.worker import StageConfig
from tests.unit.runtime.test_replicas import CFG, batch

torch.set_num_threads(1)

FP32 = CodecConfig("fp32")


def _host(on_step=None) -> StageHost:
    return StageHost(StageRole(0, 2, 0, 2), CFG, StageConfig(), LinkEnds(FP32, FP32), "p0", None, on_step=on_step)


# ---- apply: what the plan assigns the host ------------------------------------------------------------------


def test_apply_moves_the_host_to_the_new_plan_and_its_calls_follow():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe", auth=False)
    try:
        pipe.train_step(batch(), 2)
        for host in pipe.hosts:  # both stages follow plan 1 from now on; the trainer still names plan 0
            moved = dataclasses.replace(host.role, plan_version=1)
            host.apply(dataclasses.replace(host.assignment, role=moved, compute_layers_per_s=7.5))
        with pytest.raises(Exception, match=PLAN_MISMATCH):
            pipe.train_step(batch(seed=1), 2)
        assert [h.steps_done for h in pipe.hosts] == [1, 1] and all(h.open_step is None for h in pipe.hosts)
        status = pipe.hosts[1].status()
        assert (status.plan_version, status.compute_layers_per_s) == (1, 7.5)
    finally:
        pipe.close()


def test_apply_refuses_other_layers_and_takes_new_links_and_epilogue_codecs():
    host = _host()
    other = dataclasses.replace(host.role, layer_end=3)
    with pytest.raises(ValueError, match="serves layers"):
        host.apply(dataclasses.replace(host.assignment, role=other))
    links, tied = LinkEnds(CodecConfig.parse("aqsgd4"), FP32), CodecConfig.parse("gradq8")
    host.apply(dataclasses.replace(host.assignment, links=links, epilogue=(None, tied)))
    assert host.links is links and str(links.device) == host.device
    assert host.averager.codecs == {False: None, True: tied}
    host.averager.set_codecs(None, FP32)  # set on the averager directly (an experiment's override) ...
    host.apply(dataclasses.replace(host.assignment, compute_layers_per_s=2.0))
    assert host.averager.codecs[True] == FP32  # ... an assignment with the same epilogue leaves it


def test_restore_counts_on_and_never_back():
    host = _host()
    host.restore(7)
    host.restore(3)
    assert host.steps_done == 7 and host.status().steps_done == 7


def test_on_step_runs_after_every_applied_step_only():
    seen: list[StageHost] = []
    network = LocalNetwork()
    host = StageHost(
        StageRole(0, 1, 0, CFG.n_layers), CFG, StageConfig(), LinkEnds(FP32, FP32), "p0", network, on_step=seen.append
    )
    network.register("local:0", StageServicer(host), "p0")
    driver = PipelineDriver(["local:0"], ["p0"], "gpipe", 2, connector=network)
    try:
        driver.train_step(0, batch())
        assert seen == [host] and host.steps_done == 1
        driver.forward_backward(1, batch(seed=1))
        driver.abandon(1)  # abandoning applies nothing: no hook
        assert seen == [host] and host.open_step is None
    finally:
        driver.close()


# ---- the ledger ---------------------------------------------------------------------------------------------


def test_the_ledger_tracks_the_open_step_its_calls_and_applied_steps():
    ledger = StepLedger()
    assert ledger.open(4, "trainer") and not ledger.open(4, "trainer")  # the second call joins the step
    assert not ledger.may_close(5, "trainer", stale_s=60), "calls in flight: never replaced"
    assert not ledger.leave()
    assert ledger.leave(), "no call left and no progress: the step closes again"
    assert ledger.may_close(5, "trainer", stale_s=60) and not ledger.may_close(5, "stranger", stale_s=60)
    with pytest.raises(GateError):
        ledger.still(True, 3, mb=0)  # another step's call
    ledger.still(True, 4, mb=0)
    assert ledger.progressed and not ledger.idle_unused()
    ledger.abandoned(4, attempt_id=9)
    with pytest.raises(CallRefused):
        ledger.check_attempt(4, 9)
    ledger.check_attempt(4, 10)
    with pytest.raises(CallRefused, match=PLAN_MISMATCH):
        ledger.check_apply(4, plan_version=1, own_version=0)
    ledger.check_apply(4, plan_version=0, own_version=0)
    ledger.close()
    ledger.record(4, lr=0.5)
    assert (ledger.steps_done, ledger.last_step, ledger.last_lr) == (1, 4, 0.5)
    assert ledger.applied(4, 0, 0) and not ledger.applied(4, 1, 0) and not ledger.applied(5, 0, 0)


# ---- the outbox ---------------------------------------------------------------------------------------------


def test_the_outbox_leaves_the_route_out_once_the_neighbour_took_it():
    outbox = Outbox(None, None, StageBudget())
    info = CallInfo(step=2, stage=0, plan_version=3, route=("a", "b"), route_peers=("p", "q"))
    nxt = outbox.to(info, 1)
    assert (nxt.stage, info.stage, nxt.route) == (1, 0, ("a", "b"))
    assert outbox.wire_info(nxt) is nxt, "not acknowledged yet: the route travels"
    outbox.acks.acked("q", 3, step=2)
    assert outbox.wire_info(nxt) is nxt, "not within the step it was acknowledged in"
    later = dataclasses.replace(nxt, step=3)
    bare = outbox.wire_info(later)
    assert bare == dataclasses.replace(later, route=(), route_peers=()) and len(later.route) == 2


def test_call_info_goes_to_the_wire_and_back_field_for_field():
    wire = stage_pb2.CallInfo(
        step=7, micro_batch=1, stage=2, plan_version=3, num_micro_batches=4, schedule="gpipe", route=["a", "b", "c"],
        route_peers=["p", "q", "r"], deadline_s=9.5, loss_weight=0.25, chain=5, stage_micro=[0, 1, 2],
        stage_micro_count=[3, 3, 4], tied=True, loss_scale=1024.0, attempt_id=0xFFFFFFFF,
    )  # fmt: skip
    assert {f.name for f in dataclasses.fields(CallInfo)} == _names(stage_pb2.CallInfo)
    info = info_from_wire(wire)
    assert info.route == ("a", "b", "c") and info.stage_micro_count == (3, 3, 4) and info.attempt_id == 0xFFFFFFFF
    assert info_to_wire(info).SerializeToString() == wire.SerializeToString()
    empty = stage_pb2.CallInfo(step=1)
    assert info_to_wire(info_from_wire(empty)).SerializeToString() == empty.SerializeToString(), "defaults stay off"


# ---- the driver's call router -------------------------------------------------------------------------------


def test_the_router_names_the_running_attempt_and_the_current_loss_scale():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe", auth=False)
    try:
        driver = pipe.driver(2)
        sent = []
        original = driver.router.send

        def send(stage, replica, method, request, timeout=None):
            if isinstance(request, stage_pb2.LabelsRequest):
                sent.append(request.info.attempt_id)
            return original(stage, replica, method, request, timeout)

        driver.router.send = send
        pipe.train_step(batch(), 2)
        first = driver.router.attempt_id
        pipe.train_step(batch(seed=1), 2)
        assert first and sent == [first, driver.router.attempt_id] and sent[0] != sent[1]
        driver.loss_scale = 4.0
        work = driver._work(batch(), [driver.routes[0]])[0]
        assert driver.router.info(5, 0, 1, work).loss_scale == 4.0
    finally:
        pipe.close()


# ---- the dataclasses at the edge ----------------------------------------------------------------------------


def _names(message) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}


def test_every_reply_field_is_carried_and_nothing_else():
    retired = {"tied_grad"}  # GradReply's retired tied gradient: never set
    assert {f.name for f in dataclasses.fields(GradReport)} == _names(stage_pb2.GradReply) - retired
    assert {f.name for f in dataclasses.fields(StageStatus)} == _names(stage_pb2.StatusReply)
    order = {f.name for f in dataclasses.fields(StepOrder)}
    assert order == _names(stage_pb2.StepRequest), "tied_grad_sum: whether the retired field came"
    assert {f.name for f in dataclasses.fields(ReduceOrder)} == _names(stage_pb2.ReduceRequest)
    # a Reduce reply also carries the stage's GradReport (as a Grads reply, checked above) under `grads`
    assert {f.name for f in dataclasses.fields(ReduceReport)} == _names(stage_pb2.ReduceReply) - {"grads"}


def test_a_reduce_request_becomes_its_order_field_for_field():
    request = stage_pb2.ReduceRequest(
        step=3, plan_version=2, stage=1, group_peers=["p", "q"], group_addresses=["a", "b"], deadline_s=4.0,
        tied_peers=["x"], tied_addresses=["y"],
    )  # fmt: skip
    order = reduce_order(request)
    assert order == ReduceOrder(3, 2, 1, ("p", "q"), ("a", "b"), 4.0, ("x",), ("y",))
    assert stage_pb2.ReduceRequest(**dataclasses.asdict(order)) == request


def test_a_step_request_becomes_its_order_field_for_field():
    request = stage_pb2.StepRequest(
        step=9, global_grad_norm=1.5, abandon=True, plan_version=4, skip=True, loss_scale=8.0,
        trainer_elapsed_s=0.25, frozen_layers=2, attempt_id=77,
    )  # fmt: skip
    assert step_order(request) == StepOrder(9, 1.5, True, 4, True, 8.0, 0.25, 2, 77, tied_grad_sum=False)
    request.tied_grad_sum.SetInParent()
    assert step_order(request).tied_grad_sum


def test_a_retired_tied_sum_is_refused_at_the_step_as_before():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe", auth=False)
    try:
        pipe.forward_backward(batch(), 2)
        request = stage_pb2.StepRequest(step=0, global_grad_norm=1.0)
        request.tied_grad_sum.SetInParent()
        with pytest.raises(LocalRpcError) as e:
            pipe.network.stage(pipe.replica_addresses[1][0]).Step(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tied_grad_sum" in e.value.details()
    finally:
        pipe.close()
