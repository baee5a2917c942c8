"""PlanFollower without processes: which failures move a step to a newer plan, what a re-plan carries over (the
commit hook, the plan watch's version), and which failures end the run as the driver raised them."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

import swarm.train.follower as follower_module
from swarm.net.stream import PLAN_MISMATCH, StageCallError
from swarm.peers.routes import PlanRoutes
from swarm.train.follower import STEP_ATTEMPTS, PlanFollower, route_answers
from tests.waiting import until


class NoLiveRoute(StageCallError):  # the driver's exception, matched by name
    pass


BEHIND: list[str] = []
"""what FakeDriver.drop_behind reports (a test sets it)"""


class FakeDriver:
    """A driver of one plan version whose steps raise the queued errors, then succeed."""

    def __init__(self, version: int, errors: list[Exception]):
        self.version, self.errors, self.closed, self.on_commit, self.n_stages = version, errors, False, None, 2
        self.abandoned: list[int] = []

    def abandon(self, step: int) -> None:
        self.abandoned.append(step)

    def drop_behind(self) -> list[str]:
        return list(BEHIND)

    def train_step(self, step: int, batch):
        assert not self.closed, "a closed driver ran a step"
        if self.errors:
            raise self.errors.pop(0)
        return SimpleNamespace(step=step, plan_version=self.version)

    def close(self) -> None:
        self.closed = True


def route(version: int, replicas: int = 1) -> PlanRoutes:
    """Two stages of `replicas` replicas each, following plan `version`."""
    ids = tuple(tuple(f"p{s}{r}" for r in range(replicas)) for s in range(2))
    addresses = tuple(tuple(f"127.0.0.1:{5000 + 10 * s + r}" for r in range(replicas)) for s in range(2))
    return PlanRoutes(
        [row[0] for row in addresses], [row[0] for row in ids], plan_version=version,
        replica_addresses=addresses if replicas > 1 else (), replica_peer_ids=ids if replicas > 1 else (),
    )  # fmt: skip


def follower_of(
    monkeypatch, errors_by_version: dict[int, list[Exception]], dht=True, replicas: int = 1, answers=None, repair=True
):
    """A follower on plan 1 whose DHT offers plans 2, 3, ... on request (`repair` False: none comes, the wait
    polls `check` a few times and times out); returns it, the discoveries made and the lines said."""
    found: list[tuple[int, float]] = []

    def discover(dht, n_stages, timeout_s, show, min_version, trainer_id=None, n_layers=None, check=None):
        found.append((min_version, timeout_s))
        if repair:
            return route(min_version, replicas)
        for _ in range(3):
            if check is not None:
                check()
        raise TimeoutError(f"no complete pipeline after {timeout_s:.0f} s (waiting for a plan newer than 1)")

    monkeypatch.setattr(follower_module, "discover_route", discover)
    fake_dht = SimpleNamespace(peer_id="me", get_plan=lambda n_layers, **_: None) if dht else None
    lines: list[str] = []
    follower = PlanFollower(
        lambda r: FakeDriver(r.plan_version, errors_by_version.get(r.plan_version, [])),
        route(1, replicas), fake_dht, n_layers=2, say=lines.append, wait_timeout_s=7.0, replan_timeout_s=9.0,
        answers=answers,
    )  # fmt: skip
    return follower, found, lines


def test_a_step_refused_as_of_an_old_plan_runs_on_the_next_with_the_commit_hook_carried_over(monkeypatch):
    mismatch = StageCallError(f"stage 1: {PLAN_MISMATCH} follows plan 2", grpc.StatusCode.FAILED_PRECONDITION)
    follower, found, lines = follower_of(monkeypatch, {1: [mismatch]})
    first = follower.driver
    first.on_commit = hook = object()
    result, retries = follower.run_step(5, batch=None)
    assert (result.step, result.plan_version, retries) == (5, 2, 1)
    assert first.closed and follower.driver.on_commit is hook, "the journal's hook follows the driver"
    assert found == [(2, 7.0)] and follower.replans == 1 and follower.route.plan_version == 2
    assert follower.watch.version == 2, "the watch compares later plans with the one now followed"
    assert lines == ["plan 2: " + follower.route.describe()]


def test_no_live_route_waits_the_replan_timeout_for_the_planners_repair(monkeypatch):
    follower, found, lines = follower_of(monkeypatch, {1: [NoLiveRoute("step 3: no live replica of stage 1")]})
    result, retries = follower.run_step(3, batch=None)
    assert (result.plan_version, retries) == (2, 1) and found == [(2, 9.0)]
    assert "no route of replicas left" in lines[0] and "waiting for a newer plan" in lines[0]


def test_a_dead_stage_of_a_replicated_plan_is_the_drivers_to_reroute_not_a_replan(monkeypatch):
    gone = StageCallError("stage 1: unreachable", grpc.StatusCode.UNAVAILABLE)
    follower, found, _ = follower_of(monkeypatch, {1: [gone]}, replicas=2)
    with pytest.raises(StageCallError, match="unreachable"):
        follower.run_step(0, batch=None)
    assert found == [] and follower.replans == 0


def test_a_refusal_that_no_plan_mends_is_raised_as_is(monkeypatch):
    bad = StageCallError("stage 0: invalid tokens", grpc.StatusCode.INVALID_ARGUMENT)
    follower, found, _ = follower_of(monkeypatch, {1: [bad]})
    with pytest.raises(StageCallError) as raised:
        follower.run_step(0, batch=None)
    assert raised.value is bad and found == []


def test_a_plan_that_keeps_moving_fails_the_step_after_its_attempts(monkeypatch):
    mismatch = lambda: StageCallError(f"stage 0: {PLAN_MISMATCH} newer", grpc.StatusCode.FAILED_PRECONDITION)  # noqa: E731
    follower, found, _ = follower_of(monkeypatch, {v: [mismatch()] for v in range(1, 10)})
    with pytest.raises(StageCallError, match=PLAN_MISMATCH):
        follower.run_step(0, batch=None)
    assert [version for version, _ in found] == list(range(2, STEP_ATTEMPTS + 1)), "one re-plan per attempt"


def test_without_a_dht_a_moved_plan_is_an_error_naming_it(monkeypatch):
    mismatch = StageCallError(f"stage 0: {PLAN_MISMATCH} newer", grpc.StatusCode.FAILED_PRECONDITION)
    follower, found, _ = follower_of(monkeypatch, {1: [mismatch]}, dht=False)
    with pytest.raises(StageCallError) as raised:
        follower.run_step(0, batch=None)
    assert raised.value is mismatch and found == []
    with pytest.raises(StageCallError, match="plan 1 moved on and this trainer follows no DHT"):
        follower.replan()
    follower.close()
    assert follower.driver.closed


def test_a_stalled_peer_that_answers_again_reruns_the_step_on_the_same_plan(monkeypatch):
    """No repair comes for a peer the driver's pings took for dead while it stalled (the planner's pings found it
    alive): once every peer of the plan answers again, the step runs there again instead of timing out."""
    asked: list[int] = []

    def answers(r: PlanRoutes) -> bool:
        asked.append(r.plan_version)
        return len(asked) >= 2  # still stalled at the first ask

    monkeypatch.setattr(follower_module, "ANSWER_EVERY_S", 0.0)
    dead = NoLiveRoute("step 6: no live replica of stage 0 (peer p00 at 127.0.0.1:5000)")
    follower, found, lines = follower_of(monkeypatch, {1: [dead]}, answers=answers, repair=False)
    first = follower.driver
    result, retries = follower.run_step(6, batch=None)
    assert (result.plan_version, retries) == (1, 1) and asked == [1, 1] and first.closed
    assert follower.replans == 0 and follower.route.plan_version == 1, "the same plan, driven afresh"
    assert "every peer answers again" in lines[-1]
    assert follower.driver.abandoned == [6], (
        "abandoned on every peer first: the ones the old driver took for dead still held step 6 open (the fifth"
        " pass's clean run died of it: 'schedule: 0F1 of step 0 ran already or is running')"
    )


def test_a_plan_driven_afresh_leaves_out_the_replicas_behind_and_says_so(monkeypatch):
    monkeypatch.setattr(follower_module, "ANSWER_EVERY_S", 0.0)
    BEHIND[:] = ["p01"]
    try:
        dead = NoLiveRoute("step 7: no live replica of stage 1")
        follower, _, lines = follower_of(monkeypatch, {1: [dead]}, answers=lambda r: True, repair=False, replicas=2)
        result, _ = follower.run_step(7, batch=None)
        assert result.plan_version == 1 and "behind their replicas: p01" in lines[-1]
    finally:
        BEHIND.clear()


def test_a_newer_plan_after_no_live_route_needs_no_abandon(monkeypatch):
    follower, _, _ = follower_of(monkeypatch, {1: [NoLiveRoute("step 3: no live replica of stage 1")]})
    follower.run_step(3, batch=None)
    assert follower.route.plan_version == 2 and follower.driver.abandoned == []


def test_a_plan_whose_peers_stay_silent_times_out_as_before(monkeypatch):
    monkeypatch.setattr(follower_module, "ANSWER_EVERY_S", 0.0)
    dead = NoLiveRoute("step 6: no live replica of stage 0")
    follower, _, _ = follower_of(monkeypatch, {1: [dead]}, answers=lambda r: False, repair=False)
    with pytest.raises(TimeoutError, match="newer than 1"):
        follower.run_step(6, batch=None)


def test_an_asking_that_fails_is_no_answer(monkeypatch):
    def answers(r: PlanRoutes) -> bool:
        raise TimeoutError("the DHT did not answer")

    monkeypatch.setattr(follower_module, "ANSWER_EVERY_S", 0.0)
    follower, _, _ = follower_of(monkeypatch, {1: [NoLiveRoute("no live replica")]}, answers=answers, repair=False)
    with pytest.raises(TimeoutError, match="newer than 1"):
        follower.run_step(0, batch=None)


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class Pinger:
    """A connector whose peers answer `Ping` as `replies` says (an exception to raise, or None: an answer)."""

    def __init__(self, replies: dict[str, Exception | None]):
        self.replies, self.pinged = replies, []

    def stage(self, address: str, peer_id: str | None = None):
        def ping(request, timeout=None):
            self.pinged.append(peer_id)
            if self.replies.get(peer_id) is not None:
                raise self.replies[peer_id]

        return SimpleNamespace(Ping=ping)


def announced(version: int = 1, leaving: tuple[str, ...] = (), peers=("p00", "p10")) -> list:
    return [SimpleNamespace(peer_id=p, plan_version=version, leaving=p in leaving) for p in peers]


def test_route_answers_only_when_every_peer_follows_the_plan_answers_and_is_not_banned():
    plan = route(1)
    assert route_answers(Pinger({}), plan, announced())
    refused = Pinger({"p10": Refused(grpc.StatusCode.PERMISSION_DENIED)})
    assert route_answers(refused, plan, announced()), "a refusal is an answer: the peer lives"
    for gone in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        assert not route_answers(Pinger({"p10": Refused(gone)}), plan, announced())
    assert not route_answers(Pinger({"p00": OSError("tunnel closed")}), plan, announced())
    pinger = Pinger({})
    assert not route_answers(pinger, plan, announced(), banned=("p10",)), "an evicted peer is no way back"
    assert not route_answers(pinger, plan, announced(leaving=("p00",))), "a leaving peer waits for its repair"
    assert not route_answers(pinger, plan, announced(version=2)), "its peers moved on: the newer plan is the way"
    assert not route_answers(pinger, plan, announced(peers=("p00",))), "a peer no longer announced is gone"
    assert pinger.pinged == [], "nobody is pinged where the announcements already say no"
    replicated = route(1, replicas=2)
    everyone = announced(peers=("p00", "p01", "p10", "p11"))
    assert route_answers(Pinger({}), replicated, everyone)
    assert not route_answers(Pinger({"p11": Refused(grpc.StatusCode.UNAVAILABLE)}), replicated, everyone)


class SlowPlanDHT:
    """A DHT whose plan reads wait until the test lets each one go; it says the version the test put out."""

    def __init__(self):
        import threading

        self.published, self.reads, self.fail = 0, [], False
        self.go, self.started = threading.Semaphore(0), threading.Semaphore(0)

    def get_plan(self, n_layers, newer_than=0):
        self.reads.append(newer_than)
        self.started.release()
        assert self.go.acquire(timeout=30), "the test never let the read go"
        if self.fail:
            raise ConnectionError("the DHT node is gone")
        return SimpleNamespace(version=self.published) if self.published > newer_than else None


def test_the_plan_watch_never_waits_for_the_dht_and_says_what_a_finished_read_found():
    dht = SlowPlanDHT()
    watch = follower_module.PlanWatch(dht, version=3, every_s=0.0)
    dht.published = 4
    assert watch.newer() is None, "the first look starts a read and waits for nothing"
    assert dht.started.acquire(timeout=30)
    assert watch.newer() is None and dht.reads == [3], "one read at a time, however often the trainer asks"
    dht.go.release()
    until(lambda: watch.newer() == 4, "the finished read's plan")
    assert dht.started.acquire(timeout=30), "the next read started once the last ended"
    # the trainer follows plan 4 now: what a read found before is no longer news, and a failed read finds nothing
    watch.version, dht.fail = 4, True
    assert watch.newer() is None
    dht.go.release()
    started = lambda: watch.newer() is None and dht.started.acquire(blocking=False)  # noqa: E731
    until(started, "a read after a failed one")
    dht.fail, dht.published = False, 6
    dht.go.release()
    until(lambda: watch.newer() == 6, "a read after a failure")
    assert dht.reads[-1] == 4, "each read asks above the plan followed when it began"
    dht.started.acquire(timeout=30)
    dht.go.release()  # the read in flight ends; its thread goes back to the pool
