"""Sample assignment to routes of replicas, micro-batch splits and the waiting rule (heartbeats: test_heartbeat)."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
import torch

from swarm.model.data import Batch
from swarm.net.stream import StageCallError
from swarm.peers.routes import Route
from swarm.runtime.routing import (
    CallThreads,
    Failed,
    RouteWeights,
    assign_samples,
    gather,
    reroutable,
    route_work,
    spawn,
)
from tests.waiting import WAIT_S, until


def _routes(n: int) -> list[Route]:
    return [Route(r, (f"a{r}.0", f"a{r}.1"), (f"p{r}.0", f"p{r}.1")) for r in range(n)]


def _batch(n: int, start: int = 0) -> Batch:
    ids = torch.arange(start, start + n)
    return Batch(ids, ids[:, None].repeat(1, 4), ids[:, None].repeat(1, 4) + 1)


def _owner(ids, routes, weights) -> dict[int, int]:
    rows = assign_samples(ids, [(c.key, w) for c, w in zip(routes, weights, strict=True)])
    return {ids[r]: c for c, rs in enumerate(rows) for r in rs}


def test_equal_weights_split_evenly_and_deterministically():
    routes, ids = _routes(2), list(range(4000))
    owner = _owner(ids, routes, [1.0, 1.0])
    share = sum(1 for c in owner.values() if c == 0) / len(ids)
    assert 0.45 < share < 0.55
    assert owner == _owner(ids, routes, [1.0, 1.0])


def test_weights_set_the_shares():
    routes, ids = _routes(2), list(range(4000))
    owner = _owner(ids, routes, [3.0, 1.0])
    assert 0.70 < sum(1 for c in owner.values() if c == 0) / len(ids) < 0.80


def test_only_a_dead_routes_samples_move():
    routes, ids = _routes(3), list(range(600))
    before = _owner(ids, routes, [1.0, 1.0, 1.0])
    after = _owner(ids, [routes[0], routes[2]], [1.0, 1.0])
    survivors = {0: 0, 2: 1}
    for sid, c in before.items():
        if c != 1:
            assert after[sid] == survivors[c], f"sample {sid} moved off a live route"


def test_samples_stay_when_measured_throughput_wobbles():
    routes, ids = _routes(2), list(range(256))
    weights = RouteWeights()
    gen = torch.Generator().manual_seed(0)
    owners = [_owner(ids, routes, weights.weights([c.key for c in routes]))]
    for _ in range(50):  # both routes equally fast, measured with +-20% noise
        weights.observe({c.key: 100.0 * (1 + 0.4 * (float(torch.rand((), generator=gen)) - 0.5)) for c in routes})
        owners.append(_owner(ids, routes, weights.weights([c.key for c in routes])))
    assert all(o == owners[0] for o in owners)


def test_a_much_faster_route_gets_more_samples_but_weights_stay_bounded():
    routes, ids = _routes(2), list(range(2000))
    keys = [c.key for c in routes]
    weights = RouteWeights()
    for _ in range(20):
        weights.observe({keys[0]: 300.0, keys[1]: 100.0})
    w = weights.weights(keys)
    # the held weights move only by whole tolerance bands, so they follow 3:1 only coarsely
    assert 1.5 < w[0] / w[1] <= 3.0
    share = sum(1 for c in _owner(ids, routes, w).values() if c == 0) / len(ids)
    assert 0.6 < share < 0.8
    for _ in range(20):
        weights.observe({keys[0]: 300.0, keys[1]: 1.0})  # very slow: not starved beyond the bound
    w = weights.weights(keys)
    assert w[0] / w[1] == pytest.approx(4.0)
    assert weights.weights([keys[0], b"new"])[1] > 0  # an unmeasured route gets a share
    weights.observe({keys[0]: 300.0})  # one route alone: nothing to compare, nothing changes
    assert weights.weights(keys) == w


def test_every_route_gets_a_sample_when_there_are_enough():
    routes = _routes(4)
    for n in range(4, 12):
        rows = assign_samples(list(range(n)), [(c.key, 1.0) for c in routes])
        assert all(rows) and sorted(r for rs in rows for r in rs) == list(range(n))
    rows = assign_samples([0, 1], [(c.key, 1.0) for c in routes])  # fewer samples than routes
    assert sorted(r for rs in rows for r in rs) == [0, 1]


def test_route_work_covers_the_batch_once_with_loss_weights_summing_to_one():
    batch = _batch(24, start=100)
    work = route_work(batch, _routes(2), [1.0, 1.0], n_micro=4)
    ids = sorted(int(i) for w in work for b in w.micro for i in b.sample_ids)
    assert ids == list(range(100, 124))
    assert sum(sum(w.loss_weights) for w in work) == pytest.approx(1.0)
    for w in work:
        assert 1 <= len(w.micro) <= w.rows
        for b, lw in zip(w.micro, w.loss_weights, strict=True):
            assert lw == len(b.sample_ids) / 24
            assert torch.equal(b.tokens[:, 0], b.sample_ids)  # rows kept together
    assert sum(len(w.micro) for w in work) in (3, 4, 5)


def test_one_route_splits_like_batch_split():
    batch = _batch(8)
    (work,) = route_work(batch, _routes(1), [1.0], n_micro=4)
    for a, b in zip(work.micro, batch.split(4), strict=True):
        assert torch.equal(a.sample_ids, b.sample_ids) and torch.equal(a.tokens, b.tokens)
    assert work.loss_weights == (0.25,) * 4


def test_select_keeps_rows_in_the_given_order():
    batch = _batch(5)
    part = batch.select(torch.tensor([3, 1]))
    assert part.sample_ids.tolist() == [3, 1] and part.targets[:, 0].tolist() == [4, 2]


# ---- liveness -------------------------------------------------------------------------------------------


def test_gather_ends_at_once_when_a_peer_is_declared_dead():
    release, wake, dead = threading.Event(), threading.Event(), set()
    stuck = spawn(release.wait, "stuck")
    fine = spawn(lambda: 1, "fine")

    def declare():
        dead.add("p1")
        wake.set()

    threading.Timer(0.05, declare).start()
    with pytest.raises(Failed) as failed:
        gather([(fine, ("p0",)), (stuck, ("p1",))], wake, dead, deadline_s=120)
    assert failed.value.error is None and failed.value.suspects == ("p1",)
    release.set()
    assert stuck.result(timeout=5)


def test_gather_without_fail_fast_returns_what_answered_and_none_for_the_dead():
    release, wake, dead = threading.Event(), threading.Event(), {"p1"}
    stuck = spawn(release.wait, "stuck")
    fine = spawn(lambda: 1, "fine")
    out = gather([(fine, ("p0",)), (stuck, ("p1",))], wake, dead, deadline_s=120, fail_fast=False)
    assert out[0] is fine and out[1] is None
    release.set()


def test_gather_raises_the_first_failed_call():
    def fail():
        raise StageCallError("stage 1 (peer p1 at a): unreachable", grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(Failed) as failed:
        gather([(spawn(fail, "f"), ("p0", "p1"))], threading.Event(), set(), deadline_s=120)
    assert reroutable(failed.value.error) and failed.value.suspects == ("p0", "p1")


def test_gather_gives_up_after_the_deadline():
    release = threading.Event()
    with pytest.raises(Failed) as failed:
        gather([(spawn(release.wait, "s"), ("p",))], threading.Event(), set(), deadline_s=-4.9)
    release.set()
    assert failed.value.error.code == grpc.StatusCode.DEADLINE_EXCEEDED and failed.value.suspects == ("p",)


# ---- the call threads ----------------------------------------------------------------------------------


def test_a_call_thread_is_reused_once_its_call_ended_and_ends_when_idle():
    pool = CallThreads(idle_s=1.0)  # long beside a stalled test thread: the spawn below finds it idle
    first = pool.spawn(threading.get_ident, "a")
    ident = first.result(timeout=WAIT_S)
    until(lambda: pool.idle() == 1, "the thread did not go idle")
    assert pool.spawn(threading.get_ident, "b").result(timeout=WAIT_S) == ident and pool.started == 1
    until(lambda: pool.idle() == 1, "the thread did not go idle again")
    until(lambda: pool.idle() == 0, "the idle thread did not end")
    assert not any(t.ident == ident for t in threading.enumerate())
    assert pool.spawn(lambda: 7, "c").result(timeout=WAIT_S) == 7 and pool.started == 2  # a new one


def test_a_fresh_call_runs_on_a_thread_of_its_own_that_ends_with_it():
    pool = CallThreads()
    ident = pool.spawn(threading.get_ident, "a").result(timeout=WAIT_S)
    until(lambda: pool.idle() == 1, "the thread did not go idle")
    fresh = pool.spawn(threading.get_ident, "b", fresh=True).result(timeout=WAIT_S)
    assert fresh != ident and pool.started == 2 and pool.idle() == 1  # the idle one was left alone
    until(lambda: not any(t.ident == fresh for t in threading.enumerate()), "the fresh thread did not end")


def test_a_stuck_call_never_holds_a_thread_another_call_needs():
    pool, release = CallThreads(), threading.Event()
    stuck = pool.spawn(release.wait, "stuck")
    assert pool.spawn(lambda: 1, "fine").result(timeout=WAIT_S) == 1 and pool.started == 2
    assert not stuck.done()
    release.set()
    assert stuck.result(timeout=WAIT_S) is True


def test_a_failing_call_hands_its_error_over_and_its_thread_serves_on():
    pool, tasks = CallThreads(), set()

    def fail():
        raise KeyError("boom")

    failed = pool.spawn(fail, "f", tasks)
    assert isinstance(failed.exception(timeout=WAIT_S), KeyError)
    until(lambda: not tasks and pool.idle() == 1, "the failed call was not let go")
    assert pool.spawn(lambda: threading.current_thread().name, "named").result(timeout=WAIT_S) == "named"
    assert pool.started == 1


def test_every_call_runs_when_threads_go_idle_and_end_as_calls_come():
    """Calls handed out from several threads while the idle ones time out: none is lost to a thread that ends."""
    pool, tasks = CallThreads(idle_s=0.001), set()
    futures, lock = [], threading.Lock()

    def hand_out() -> None:
        for i in range(200):
            f = pool.spawn(lambda i=i: i, "n", tasks)
            with lock:
                futures.append(f)
            if i % 7 == 0:
                time.sleep(0.002)  # now and then long enough for the idle threads to end

    handers = [threading.Thread(target=hand_out) for _ in range(4)]
    for t in handers:
        t.start()
    for t in handers:
        t.join(WAIT_S)
    assert sorted(f.result(timeout=WAIT_S) for f in futures) == sorted(list(range(200)) * 4)
    until(lambda: not tasks, "a finished call stayed tracked")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_forked_child_starts_its_own_call_threads():
    assert spawn(lambda: 1, "warm").result(timeout=WAIT_S) == 1  # leaves an idle thread in this process
    pid = os.fork()
    if pid == 0:  # the child: the parent's idle thread is not here
        code = 1
        try:
            code = 0 if spawn(lambda: 2, "child").result(timeout=5) == 2 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_what_reroutes():
    assert reroutable(StageCallError("x", grpc.StatusCode.DEADLINE_EXCEEDED))
    assert reroutable(StageCallError("x", grpc.StatusCode.CANCELLED))
    assert reroutable(ConnectionResetError())
    assert not reroutable(StageCallError("x", grpc.StatusCode.INVALID_ARGUMENT))
    assert not reroutable(StageCallError("plan-mismatch: plan 3", grpc.StatusCode.UNAVAILABLE))
    assert not reroutable(ValueError())


def test_a_stage_whose_slots_are_held_is_asked_again_not_given_up_on():
    """`busy`: every slot of the call's kind held (e.g. by the Reduce of an attempt just abandoned when a loaded
    machine's pings went unanswered; the suite saw a trainer die of it): the step runs again. Another
    RESOURCE_EXHAUSTED (a limit the caller broke) is not a reason to run it again."""
    from swarm.runtime.budget import CallSlots, SlotsExhausted
    from swarm.runtime.routing import busy

    slots = CallSlots(1, "Reduce")
    with slots.take(), pytest.raises(SlotsExhausted) as refused, slots.take():
        pass
    held = StageCallError(f"stage 1 (peer p at a): {refused.value}", grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert busy(held)
    assert not busy(StageCallError("stage 1 (peer p at a): message too large", grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert not busy(StageCallError(f"stage 1 (peer p at a): {refused.value}", grpc.StatusCode.INVALID_ARGUMENT))
    assert not busy(SlotsExhausted(str(refused.value)))
