"""Uneven replica counts in one process: stages with different numbers of replicas run the lcm routes of
`swarm.peers.routes`, train like the unreplicated pipeline, keep every replica of a stage identical, call each
shared replica once per step, and reroute around a dead replica of the widest stage."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest
import torch

from swarm.compression import CodecConfig
from swarm.net.stream import CallRefused
from swarm.peers.routes import stage_numbering
from swarm.proto import stage_pb2
from swarm.runtime.budget import StageBudget
from swarm.runtime.gate import runs_through
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.runtime.test_replicas import CFG, FP32, batch, digests, weights
from tests.unit.runtime.test_reroute import _KillOn

torch.set_num_threads(1)

UNEVEN = [(1, 2), (2, 1), (2, 3), (1, 2, 1)]


class _Count:
    """Wraps a servicer: counts the Forward calls (one per micro-batch) and the once-per-step calls (Reduce,
    Grads, Step) it serves, abandons left out."""

    def __init__(self, target, seen: Counter, key: tuple[int, int]):
        self.target, self.seen, self.key = target, seen, key

    def __getattr__(self, name):
        attr = getattr(self.target, name)
        if name not in ("Forward", "Reduce", "Grads", "Step"):
            return attr

        def counted(request, context):
            if not getattr(request, "abandon", False):
                self.seen[(*self.key, name)] += 1
            return attr(request, context)

        return counted


def _counting(pipe: LocalPipeline) -> Counter:
    seen: Counter = Counter()
    for s, row in enumerate(pipe.switches):
        for r, switch in enumerate(row):
            switch.target = _Count(switch.target, seen, (s, r))
    return seen


def _forwards(seen: Counter, counts) -> list[list[int]]:
    """Forward calls each replica served so far."""
    return [[seen[(s, r, "Forward")] for r in range(c)] for s, c in enumerate(counts)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("counts", UNEVEN, ids=str)
def test_uneven_replicas_train_like_one_pipeline(counts, schedule):
    n_stages = len(counts)
    one = LocalPipeline(CFG, n_stages, FP32, FP32, schedule=schedule)
    many = LocalPipeline(CFG, n_stages, FP32, FP32, schedule=schedule, replicas=counts)
    seen = _counting(many)
    routes = many.driver(4).n_replicas
    try:
        for step in range(3):
            b = batch(seed=step)
            before = _forwards(seen, counts)
            a, r = one.train_step(b, n_micro=4), many.train_step(b, n_micro=4)
            assert r.routes == routes and r.attempts == 1 and r.dead_peers == ()
            assert sorted(r.sample_ids) == b.sample_ids.tolist()  # every sample once
            assert r.loss == pytest.approx(a.loss, abs=1e-5)
            assert r.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
            assert all(len(d) == 1 for d in digests(many)), f"replicas differ after step {step}"
            now = _forwards(seen, counts)
            per_replica = [[n - b for n, b in zip(*rows, strict=True)] for rows in zip(now, before, strict=True)]
            assert all(1 <= n <= StageBudget().max_micro_batches for row in per_replica for n in row), per_replica
            assert [sum(row) for row in per_replica] == [sum(per_replica[0])] * n_stages  # every micro-batch once
        # a replica shared by several routes got ONE Reduce and Step per step, not one per route (an end stage's
        # replica joins the tied group's sum even when alone in its stage), and no Grads: the Reduce replies carry
        # every gradient report
        for s, c in enumerate(counts):
            for rep in range(c):
                assert seen[(s, rep, "Reduce")] == 3 and seen[(s, rep, "Step")] == 3, (s, rep, seen)
                assert seen[(s, rep, "Grads")] == 0, (s, rep, seen)
        ref = weights(one)
        for s, c in enumerate(counts):
            for rep in range(c):
                for name, w in many.replica_hosts[s][rep].worker.module.named_parameters():
                    torch.testing.assert_close(w.detach(), ref[name], atol=1e-5, rtol=0, msg=f"{s}.{rep} {name}")
        assert all(st.steps_done == 3 for row in many.driver(4).replica_status() for st in row)
    finally:
        one.close()
        many.close()


@pytest.mark.parametrize("counts", [(1, 2), (2, 3)], ids=str)
def test_uneven_replicas_train_with_compressed_codecs_and_stay_identical(counts):
    pipe = LocalPipeline(CFG, 2, CodecConfig("aqsgd", bits=4), CodecConfig("gradq", bits=8), replicas=counts)
    data = batch(n=24, seed=11)
    try:
        losses = []
        for step in range(6):
            losses.append(pipe.train_step(data, n_micro=4).loss)
            assert all(len(d) == 1 for d in digests(pipe)), f"replicas differ after step {step}"
        assert losses[-1] < losses[0], losses
    finally:
        pipe.close()


def test_a_dead_replica_of_the_widest_stage_takes_its_routes_out_and_the_step_reruns_once():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=(2, 3))
    ref = LocalPipeline(CFG, 2, FP32, FP32)
    try:
        pipe.train_step(batch(seed=0), n_micro=4)
        ref.train_step(batch(seed=0), n_micro=4)
        pipe.switches[1][2].target = _KillOn(pipe, 1, 2, "Forward")
        b = batch(seed=1)
        result, expected = pipe.train_step(b, n_micro=4), ref.train_step(b, n_micro=4)
        dead = pipe.replica_peers[1][2]
        assert result.attempts == 2 and result.dead_peers == (dead,)
        assert pipe.driver(4).live_routes() == [0, 1, 3, 4] and result.routes == 4  # routes 2 and 5 ran on it
        assert sorted(result.sample_ids) == b.sample_ids.tolist()  # every sample trained exactly once
        assert result.loss == pytest.approx(expected.loss, abs=1e-5)
        hosts = pipe.replica_hosts
        assert hosts[1][2].steps_done == 1 and all(h.steps_done == 2 for h in (*hosts[0], *hosts[1][:2]))
        assert all(h.open_step is None for h in (*hosts[0], *hosts[1][:2]))  # the killed host is gone
        ref_weights = weights(ref)
        for host in (*hosts[0], *hosts[1][:2]):
            for name, w in host.worker.module.named_parameters():
                torch.testing.assert_close(w.detach(), ref_weights[name], atol=1e-5, rtol=0, msg=name)
        again = pipe.train_step(batch(seed=2), n_micro=4)  # the next step runs on the surviving routes at once
        assert again.attempts == 1 and again.routes == 4
    finally:
        pipe.close()
        ref.close()


def test_a_step_that_hangs_on_one_replica_after_others_applied_it_is_not_run_again():
    """driver._apply: gather gives up on a Step that hangs on a peer that still answers pings. The others applied
    the step: it counts as applied, the stuck peer is declared dead, and the step is NOT run again (that would
    apply it twice where it was applied)."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    target, release = pipe.switches[1][0].target, threading.Event()

    class _HangStep:
        def __getattr__(self, name):
            return getattr(target, name)

        def Step(self, request, context):
            if request.abandon:
                return target.Step(request, context)
            release.wait()
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    pipe.switches[1][0].target = _HangStep()
    try:
        pipe.driver(4, deadline_s=3.0)  # gather gives up deadline + 5 s after the Steps went out
        result = pipe.train_step(batch(seed=2), n_micro=4)
        stuck = pipe.replica_peers[1][0]
        assert result.attempts == 1 and result.dead_peers == (stuck,)
        applied = [h for row in pipe.replica_hosts for h in row if h is not pipe.replica_hosts[1][0]]
        assert all(h.steps_done == 1 for h in applied)
        assert pipe.driver(4).live_routes() == [1]
    finally:
        release.set()
        pipe.close()


