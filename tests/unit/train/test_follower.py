"""PlanFollower without processes: which failures move a step to a newer plan, what a re-plan carries over (the
commit hook, the plan watch's version), and which failures end the run as the driver raised them."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

import swarm.train.follower as follower_module
from swarm.net.stream import PLAN_MISMATCH, StageCallError
from swarm.peers.routes import PlanRoutes
from swarm.train.follower import STEP_ATTEMPTS, PlanFollower


class NoLiveRoute(StageCallError):  # the driver's exception, matched by name
    pass


class FakeDriver:
    """A driver of one plan version whose steps raise the queued errors, then succeed."""

    def __init__(self, version: int, errors: list[Exception]):
        self.version, self.errors, self.closed, self.on_commit, self.n_stages = version, errors, False, None, 2

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


def follower_of(monkeypatch, errors_by_version: dict[int, list[Exception]], dht=True, replicas: int = 1):
    """A follower on plan 1 whose DHT offers plans 2, 3, ... on request; returns it and the discoveries made."""
    found: list[tuple[int, float]] = []

    def discover(dht, n_stages, timeout_s, show, min_version, trainer_id=None, n_layers=None):
        found.append((min_version, timeout_s))
        return route(min_version, replicas)

    monkeypatch.setattr(follower_module, "discover_route", discover)
    fake_dht = SimpleNamespace(peer_id="me", get_plan=lambda n_layers: None) if dht else None
    lines: list[str] = []
    follower = PlanFollower(
        lambda r: FakeDriver(r.plan_version, errors_by_version.get(r.plan_version, [])),
        route(1, replicas), fake_dht, n_layers=2, say=lines.append, wait_timeout_s=7.0, replan_timeout_s=9.0,
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
