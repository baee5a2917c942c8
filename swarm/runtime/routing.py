"""Routing a step over a plan's routes: which samples each route trains (sticky weighted rendezvous), the
routes' weights, and the gathering of a step's calls that tells whether a route lives (the liveness pings are
`swarm.runtime.heartbeat`'s).

A replicated plan has several routes (`swarm.peers.routes.Route`; with equal replica counts R, route r is
column r of the plan). AQ-SGD keeps a message buffer per link and sample id, so a sample should travel the same
route step after step: a sample that moves refills its buffers through first sights (full precision) on the new
route. Weighted rendezvous hashing (highest random weight) gives exactly that: each (sample, route) pair draws a
fixed score, a sample goes to its highest-scoring live route, so a dead route's samples move and nobody else's
do. The weights follow the routes' measured throughput but only move in coarse, hysteretic steps
(`RouteWeights`), so timing noise never moves a sample.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import torch

from swarm.model.data import Batch
from swarm.net.stream import PLAN_MISMATCH, StageCallError
from swarm.peers.routes import Route

__all__ = [
    "CallThreads",
    "RouteWeights",
    "RouteWork",
    "Failed",
    "NoLiveRoute",
    "REROUTE_CODES",
    "Task",
    "Traffic",
    "as_error",
    "assign_samples",
    "route_work",
    "gather",
    "rendezvous_score",
    "busy",
    "reroutable",
    "spawn",
]

T = TypeVar("T")


@dataclass
class Traffic:
    """Bytes on the stage links, as the stages counted them in their replies."""

    sent: dict[tuple[int, str], int] = field(default_factory=dict)
    """(link, direction) -> bytes; link k joins stage k and k+1, direction is forward or backward; direction
    "average" counts the replicas of stage k summing their gradients (`Reduce`) under k; ("tied", "tied") the
    tied group's exchange of the tied embedding's gradient"""
    fp32_wire_bytes: int = 0
    """what the same tensors would have cost in fp32 (the boundaries and the replicas' sums)"""
    tied_fp32_bytes: int = 0
    """what the tied group's exchange (link "tied", direction "tied") would have cost in fp32"""

    def add(self, link_bytes: Mapping[int, int], fp32_wire_bytes: int, direction: str) -> None:
        """One call's bytes as its reply reported them: sent on each link, and what fp32 would have cost."""
        self.fp32_wire_bytes += fp32_wire_bytes
        for link, nbytes in link_bytes.items():
            self.sent[(link, direction)] = self.sent.get((link, direction), 0) + nbytes

    def merge(self, other: Traffic) -> None:
        self.fp32_wire_bytes += other.fp32_wire_bytes
        self.tied_fp32_bytes += other.tied_fp32_bytes
        for key, nbytes in other.sent.items():
            self.sent[key] = self.sent.get(key, 0) + nbytes

    def direction_bytes(self, direction: str) -> int:
        return sum(n for (_, d), n in self.sent.items() if d == direction)

    @property
    def forward_bytes(self) -> int:
        """activations, all links"""
        return self.direction_bytes("forward")

    @property
    def backward_bytes(self) -> int:
        """activation gradients, all links"""
        return self.direction_bytes("backward")

    @property
    def link_bytes(self) -> dict[int, int]:
        """bytes on each pipeline link, both directions (the tied group's exchange is no pipeline link)"""
        out: dict[int, int] = {}
        for (link, _), nbytes in self.sent.items():
            if not isinstance(link, int):
                continue
            out[link] = out.get(link, 0) + nbytes
        return out


def rendezvous_score(sample_id: int, key: bytes, weight: float) -> float:
    """The weighted rendezvous score of a sample on a route: -w / ln(u), u uniform in (0, 1) drawn from a hash
    of (route, sample). A route of weight w wins a share w / sum(w) of the samples."""
    digest = hashlib.blake2b(sample_id.to_bytes(8, "little", signed=True), key=key[:64], digest_size=8).digest()
    u = (int.from_bytes(digest, "little") + 0.5) / 2.0**64
    return -weight / math.log(u)


def assign_samples(sample_ids: Sequence[int], routes: Sequence[tuple[bytes, float]]) -> list[list[int]]:
    """Rows of the batch for each route (in batch order), by weighted rendezvous hashing of the sample ids.

    Every route gets at least one row when the batch has enough (a replica that runs no micro-batch would
    have no step to reduce): an empty route takes, from the route holding the most rows, the row that scores
    highest on it.

    Args:
        sample_ids: the batch's sample ids, row by row.
        routes: (key, weight) of every live route; weights > 0.
    """
    if not routes:
        raise ValueError("no route to assign samples to")
    scores = [[rendezvous_score(int(s), key, w) for key, w in routes] for s in sample_ids]
    rows: list[list[int]] = [[] for _ in routes]
    for row, per_route in enumerate(scores):
        rows[max(range(len(routes)), key=per_route.__getitem__)].append(row)
    for empty in range(len(routes)):
        if rows[empty]:
            continue
        donor = max(range(len(routes)), key=lambda c: len(rows[c]))
        if len(rows[donor]) < 2:
            break  # fewer rows than routes: the caller leaves the empty routes out of this step
        moved = max(rows[donor], key=lambda r: scores[r][empty])
        rows[donor].remove(moved)
        rows[empty].append(moved)
    return [sorted(r) for r in rows]


class RouteWeights:
    """Each route's weight for `assign_samples`: its measured samples/s relative to the other routes', held
    still until the smoothed measurement leaves the held weight by more than `tolerance`.

    Every route starts at weight 1 and equally fast routes keep it: timing noise never moves a sample. A
    route's weight is kept within a factor `max_ratio` of the heaviest one's, so a briefly slow route is not
    starved (a route with fewer samples measures fewer samples/s: pipeline fill and drain do not shrink with
    its share).

    Args:
        tolerance: relative distance the smoothed relative rate must reach from the held weight to replace it.
        smoothing: weight of a new measurement in the moving average.
        max_ratio: largest ratio between two routes' weights.
    """

    def __init__(self, tolerance: float = 0.5, smoothing: float = 0.3, max_ratio: float = 4.0):
        if not 0 < smoothing <= 1 or tolerance < 0 or max_ratio < 1:
            raise ValueError("need 0 < smoothing <= 1, tolerance >= 0, max_ratio >= 1")
        self.tolerance, self.smoothing, self.max_ratio = tolerance, smoothing, max_ratio
        self._relative: dict[bytes, float] = {}
        self._weight: dict[bytes, float] = {}

    def observe(self, samples_per_s: dict[bytes, float]) -> None:
        """The routes' throughput in the step just done (route key -> samples/s)."""
        rates = {k: r for k, r in samples_per_s.items() if r > 0 and math.isfinite(r)}
        if len(rates) < 2:
            return  # one route has nobody to be faster than
        mean = sum(rates.values()) / len(rates)
        for key, rate in rates.items():
            old = self._relative.get(key, 1.0)
            smooth = old + self.smoothing * (rate / mean - old)
            self._relative[key] = smooth
            if abs(math.log(smooth / self._weight.get(key, 1.0))) > math.log1p(self.tolerance):
                self._weight[key] = smooth

    def weights(self, keys: Sequence[bytes]) -> list[float]:
        """The weights of these routes (1 for a route never measured)."""
        held = [self._weight.get(k, 1.0) for k in keys]
        floor = max(held) / self.max_ratio
        return [max(w, floor) for w in held]

    def forget(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._relative.pop(k, None)
            self._weight.pop(k, None)


@dataclass(frozen=True)
class RouteWork:
    """What one route trains in a step."""

    route: Route
    micro: tuple[Batch, ...]
    """its micro-batches, in order (`CallInfo.micro_batch` is the position here)"""
    loss_weights: tuple[float, ...]
    """each micro-batch's rows / the batch's rows: its share of the step's mean loss"""

    @property
    def rows(self) -> int:
        return sum(len(b.sample_ids) for b in self.micro)


def route_work(batch: Batch, routes: Sequence[Route], weights: Sequence[float], n_micro: int) -> list[RouteWork]:
    """Splits `batch` over `routes`: rows by `assign_samples`, each route's rows into about
    `n_micro * share` micro-batches (at least 1, at most one per row) of near-equal size.

    A route left without rows (a batch smaller than the routes) is left out of the result.
    """
    ids = batch.sample_ids.tolist()
    total = len(ids)
    assigned = assign_samples(ids, [(c.key, w) for c, w in zip(routes, weights, strict=True)])
    work = []
    for route, rows in zip(routes, assigned, strict=True):
        if not rows:
            continue
        n = min(len(rows), max(1, round(n_micro * len(rows) / total)))
        parts = torch.tensor(rows, dtype=torch.int64).tensor_split(n)
        micro = tuple(batch.select(p) for p in parts)
        work.append(RouteWork(route, micro, tuple(len(p) / total for p in parts)))
    return work


class CallThreads:
    """Daemon threads that run `spawn`'s calls, each reused once its call ended (the most recently idle first, so
    per-thread native state stays in few threads), a new one started only when none is idle, and an idle one ending
    after `idle_s`. Unbounded: a call stuck on a hung peer holds its thread until its deadline, never a worker the
    next attempt needs.

    Why not a thread per call: `Thread.start` waits until the new thread runs, and while another thread of the
    process runs Python that takes up to a switch interval or two (5-10 ms); nine call threads at a step's start
    cost 1-4 ms in an idle process and 20-86 ms beside one busy Python thread, where handing them to idle threads
    took 0.1-0.2 ms (`scripts/measure_thread_start.py`, docs/reports/throttled.md, s65)."""

    def __init__(self, idle_s: float = 60.0):
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[_CallThread] = []
        self.started = 0
        """threads ever started (a test's and a report's count)"""

    def spawn(self, fn: Callable[[], T], name: str, tasks: set[Future] | None = None, fresh: bool = False) -> Future[T]:
        """Runs `fn` on an idle thread, or a new one; see `spawn`. `fresh`: on a new thread that ends with the call
        (a thread per call, as before s65: only to measure what reuse saves, `PipelineDriver.reuse_call_threads`)."""
        future: Future[T] = Future()
        future.set_running_or_notify_cancel()
        if tasks is not None:
            tasks.add(future)
        task = (future, fn, name, tasks)
        with self._lock:
            worker = None if fresh or not self._idle else self._idle.pop()
            if worker is not None:
                worker.task = task
                worker.wake.set()
                return future
            self.started += 1
        me = _CallThread(once=fresh)
        threading.Thread(target=self._loop, args=(me, task), name=name, daemon=True).start()
        return future

    def forget(self) -> None:
        """In a forked child: the parent's idle threads do not exist here (a call handed to one would never run)."""
        self._lock, self._idle = threading.Lock(), []

    def idle(self) -> int:
        """Threads waiting for a call now."""
        with self._lock:
            return len(self._idle)

    def _loop(self, me: _CallThread, task: tuple | None) -> None:
        thread = threading.current_thread()
        while task is not None:
            future, fn, name, tasks = task
            thread.name = name
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the waiter, whatever it is
                future.set_exception(e)
            finally:
                if tasks is not None:
                    tasks.discard(future)
            del task, future, fn, tasks  # nothing of the call outlives it in an idle thread
            if me.once:
                return
            thread.name = "swarm-call-idle"
            with self._lock:
                me.task = None
                me.wake.clear()
                self._idle.append(me)
            if not me.wake.wait(self.idle_s):
                with self._lock:
                    if me in self._idle:  # nobody took it meanwhile: it ends
                        self._idle.remove(me)
                        return
                me.wake.wait()  # a spawn took it just now: its task is on the way
            task = me.task


class _CallThread:
    def __init__(self, once: bool = False) -> None:
        self.wake = threading.Event()
        self.task: tuple | None = None
        self.once = once
        """ends with its first call (`CallThreads.spawn`'s `fresh`)"""


_CALLS = CallThreads()
os.register_at_fork(after_in_child=_CALLS.forget)


def spawn(fn: Callable[[], T], name: str, tasks: set[Future] | None = None, fresh: bool = False) -> Future[T]:
    """Runs `fn` on a daemon thread (`CallThreads`: one that ended its last call, or a new one); the future holds
    its result or exception. `tasks` tracks the running ones (for `close()` to wait for), each removed as it ends.

    Calls to a peer that hangs may stay stuck until their deadline; they never hold a thread another call waits
    for, and a daemon thread never holds up the process's exit.
    """
    return _CALLS.spawn(fn, name, tasks, fresh)


# ---- whether a route lives ------------------------------------------------------------------------------

REROUTE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
"""Failures that may mean a dead peer: the driver pings the suspects and reroutes around the dead ones."""


class NoLiveRoute(StageCallError):
    """No route of replicas is left whole: a stage has no live replica (or every route lost one)."""


class Failed(Exception):
    """An attempt ended early: a call failed (`error`, on a call to `suspects`) or a peer was declared dead."""

    def __init__(self, error: BaseException | None, suspects: tuple[str, ...] = ()):
        super().__init__(str(error) if error else "a peer was declared dead")
        self.error, self.suspects = error, suspects


Task = tuple[Future, tuple[str, ...]]
"""a call in flight and the peers whose death ends it"""

_PENDING = object()


def reroutable(error: BaseException) -> bool:
    """Whether a failed call may mean a dead peer (then the step may run again without it)."""
    if isinstance(error, StageCallError):
        return error.code in REROUTE_CODES and PLAN_MISMATCH not in str(error)
    return isinstance(error, ConnectionError | OSError)


def busy(error: BaseException) -> bool:
    """Whether a stage refused a call because every slot of its kind was held (`budget.SlotsExhausted`, "retry
    later"), e.g. by the same call of an attempt just abandoned: the step may run again (`max_attempts` bounds a
    stage that always says so)."""
    return (
        isinstance(error, StageCallError)
        and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "calls are being served already; retry later" in str(error)
    )


def gather(
    tasks: list[Task], wake: threading.Event, dead: set[str], deadline_s: float, fail_fast: bool = True
) -> list[Future | None]:
    """Waits for `tasks`; each entry of the result is its done future, or None where one of its peers was
    declared dead (in `dead`) first. Whoever adds to `dead` sets `wake`.

    fail_fast: a failed call or a dead peer of any task raises `Failed` at once; otherwise the wait ends when
    every task is done or lost. Either way the wait never outlasts `deadline_s` (+5 s).
    """
    for future, _ in tasks:
        future.add_done_callback(lambda _: wake.set())
    give_up = time.monotonic() + deadline_s + 5.0
    while True:
        wake.clear()  # cleared before the checks: a wake-up during them is not lost
        outcomes: list = []
        for future, suspects in tasks:
            lost = bool(dead.intersection(suspects))
            if fail_fast and future.done() and future.exception() is not None:
                raise Failed(future.exception(), suspects)
            if fail_fast and lost:
                raise Failed(None, suspects)
            outcomes.append(future if future.done() else None if lost else _PENDING)
        if _PENDING not in outcomes:
            return outcomes
        left = give_up - time.monotonic()
        if left <= 0:
            stuck = tuple(p for (_, s), o in zip(tasks, outcomes, strict=True) if o is _PENDING for p in s)
            error = StageCallError(f"no answer within {deadline_s:.0f} s", grpc.StatusCode.DEADLINE_EXCEEDED)
            raise Failed(error, stuck)
        wake.wait(left)


def as_error(failure: Failed, step: int, why: str = "") -> StageCallError:
    """The error a failed call of step `step` raises: its own StageCallError (with `why` added), or one naming
    the peers declared dead."""
    error = failure.error
    if isinstance(error, StageCallError):
        return type(error)(f"{error} ({why})" if why else str(error), error.code) if why else error
    dead = ", ".join(failure.suspects) or "a peer"
    detail = f"{type(error).__name__}: {error}" if error is not None else f"{dead} declared dead"
    return StageCallError(f"step {step}: {detail}{f' ({why})' if why else ''}", grpc.StatusCode.UNAVAILABLE)