def test_stage_micro_must_be_empty_or_one_valid_entry_per_stage():
    budget = StageBudget(max_micro_batches=8)
    route = ["a", "b", "c"]

    def info(index, count):
        return stage_pb2.CallInfo(
            num_micro_batches=2, route=route, stage_micro=index, stage_micro_count=count, loss_weight=0.5
        )

    budget.check_info(info([], []))
    budget.check_info(info([0, 2, 1], [1, 3, 2]))
    for index, count, match in [
        ([0, 1], [1, 2], "stage_micro: 2 indices"),
        ([0, 1, 0], [1, 2], "2 counts"),
        ([0, 0, 0], [], "0 counts"),
        ([0, 3, 0], [1, 3, 1], r"stage_micro\[1\]: 3 is not below"),
        ([0, 0, 0], [1, 0, 1], r"stage_micro_count\[1\]: 0 is outside 1..8"),
        ([0, 0, 0], [1, 9, 1], r"stage_micro_count\[1\]: 9 is outside 1..8"),
    ]:
        with pytest.raises(CallRefused, match=match) as e:
            budget.check_info(info(index, count))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_equal_counts_send_no_stage_micro():
    """Equal replica counts: the calls carry no per-stage numbering (the same bytes as before routes)."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    infos = []
    target = pipe.switches[1][1].target

    class _Spy:
        def __getattr__(self, name):
            return getattr(target, name)

        def PutLabels(self, request, context):
            infos.append(request.info)
            return target.PutLabels(request, context)

    pipe.switches[1][1].target = _Spy()
    try:
        pipe.train_step(batch(seed=0), n_micro=4)
        assert infos and all(not i.stage_micro and not i.stage_micro_count for i in infos)
    finally:
        pipe.close()


def test_runs_through_finds_the_1f1b_deadlock_of_shared_replicas_and_gpipe_has_none():
    counts = (1, 2, 3)
    # stage 1's replica 1 would hold route 3's backward behind route 5's forward, which stage 0 runs after it
    numbering = stage_numbering({3: 1, 4: 2, 5: 1}, counts)
    assert not runs_through("1f1b", counts, numbering) and runs_through("gpipe", counts, numbering)
    equal = stage_numbering({0: 3, 1: 2}, (2, 2, 2))
    assert runs_through("1f1b", (2, 2, 2), equal)
    assert runs_through("1f1b", (1, 2), stage_numbering({0: 4, 1: 1}, (1, 2)))


def test_uneven_1f1b_that_would_deadlock_runs_the_step_as_gpipe():
    counts, n_micro = (1, 2, 3), 6
    one = LocalPipeline(CFG, 3, FP32, FP32, schedule="1f1b")
    many = LocalPipeline(CFG, 3, FP32, FP32, schedule="1f1b", replicas=counts)
    try:
        driver = many.driver(n_micro)

        def numbering_of(b):
            work = driver._work(b, driver.routes)
            return stage_numbering({w.route.index: len(w.micro) for w in work}, counts)

        # the samples' routes follow the replicas' (random) peer ids: take the first batch of ids whose split
        # deadlocks as 1F1B (about one in four does; 64 tries miss with probability 1e-8)
        tries = (batch(seed=4, first_id=16 * k) for k in range(64))
        b = next((c for c in tries if not runs_through("1f1b", counts, numbering_of(c))), None)
        assert b is not None and not runs_through("1f1b", counts, numbering_of(b))  # replicas would wait on each other
        a, r = one.train_step(b, n_micro=4), many.train_step(b, n_micro=n_micro)
        assert r.attempts == 1 and r.routes == 6 and sorted(r.sample_ids) == b.sample_ids.tolist()
        assert r.loss == pytest.approx(a.loss, abs=1e-5)
        assert all(len(d) == 1 for d in digests(many))
    finally:
        one.close()
        many.close()


class _NoReport(_Count):
    """A peer whose Reduce replies carry no gradient report (`ReduceReply.grads` unset), as an older one's."""

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if name != "Reduce":
            return attr

        def bare(request, context):
            reply = attr(request, context)
            reply.ClearField("grads")
            return reply

        return bare


