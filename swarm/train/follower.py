"""How the trainer follows the swarm's plans: it finds a whole pipeline in the DHT, notices a newer plan between
steps, and runs each step on the plan the stages follow.

`PlanFollower` owns what a re-plan changes: the step driver, the route set it drives and the count of re-plans.
A step the stages refuse as of an older plan (`PLAN_MISMATCH`: abandoned on every stage) runs again on the newer
one; a step that finds no live route waits up to `--replan-timeout-s` for the planner's repair and runs there,
or runs again on the same plan once every one of its peers answers again (a loaded machine's stall, which the
driver's liveness pings took for a death, not a death: no repair would come), after abandoning the step on every
one of them (the peers taken for dead still held it open).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import grpc

from swarm.net.stream import PLAN_MISMATCH, StageCallError
from swarm.proto import stage_pb2
from swarm.runtime.routing import spawn

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from swarm.model.data import Batch
    from swarm.peers.routes import PlanRoutes

__all__ = ["PlanFollower", "PlanWatch", "discover_route", "no_route_left", "route_answers"]

log = logging.getLogger("swarm.train.follower")

UNREACHABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
"""Codes of a stage that is gone rather than refusing: the trainer waits for a plan without it."""
STEP_ATTEMPTS = 4
"""Tries at one step across re-plans (each a newer plan, or the same one whose peers answer again) before its
failure is the run's."""
ANSWER_EVERY_S = 2.0
"""While a step with no live route waits for a newer plan: how often the old plan's peers are pinged, seconds."""

POLL_S = 0.5
"""The longest wait between two reads of the DHT while a pipeline or a newer plan is awaited (the first ones are
quicker: 0.05, 0.1, 0.2, 0.4 s)."""


def discover_route(
    dht,
    n_stages: int | None,
    timeout_s: float,
    show=print,
    min_version: int = 0,
    trainer_id: str | None = None,
    n_layers: int | None = None,
    check: Callable[[], None] | None = None,
) -> PlanRoutes:
    """Waits until a whole pipeline is served and returns it (`check`, called at every poll, may raise: e.g. a
    local swarm's peer process died, so no pipeline will come).

    With a plan in the DHT (from the plan authority, valid for `n_layers`), the route is the plan's, once every
    peer in it announces that it follows that version and the plan names `trainer_id` among its trainers
    (when given: stages serve only the plan's trainers); without one (peers started with `--assign even`), the
    first peer announcing each of stages 0..n_stages-1. `min_version` skips plans older than one the trainer
    already ran into.
    """
    from swarm.peers.routes import PlanRoutes

    deadline = time.monotonic() + timeout_s
    last_line, polls = None, 0
    while True:
        peers = dht.peers()
        record = dht.get_plan(n_layers, peers=peers)
        if record is not None and trainer_id is not None and not record.document.serves_trainer(trainer_id):
            line = f"waiting for a plan that names trainer {trainer_id} (plan {record.version} does not)"
        elif record is not None and record.version >= min_version:
            found = record.document.route_of(peers, record.version)
            if found is not None:
                if n_stages and len(found.addresses) != n_stages:
                    stages = len(found.addresses)
                    log.warning("plan %d has %d stages, not --num-stages %d", record.version, stages, n_stages)
                return found
            waiting = [p for p in peers if p.plan_version != record.version]
            line = f"waiting for plan {record.version}: {len(waiting)} peers still switching"
        elif record is None:
            wanted = n_stages or 2
            by_stage = {}
            for ann in sorted(peers, key=lambda a: a.started_at):
                if ann.stage is not None and ann.stage < wanted and ann.plan_version == 0:
                    by_stage.setdefault(ann.stage, ann)
            missing = [s for s in range(wanted) if s not in by_stage]
            if not missing:
                return PlanRoutes(
                    [by_stage[s].address for s in range(wanted)], [by_stage[s].peer_id for s in range(wanted)]
                )
            served = wanted - len(missing)
            line = f"waiting for stages {missing} ({served}/{wanted} served; {len(peers)} peers, no plan yet)"
        else:
            line = f"waiting for a plan newer than {record.version}"
        if line != last_line:
            show(line)
            last_line = line
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no complete pipeline after {timeout_s:.0f} s ({line})")
        # the DHT's poll interval: quick at first (a re-plan that only bumps the version, the peers already
        # switching, is over in a few hundred ms: 0.8 s a re-plan at a fixed 0.5 s), then every 0.5 s
        time.sleep(min(POLL_S, 0.05 * 2**polls))
        polls += 1


