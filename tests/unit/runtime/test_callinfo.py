"""Routes from the plan, not from every call (`swarm.runtime.callinfo`): a trainer's call leaves the route out
once the peer took it under the plan, the stage fills it from its validated roster or refuses with
`route needed:`, and equal micro-batch loss weights travel as proto3's default 0."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from swarm.net.auth import CallSigner, Identity
from swarm.net.stream import CallRefused, StageCallError, tokens_to_wire
from swarm.proto import stage_pb2
from swarm.runtime.callinfo import (
    DEFAULT_DEADLINE_S,
    DEFAULT_SCHEDULE,
    ROUTE_NEEDED,
    RouteAcks,
    call_info,
    fill_route,
    plan_gives_route,
    route_needed,
)
from swarm.runtime.host import StageRole
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.messages import CallInfo
from swarm.runtime.policy import Roster
from tests.unit.runtime.test_replicas import CFG, FP32, batch

torch.set_num_threads(1)

ROSTER = Roster((("p0", "q0"), ("p1", "q1")), (("a0", "b0"), ("a1", "b1")), None, frozenset())
ROLE = StageRole(1, 2, 2, 4, plan_version=3, replica=1)


def bare(chain: int = 1, stage: int = 1, version: int = 3, **fields) -> CallInfo:
    fields = {k: tuple(v) for k, v in fields.items()}
    return CallInfo(step=5, stage=stage, chain=chain, plan_version=version, **fields)


def refused_for_route(info, roster, own="q1") -> None:
    with pytest.raises(CallRefused) as e:
        fill_route(info, roster, ROLE, own)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and ROUTE_NEEDED in e.value.details


def test_a_route_less_call_of_the_followed_plan_takes_its_chain_from_the_roster():
    info = fill_route(bare(), ROSTER, ROLE, "q1")
    assert (tuple(info.route), tuple(info.route_peers)) == ROSTER.route(1) == (("b0", "b1"), ("q0", "q1"))
    assert dataclasses.replace(info, route=(), route_peers=()) == bare(), "nothing else changes"


def test_a_carried_route_or_another_plan_or_stage_is_left_to_the_usual_checks():
    wrong = bare(route=["evil:1", "evil:2"], route_peers=["x", "y"])  # validated (and refused) by check_route
    half = bare(route=["b0", "b1"])  # malformed: addresses without peer ids; the host refuses its length
    for info in (wrong, half, bare(version=2), bare(version=4), bare(stage=0)):
        assert fill_route(info, ROSTER, ROLE, "q1") is info


def test_a_stage_that_cannot_take_the_route_from_its_plan_refuses_and_changes_nothing():
    refused_for_route(bare(), None)  # no roster yet (the plan's addresses are not all known)
    refused_for_route(bare(chain=2), ROSTER)  # the plan has 2 routes
    refused_for_route(bare(chain=0), ROSTER)  # route 0's stage 1 is p1, not this peer (q1)
    three = Roster(("p0", "p1", "p2"), ("a0", "a1", "a2"), None, frozenset())
    refused_for_route(bare(chain=0), three)  # a roster of another shape than the plan this stage follows


def test_equal_loss_weights_travel_as_zero_and_mean_the_same_share():
    kw = dict(step=1, micro_batch=0, stage=1, plan_version=0, schedule="1f1b", route=None, deadline_s=5.0, chain=0)
    for n, rows, total in ((4, 4, 16), (3, 5, 15), (7, 3, 21)):
        info = call_info(num_micro_batches=n, loss_weight=rows / total, loss_scale=0.0, **kw)
        assert info.loss_weight == 0.0 and (info.loss_weight or 1.0 / n) == rows / total
    uneven = call_info(num_micro_batches=4, loss_weight=5 / 16, loss_scale=0.0, **kw)
    assert uneven.loss_weight == 5 / 16
    assert (uneven.schedule, uneven.deadline_s) == ("", 5.0), "1f1b is the default, 5 s is not"
    default = call_info(num_micro_batches=4, loss_weight=0.25, loss_scale=1.0, **{**kw, "deadline_s": 120.0})
    assert (default.schedule, default.deadline_s) == ("", 0.0), "what the stage reads for the defaults"
    assert (default.schedule or DEFAULT_SCHEDULE, default.deadline_s or DEFAULT_DEADLINE_S) == ("1f1b", 120.0)
    gpipe = call_info(
        num_micro_batches=4, loss_weight=0.25, loss_scale=1.0, **{**kw, "schedule": "gpipe", "deadline_s": 120.0}
    )
    assert gpipe.schedule == "gpipe" and gpipe.ByteSize() == default.ByteSize() + len("gpipe") + 2
    full = call_info(num_micro_batches=4, loss_weight=0.25, loss_scale=0.0, **{**kw, "route": ROSTER.route(0)})
    assert list(full.route) == ["a0", "a1"] and full.ByteSize() > info.ByteSize() + 8


def test_route_acks_carry_until_taken_and_for_good_after_a_refusal():
    acks = RouteAcks()
    assert acks.carry("p", 1, step=0)
    acks.acked("p", 1, step=0)
    assert acks.carry("p", 1, step=0), "the rest of the acknowledged step carries it too: its bytes stay fixed"
    assert not acks.carry("p", 1, step=1) and acks.carry("p", 2, step=1) and acks.carry("q", 1, step=1)
    acks.refused("p", 1)
    acks.acked("p", 1, step=2)
    assert acks.carry("p", 1, step=3), "a peer that refused keeps getting the route under that plan"
    other = StageCallError("stage 1: not authorized", grpc.StatusCode.FAILED_PRECONDITION)
    assert route_needed(StageCallError(f"stage 1: {ROUTE_NEEDED} x", grpc.StatusCode.FAILED_PRECONDITION))
    assert not route_needed(other) and not route_needed(ValueError(ROUTE_NEEDED))


# ---- through the servicer: LocalPipeline, authenticated ---------------------------------------------------------


@pytest.fixture
def pipe():
    p = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe")
    yield p
    p.close()


def capture(driver) -> list[tuple[str, stage_pb2.CallInfo]]:
    """The CallInfo of every trainer call the driver makes from now on."""
    seen, original = [], driver.router.send

    def call(stage, replica, method, request, timeout=None):
        if isinstance(request, stage_pb2.LabelsRequest):  # a copy: in-process, the stage fills the one it is given
            seen.append((method, stage_pb2.CallInfo.FromString(request.info.SerializeToString())))
        elif method in ("Forward", "Backward"):
            items = list(request)
            seen.append((method, stage_pb2.StreamItem.FromString(items[0]).info))
            request = iter(items)
        return original(stage, replica, method, request, timeout)

    driver.router.send = call
    return seen


def test_calls_after_the_first_step_carry_no_route_and_train_alike(pipe):
    ref = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe")
    try:
        ref_driver = ref.driver(4)
        ref_driver.router.acks.carry = lambda peer, version, step: True  # today's calls: the route every time
        driver = pipe.driver(4)
        seen = capture(driver)
        losses = [pipe.train_step(batch(seed=s), 4).loss for s in range(3)]
        ref_losses = [ref.train_step(batch(seed=s), 4).loss for s in range(3)]
    finally:
        ref.close()
    assert losses == ref_losses, "the stage sends along the same route, taken from its plan"
    first, later = seen[:9], seen[9:]  # a step: one PutLabels, 4 Forwards, 4 Backward starts
    # the first call to each peer carries it (PutLabels to the last stage, Forward to stage 0); later calls of
    # step 1 may already leave it out (its micro-batches run at once), and the Backward follows its PutLabels
    firsts = {m: i for m, i in reversed(first)}
    assert all(len(firsts[m].route) == 2 and len(firsts[m].route_peers) == 2 for m in ("PutLabels", "Forward"))
    assert len(later) == 18
    assert all(not i.route and not i.route_peers and i.loss_weight == 0.0 for _, i in later)


def test_a_stage_without_the_plan_refuses_once_and_gets_the_route_again():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe", auth=False)  # no roster needed to serve
    driver = pipe.driver(2)
    pipe.train_step(batch(), 2)
    last = pipe.switches[1][0].target
    last.policy.roster = None  # lost its roster (e.g. the plan's addresses changed)
    try:
        seen = capture(driver)
        before = driver._control
        pipe.train_step(batch(seed=1), 2)
        refused = [i for m, i in seen if m == "PutLabels" and not i.route]
        assert len(refused) == 1, "refused once, then sent with the route"
        assert driver.router.acks.carry(driver.replica_peers[1][0], driver.plan_version, step=2)
        assert driver._control - before > 0
        seen.clear()
        pipe.train_step(batch(seed=2), 2)
        to_last = [i for m, i in seen if m in ("PutLabels", "Backward")]
        assert len(to_last) == 3 and all(len(i.route) == 2 for i in to_last), "the route for the rest of the plan"
        assert all(not i.route for m, i in seen if m == "Forward"), "stage 0 still takes it from its plan"
    finally:
        pipe.close()


def labels(pipe, info: stage_pb2.CallInfo, signer=None) -> grpc.StatusCode | None:
    """A PutLabels straight to the last stage, as `signer` (the trainer by default); the refusal's code."""
    connector = pipe.network.connector(CallSigner(signer or pipe.trainer))
    stub = connector.stage(pipe.replica_addresses[1][0], pipe.replica_peers[1][0])
    rows = torch.zeros(2, CFG.seq_len_tokens, dtype=torch.int64)
    try:
        stub.PutLabels(stage_pb2.LabelsRequest(info=info, labels=tokens_to_wire(rows)), timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return None


def test_strangers_other_plans_unknown_chains_and_duplicates(pipe):
    pipe.train_step(batch(), 2)
    ok = stage_pb2.CallInfo(step=9, micro_batch=0, stage=1, num_micro_batches=2, schedule="gpipe", deadline_s=10)
    code, details = labels(pipe, ok, signer=Identity.generate())
    assert code == grpc.StatusCode.PERMISSION_DENIED, "a stranger is refused before any route is looked at"
    other_plan = stage_pb2.CallInfo()
    other_plan.CopyFrom(ok)
    other_plan.plan_version = 7  # naming a plan the stage does not follow gets no route from anywhere
    code, details = labels(pipe, other_plan)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "plan 7" in details and ROUTE_NEEDED not in details
    beyond = stage_pb2.CallInfo()
    beyond.CopyFrom(ok)
    beyond.chain = 5
    code, details = labels(pipe, beyond)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and ROUTE_NEEDED in details
    assert labels(pipe, ok) is None and labels(pipe, ok) is None, "a duplicate is served as with a route"
    host = pipe.replica_hosts[1][0]
    assert host.open_step == 9 and set(host.labels) == {0}
    forged = stage_pb2.CallInfo()
    forged.CopyFrom(ok)
    forged.route.extend(["evil:1", pipe.replica_addresses[1][0]])
    forged.route_peers.extend(pipe.replica_peers[0][0:1] + pipe.replica_peers[1][0:1])
    code, details = labels(pipe, forged)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "route" in details, "a carried route is checked as before"
    nan = stage_pb2.CallInfo()
    nan.CopyFrom(ok)
    nan.loss_weight = float("nan")
    code, _ = labels(pipe, nan)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_route_needed_tells_the_addressed_peers_refusal_from_a_stage_further_on():
    own = StageCallError(f"stage 1 (peer q1 at b1): {ROUTE_NEEDED} x", grpc.StatusCode.FAILED_PRECONDITION)
    further = StageCallError(f"stage 2 (peer q2 at b2): {ROUTE_NEEDED} x", grpc.StatusCode.FAILED_PRECONDITION)
    assert route_needed(own, "q1") and not route_needed(further, "q1") and route_needed(further)
    assert not route_needed(StageCallError(f"stage 1 (peer q1 at b1): {ROUTE_NEEDED}", grpc.StatusCode.ABORTED))
    # the same peer and code, another refusal: a late call of an abandoned attempt is not asked for its route (the
    # suite once saw stage 0 then get the route for the rest of the plan)
    late = StageCallError(
        "stage 0 (peer q0 at b0): that attempt of step 1 was abandoned", grpc.StatusCode.FAILED_PRECONDITION
    )
    assert not route_needed(late, "q0") and not route_needed(late)
    relayed = StageCallError(
        f"stage 0 (peer q0 at b0): stage 1 (peer q1 at b1): {ROUTE_NEEDED} x", grpc.StatusCode.FAILED_PRECONDITION
    )
    assert route_needed(relayed, "q1") and not route_needed(relayed, "q0")


def test_plan_route_only_for_the_route_this_stages_roster_gives():
    assert plan_gives_route(bare(route=["b0", "b1"], route_peers=["q0", "q1"]), ROSTER, ROLE, "q1")
    assert not plan_gives_route(bare(route=["b0", "evil"], route_peers=["q0", "q1"]), ROSTER, ROLE, "q1")
    assert not plan_gives_route(bare(route=["b0", "b1"], route_peers=["q0", "q1"]), None, ROLE, "q1")
    assert not plan_gives_route(bare(version=2, route=["b0", "b1"], route_peers=["q0", "q1"]), ROSTER, ROLE, "q1")
    assert not plan_gives_route(bare(chain=0, route=["a0", "a1"], route_peers=["p0", "p1"]), ROSTER, ROLE, "q1")


def boundary_infos(pipe) -> list[tuple[int, stage_pb2.CallInfo]]:
    """The call info of every boundary call the hosts send from now on: (sending stage, info)."""
    seen = []
    for s, host in enumerate(h for row in pipe.replica_hosts for h in row):
        original = host.outbox.call

        def call(info, method, items, retry_on=None, s=s, original=original):
            items = list(items)
            seen.append((s, stage_pb2.StreamItem.FromString(items[0]).info))
            return original(info, method, iter(items), retry_on)

        host.outbox.call = call
    return seen


def test_boundary_calls_leave_the_route_out_once_the_neighbour_said_so(pipe):
    seen = boundary_infos(pipe)
    pipe.train_step(batch(), 4)
    assert any(len(i.route) == 2 for _, i in seen), "the first calls carry it"
    seen.clear()
    before = pipe.train_step(batch(seed=1), 4)
    assert len(seen) == 8 and all(not i.route and not i.route_peers for _, i in seen)
    assert {s for s, _ in seen} == {0, 1} and before.loss > 0


def test_a_neighbour_that_lost_the_plan_refuses_and_the_step_runs_again_with_the_route():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe", auth=False)
    try:
        pipe.train_step(batch(), 2)
        pipe.train_step(batch(seed=1), 2)  # every peer said plan_route
        host0 = pipe.replica_hosts[0][0]
        peer1 = pipe.replica_peers[1][0]
        assert not host0.outbox.acks.carry(peer1, 0, step=2)
        pipe.switches[1][0].target.policy.roster = None
        driver = pipe.driver(2)
        driver.router.acks.refused(peer1, 0)  # the trainer's calls to it carry the route: stage 0's Forward fails
        seen = boundary_infos(pipe)
        r = pipe.train_step(batch(seed=2), 2)
        assert r.attempts == 2 and r.loss > 0, "refused by stage 1 inside the step: abandoned, run again"
        assert host0.outbox.acks.carry(peer1, 0, step=3)
        assert [h.steps_done for h in pipe.hosts] == [3, 3]
        from0 = [i for s, i in seen if s == 0]  # stage 0's Forwards: route-less (refused), then with it
        assert not from0[0].route and all(len(i.route) == 2 for i in from0[-2:])
    finally:
        pipe.close()


# ---- labels once per chain -------------------------------------------------------------------------------------


def test_one_putlabels_per_chain_carries_every_micro_batch_and_trains_alike(pipe):
    ref = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe")
    try:
        ref_driver = ref.driver(4)
        per_micro = ref_driver.router.labels
        ref_driver.router.labels = lambda step, work, layout=None: per_micro(step, work, layout, max_rows=4)  # one each
        seen, ref_seen = capture(pipe.driver(4)), capture(ref_driver)
        losses = [pipe.train_step(batch(seed=s), 4) for s in range(3)]
        ref_losses = [ref.train_step(batch(seed=s), 4) for s in range(3)]
    finally:
        ref.close()
    assert [r.loss for r in losses] == [r.loss for r in ref_losses]
    assert [m for m, _ in seen].count("PutLabels") == 3 and [m for m, _ in ref_seen].count("PutLabels") == 12
    assert sum(r.control_bytes for r in losses[1:]) < sum(r.control_bytes for r in ref_losses[1:])


def test_labels_of_several_micro_batches_are_checked_whole():
    p = LocalPipeline(CFG, 2, FP32, FP32, schedule="gpipe")
    try:
        host = p.replica_hosts[1][0]
        rows = torch.arange(6 * CFG.seq_len_tokens).view(6, -1) % CFG.vocab_size
        labels = tokens_to_wire(rows)
        info = stage_pb2.CallInfo(step=1, micro_batch=1, stage=1, num_micro_batches=4)
        parts = host.check_labels(info, labels, [2, 4])
        assert [mb for mb, _ in parts] == [1, 2] and torch.equal(torch.cat([t for _, t in parts]), rows)
        assert [mb for mb, _ in host.check_labels(info, labels)] == [1], "no micro_rows: the call's micro-batch"
        uneven = stage_pb2.CallInfo(step=1, stage=1, num_micro_batches=2, stage_micro=[0, 2], stage_micro_count=[2, 4])
        assert [mb for mb, _ in host.check_labels(uneven, labels, [3, 3])] == [2, 3], "the replica's own numbers"
        for bad in ([2, 3], [6, 0], [1, 1, 1, 3], [7], [2**32 - 1, 7]):  # sums, empty rows, beyond the count
            with pytest.raises(Exception, match="micro_rows"):
                host.check_labels(info, labels, bad)
        big = tokens_to_wire(torch.zeros(host.budget.max_batch + 1, 4, dtype=torch.long))
        with pytest.raises(Exception, match="exceed the budget"):
            host.check_labels(info, big, [host.budget.max_batch, 1])
    finally:
        p.close()


def test_malformed_micro_rows_over_the_wire_are_refused_and_store_nothing(pipe):
    pipe.train_step(batch(), 2)
    connector = pipe.network.connector(CallSigner(pipe.trainer))
    stub = connector.stage(pipe.replica_addresses[1][0], pipe.replica_peers[1][0])
    info = stage_pb2.CallInfo(step=9, stage=1, num_micro_batches=2, schedule="gpipe", deadline_s=10)
    rows = tokens_to_wire(torch.zeros(4, CFG.seq_len_tokens, dtype=torch.long))
    with pytest.raises(grpc.RpcError) as e:
        stub.PutLabels(stage_pb2.LabelsRequest(info=info, labels=rows, micro_rows=[1, 1, 2]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "micro_rows" in e.value.details()
    assert pipe.replica_hosts[1][0].labels == {}
    stub.PutLabels(stage_pb2.LabelsRequest(info=info, labels=rows, micro_rows=[1, 3]), timeout=10)
    assert {mb: len(t) for mb, t in pipe.replica_hosts[1][0].labels.items()} == {0: 1, 1: 3}