def test_a_replica_whose_reduce_reply_has_no_gradient_report_is_asked_grads_and_trains_alike():
    one = LocalPipeline(CFG, 2, FP32, FP32)
    many = LocalPipeline(CFG, 2, FP32, FP32, replicas=(1, 2))
    seen: Counter = Counter()
    many.switches[1][1].target = _NoReport(many.switches[1][1].target, seen, (1, 1))
    try:
        for step in range(2):
            a, r = one.train_step(batch(seed=step), n_micro=4), many.train_step(batch(seed=step), n_micro=4)
            assert r.attempts == 1 and r.loss == pytest.approx(a.loss, abs=1e-5)
            assert r.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert seen[(1, 1, "Reduce")] == 2 and seen[(1, 1, "Grads")] == 2  # asked Grads, once a step
    finally:
        one.close()
        many.close()


def test_a_lone_middle_stage_is_asked_grads_beside_the_reduces_never_reduce():
    """Nothing to sum there: it gets Grads in the Reduce round, not a Reduce as a group of one, whose one slot a
    failed attempt's sum may still hold (a rerun after an eviction then refused "1 Reduce calls are being served
    already" and cost an attempt); the others' reports come in their Reduce replies."""
    one = LocalPipeline(CFG, 3, FP32, FP32)
    many = LocalPipeline(CFG, 3, FP32, FP32, replicas=(2, 1, 2))
    seen = _counting(many)
    try:
        for step in range(2):
            a, r = one.train_step(batch(seed=step), n_micro=4), many.train_step(batch(seed=step), n_micro=4)
            assert r.attempts == 1 and r.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert seen[(1, 0, "Reduce")] == 0 and seen[(1, 0, "Grads")] == 2, seen
        for s in (0, 2):
            for rep in range(2):
                assert seen[(s, rep, "Reduce")] == 2 and seen[(s, rep, "Grads")] == 0, (s, rep, seen)
    finally:
        one.close()
        many.close()