class PlanWatch:
    """Tells the trainer, between steps, when the swarm has published a newer plan. The DHT is read at most once a
    second, on a thread of its own: a read (every announcement, the plans, their signatures) took 13-20 ms, and on
    the trainer's thread that was a gap between two steps every second (s66). So `newer` never waits: it says what
    the last finished read found, and starts the next one when it is due."""

    def __init__(self, dht, version: int, every_s: float = 1.0, n_layers: int | None = None):
        self.dht, self.version, self.every_s, self.n_layers = dht, version, every_s, n_layers
        """version: the plan the trainer follows now (the follower moves it on)"""
        self._next = time.monotonic() + every_s
        self._lock = threading.Lock()
        self._found = 0
        """the newest plan version a read found"""
        self._reading = False

    def newer(self) -> int | None:
        """A newer plan's version than `version` that a finished read found, or None; starts a read when one is
        due and none runs (a read that fails or hangs past the DHT's own timeout finds nothing)."""
        with self._lock:
            if not self._reading and time.monotonic() >= self._next:
                self._reading = True
                version = self.version
                spawn(lambda: self._read(version), "plan-watch")
            found = self._found
        return found if found > self.version else None

    def _read(self, version: int) -> None:
        record = None
        try:
            # newer_than: the trainers' announcements are read only once a newer plan is out
            record = self.dht.get_plan(self.n_layers, newer_than=version)
        except Exception as e:  # a failed read finds nothing; the next one is due in a second
            log.debug("reading the DHT for a newer plan failed: %s", e)
        finally:
            with self._lock:
                if record is not None:
                    self._found = max(self._found, record.version)
                self._reading = False
                self._next = time.monotonic() + self.every_s


def no_route_left(error: Exception, route: PlanRoutes) -> bool:
    """Whether a failed step needs a newer plan: the driver found no live route (`NoLiveRoute`), or, on a
    plan of one route (a driver without replicas), a stage is unreachable rather than refusing."""
    if type(error).__name__ == "NoLiveRoute":
        return True
    code = getattr(getattr(error, "code", None), "name", "")
    return route.n_replicas == 1 and code in UNREACHABLE


class _Answering(Exception):
    """Every peer of the plan a step found no live route on answers again: run the step there again."""


def route_answers(connector, route: PlanRoutes, peers: Iterable, banned: Iterable[str] = (), timeout_s: float = 2.0):
    """Whether a plan the driver found no live route on is whole again: every peer of `route` is announced in
    `peers` (the DHT's announcements) as following its version and not leaving, none is `banned` (evicted by
    this trainer), and each answers a `Ping` within `timeout_s` (a refusal is an answer; only the codes of a
    peer that is gone are not). On a loaded machine a stalled peer misses the driver's three pings and is
    declared dead while it lives on, and the planner, whose own pings it answers, publishes no repair."""
    addresses, ids = route.nested()
    wanted = {p: a for row_a, row_p in zip(addresses, ids, strict=True) for a, p in zip(row_a, row_p, strict=True)}
    following = {p.peer_id for p in peers if p.plan_version == route.plan_version and not p.leaving}
    if not set(wanted) <= following or set(wanted) & set(banned):
        return False
    for peer, address in wanted.items():
        try:
            connector.stage(address, peer).Ping(stage_pb2.PingRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code().name in UNREACHABLE:
                return False
        except Exception:  # e.g. a relayed peer's tunnel that is gone: no answer
            return False
    return True


class PlanFollower:
    """The trainer's driver on the plan the stages follow, replaced whenever the swarm moves to a newer plan.

    Args:
        connect: makes the step driver of a route set (and checks the stages serve the trainer's model).
        route: the route set the run starts on.
        dht: the trainer's DHT node, where newer plans appear; None: a fixed route set (a re-plan is an error).
        n_layers: the model's layers, which the plans read from the DHT must cover.
        say: where a re-plan is told (one line each).
        wait_timeout_s: how long a re-plan waits for every peer of the newer plan to follow it.
        replan_timeout_s: how long a step with no live route waits for a newer plan (the planner's repair).
        answers: whether every peer of a route answers again (`route_answers`, bound to a connector and the
            trainer's bans); None: a step with no live route waits for a newer plan only.
    """

    def __init__(
        self,
        connect: Callable[[PlanRoutes], object],
        route: PlanRoutes,
        dht=None,
        n_layers: int | None = None,
        say: Callable[[str], None] = lambda line: None,
        wait_timeout_s: float = 120.0,
        replan_timeout_s: float = 120.0,
        answers: Callable[[PlanRoutes], bool] | None = None,
    ):
        self.connect, self.dht, self.n_layers, self.say, self.answers = connect, dht, n_layers, say, answers
        self.wait_timeout_s, self.replan_timeout_s = wait_timeout_s, replan_timeout_s
        self.route = route
        self.driver = connect(route)
        self.watch = PlanWatch(dht, route.plan_version, n_layers=n_layers) if dht is not None else None
        self.replans = 0
        """times the trainer moved to a newer plan"""

    def follow(self, min_version: int, timeout_s: float | None = None, back: Callable[[], None] | None = None) -> bool:
        """Closes the driver, waits (up to `timeout_s`, default `wait_timeout_s`) for a plan of at least
        `min_version` that every one of its peers follows, and drives it; the commit hook carries over.
        `back` (checked at every poll) raises `_Answering` where the current plan is whole again: it is driven
        afresh instead. Returns whether it was (the same plan, driven afresh)."""
        self.driver.close()
        on_commit = self.driver.on_commit
        timeout_s = self.wait_timeout_s if timeout_s is None else timeout_s
        try:
            route = discover_route(
                self.dht, None, timeout_s, self.say, min_version, self.dht.peer_id, self.n_layers, check=back
            )
        except _Answering:
            self.say(f"plan {self.route.plan_version}: every peer answers again (a stall, not a death): running on")
            afresh = True
        else:
            self.route, self.replans, afresh = route, self.replans + 1, False
            self.say(f"plan {self.route.plan_version}: {self.route.describe()}")
        self.driver, self.watch.version = self.connect(self.route), self.route.plan_version
        self.driver.on_commit = on_commit
        return afresh

    def _answering(self) -> Callable[[], None] | None:
        """The `follow` check that ends a wait for a repair once the current plan's peers all answer again
        (asked at most every ANSWER_EVERY_S); None without `answers`."""
        if self.answers is None:
            return None
        route, asked = self.route, [-ANSWER_EVERY_S]

        def check() -> None:
            if time.monotonic() - asked[0] >= ANSWER_EVERY_S:
                asked[0] = time.monotonic()
                try:
                    whole = self.answers(route)
                except Exception as e:  # a failed DHT read or ping is no answer; the wait goes on
                    log.debug("asking plan %d's peers failed: %s", route.plan_version, e)
                    whole = False
                if whole:
                    raise _Answering

        return check

    def replan(self):
        """Follows the plan after this one (the stages refused a call as of this one); returns the new driver."""
        if self.watch is None:
            raise StageCallError(f"plan {self.route.plan_version} moved on and this trainer follows no DHT")
        self.follow(self.route.plan_version + 1)
        return self.driver

    def run_step(self, step: int, batch: Batch):
        """Runs `step` on the newest plan: (the driver's `StepResult`, the re-plans it took). A failure that no
        newer plan can mend (or the last of `STEP_ATTEMPTS`) is raised as the driver raised it."""
        from swarm.runtime.driver import csv_row

        for attempt in range(STEP_ATTEMPTS):
            if self.watch is not None and (newer := self.watch.newer()) is not None:
                self.follow(newer)
            try:
                return self.driver.train_step(step, batch), attempt
            except StageCallError as e:
                if self.watch is None or attempt == STEP_ATTEMPTS - 1:
                    raise
                if PLAN_MISMATCH in str(e):
                    self.follow(self.route.plan_version + 1)  # the step was abandoned everywhere: the new plan runs it
                elif no_route_left(e, self.route):
                    self.say(f"step {step}{csv_row(step)}: no route of replicas left ({e}); waiting for a newer plan")
                    if self.follow(self.route.plan_version + 1, self.replan_timeout_s, back=self._answering()):
                        # the old driver abandoned the step only on the peers it did not take for dead: a stalled
                        # one still holds it open and would refuse it again ("0F1 of step 0 ran already")
                        self.driver.abandon(step)
                        if behind := self.driver.drop_behind():  # they sat out the steps run without them
                            self.say(f"plan {self.route.plan_version}: left out until a newer plan, behind their "
                                     f"replicas: {', '.join(behind)}")  # fmt: skip
                else:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.driver.close()
