"""The trainer's side of a pipeline: drive one optimizer step across the routes of stage replicas of a plan.

Token ids go to stage 0 and labels to the last stage; activations and gradients then travel stage to stage
directly, never through the driver. The driver only collects each micro-batch's loss, and once per step each
stage's squared gradient norm; the tied embedding's gradients are summed between the end stages themselves
(the tied group of their Reduce, `swarm.runtime.average`). The stages are reached through a `Connector`: over
gRPC in a swarm, in-process in `swarm.runtime.inprocess`. Every byte of a step is counted: the stages report the
boundaries', sums' and tied group's bytes, the driver its own calls' (`control_bytes`), failed attempts too.

With replicas, the plan has several routes (`swarm.peers.routes`: column r with equal counts, route c on replica
c % R_s of stage s with uneven ones): each sample trains on one (`swarm.runtime.routing`), the
replicas of each stage then sum their gradients among themselves (`Reduce`) before every replica steps; a
replica shared by several routes gets one Reduce, Grads and Step per step. With 2+ stages every distinct
replica of the first and last stage gets a Reduce (alone in its stage or not) naming the tied group.
A peer that dies mid-step (a failed call confirmed by a ping, or silence past its own round trips' window and a
failed confirming probe: `swarm.runtime.heartbeat`) takes its route out;
the step is abandoned on every live replica and run again whole on the surviving routes, so every stage
applies each step exactly once.

A peer may also lie (`swarm.runtime.suspects`): every Grads reply's numbers are checked before any is used, and
a step that fails because of one peer's reply (an implausible norm, or a call whose error blames it: a
neighbour's refusal of what it sent, its own failure to compute or encode) is abandoned everywhere and
skipped, with a strike for that peer. Enough strikes evict it: it counts as dead from then on (its routes are
left out, the step runs again on the survivors), and stays banned for the run (`Suspects.banned`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import Message

from swarm import trace
from swarm.metrics import Metrics, delta
from swarm.model.data import Batch, SampleSet
from swarm.net.connect import Connector, GrpcConnector
from swarm.net.stream import StageCallError, name_failure, tokens_to_wire
from swarm.peers.routes import Route, n_routes, route_replicas, stage_numbering, uneven
from swarm.proto import stage_pb2
from swarm.runtime.average import EARLY_REDUCE
from swarm.runtime.callinfo import CallRouter, labels_missing, route_needed
from swarm.runtime.commit import StepCommit
from swarm.runtime.gate import runs_through
from swarm.runtime.heartbeat import HeartbeatConfig, PingLoop, RoundTrips
from swarm.runtime.heldout import HeldOutLoss, held_out_loss
from swarm.runtime.messages import GradReport, from_wire
from swarm.runtime.precision import agreed_step
from swarm.runtime.results import StepResult
from swarm.runtime.routing import (
    Failed,
    NoLiveRoute,
    RouteWeights,
    RouteWork,
    Task,
    Traffic,
    as_error,
    busy,
    gather,
    reroutable,
    route_work,
    spawn,
)
from swarm.runtime.schedules import backward_follows_forward
from swarm.runtime.suspects import Implausible, Suspects, culprit, disproportionate
from swarm.runtime.verify import AuditDisputed, LiarFound, Referee, StageVerifier, VerifyConfig

if TYPE_CHECKING:
    from swarm.net.auth import CallSigner

__all__ = ["NoLiveRoute", "PipelineDriver", "StepResult", "Traffic"]

log = logging.getLogger(__name__)


@dataclass
class _MicroResult:
    loss: float
    """the micro-batch's mean loss times its loss weight"""
    traffic: Traffic
    ended: float
    """perf_counter when its backward came back"""


@dataclass
class _First:
    """A route's first Forward of an attempt, which leaves before the attempt's other calls (`first_call_first`):
    `out` is set once its request is built (or its task ended first); `backward`, its Backward start (1F1B), is
    spawned by the attempt's thread with the others and handed back in `parked`."""

    out: threading.Event = field(default_factory=threading.Event)
    backward: Callable[[], object] | None = None
    parked: Future = field(default_factory=Future)


def _nested(route: Sequence) -> list[list[str]]:
    return [[r] if isinstance(r, str) else list(r) for r in route]


class PipelineDriver:
    """Drives training steps over the routes of replicas at `route`, rerouting around dead peers.

    Args:
        route: address of every stage in pipeline order: one per stage, or the replicas of each stage
            (`route[stage][replica]`; counts may differ between stages: route c runs on replica c % R_s).
        peers: peer ids, shaped like `route`.
        schedule: a name in `swarm.runtime.schedules.SCHEDULES`.
        n_micro: micro-batches per step, over all routes.
        deadline_s: longest a micro-batch may take end to end.
        connector: how to reach the stages (default: gRPC, signed by `signer`).
        plan_version: the plan the stages follow.
        metrics: where the driver counts the steps' bytes, losses and times (default: its own registry).
        signer: the trainer's identity on the default gRPC connector (None: a fresh key, enough where any
            authenticated caller may train or ask for Status).
        max_attempts: runs of one step (the first and its reroutes) before it fails.
        heartbeat_s: time between heartbeat pings of the peers while a step runs (`heartbeat` None).
        heartbeat_misses: timeouts' worth of silence that make a peer suspect (`heartbeat` None).
        heartbeat: how peers are told dead from slow (`swarm.runtime.heartbeat`; None: the defaults with
            `heartbeat_s` and `heartbeat_misses`).
        weights: the routes' sample shares (default: fresh, from measured throughput).
        suspects: the run's strikes, bans and norm history (default: fresh; the trainer keeps one for the run,
            so that a re-plan's driver knows who was banned).
        verify: how replicated stages' work is audited (`swarm.runtime.verify`; None or fraction 0: not at all).
        on_liar: told `(peer_id, reason)` of every replica the audits evict (e.g. to ban it for the run).
        referee: the trainer's own recomputation of a stage (`swarm.runtime.referee.StageReferee`), which settles a
            dispute between two replicas with weights fetched over GetState (None: a dispute stays one).
    """

    backward_early = True
    """Send each micro-batch's Backward start with its Forward where the last stage runs it right after that forward
    (1F1B; the stage holds it until its turn); False: after the Forward's reply, as before (only to measure what it
    saves: `scripts/measure_step_overhead.py`)."""
    labels_with_pipeline = True
    """Send a step's labels beside its first Forwards, not before them (the last stage waits for them at admission,
    `StageHost.await_labels`): no PutLabels round trip precedes the pipeline. Turned off for the rest of the run by
    a last stage that refuses a Forward for want of labels that were sent beside it (a version that does not
    wait); False: labels first, as before (also to measure what it saves: `scripts/measure_step_overhead.py`)."""
    grads_in_reduce = True
    """Take each stage's gradient report from its Reduce reply (`ReduceReply.grads`), and a stage with nothing to
    sum is asked Grads beside the Reduces: no Grads round trip follows the sums; False: Grads everywhere after the
    Reduces, as before (only to measure what it saves: `scripts/measure_step_overhead.py`)."""

    reuse_call_threads = True
    """Run the step's calls on reused threads (`swarm.runtime.routing.CallThreads`); False: a thread per call, as
    before (only to measure what reuse saves: `scripts/measure_step_overhead.py`)."""
    first_call_first = True
    """Where labels go beside the pipeline: send each route's first Forward before the step's other calls (its
    labels, the other Forwards, the Backward starts, the early Reduces), which all leave at once and share the
    trainer's one interpreter: stage 0 can start computing only once that Forward is in, and needs the others
    later. False: all at once, as before (only to measure what it saves: `scripts/measure_step_overhead.py`)."""
    ping_recent_peers_late = True
    """A step's heartbeat loop leaves a peer that answered a ping less than the interval ago alone until its next
    beat (`PingLoop`): steps shorter than the interval no longer begin with a Ping of every peer beside their first
    calls. False: every step's loop pings at once, as before (only to measure: `scripts/measure_step_overhead.py`)."""
    reduce_with_pipeline = True
    """Send a step's Reduce calls with its pipeline, not after it, where the step runs on one route: each stage
    holds its Reduce until its last backward ran (`StageHost.await_backwards`), so the tied gradient's swap starts
    there, the earlier end's message waits at the later one, and no trip through the trainer comes between (with
    several routes a replica's sum could reach a replica of another route that has not opened the step yet, which
    refuses it: after the pipeline, as before). Turned off for the rest of the run by a stage that refuses an early
    Reduce (a version that does not wait: it is asked again after the pipeline); False: after the pipeline, as
    before (also to measure what it saves: `scripts/measure_step_overhead.py`)."""

    def __init__(
        self,
        route: Sequence[str] | Sequence[Sequence[str]],
        peers: Sequence[str] | Sequence[Sequence[str]],
        schedule: str = "1f1b",
        n_micro: int = 4,
        deadline_s: float = 120.0,
        connector: Connector | None = None,
        plan_version: int = 0,
        metrics: Metrics | None = None,
        signer: CallSigner | None = None,
        max_attempts: int = 3,
        heartbeat_s: float = 1.0,
        heartbeat_misses: int = 3,
        weights: RouteWeights | None = None,
        tied: bool = True,
        suspects: Suspects | None = None,
        verify: VerifyConfig | None = None,
        on_liar: Callable[[str, str], None] | None = None,
        referee: Referee | None = None,
        heartbeat: HeartbeatConfig | None = None,
    ):
        routes, ids = _nested(route), _nested(peers)
        if not routes or len(routes) != len(ids) or [len(r) for r in ids] != [len(r) for r in routes]:
            raise ValueError("route and peers must name the same replicas of a non-zero number of stages")
        if any(not r for r in routes) or max_attempts < 1:
            raise ValueError("every stage needs a replica, and a step at least one attempt")
        self.counts = tuple(len(r) for r in routes)
        """replicas of each stage; route c runs on replica c % counts[s] of stage s (`swarm.peers.routes`)"""
        self.replica_addresses = [tuple(r) for r in routes]
        self.replica_peers = [tuple(r) for r in ids]
        self.routes = [self._route(c) for c in range(n_routes(self.counts))]
        self.route, self.peers = list(self.routes[0].addresses), list(self.routes[0].peers)
        self.schedule, self.n_micro, self.deadline_s = schedule, n_micro, deadline_s
        self.plan_version, self.max_attempts = plan_version, max_attempts
        self.heartbeat = heartbeat or HeartbeatConfig(
            interval_s=heartbeat_s, misses=heartbeat_misses, floor_s=min(heartbeat_s, HeartbeatConfig.ceiling_s)
        )
        self.round_trips = RoundTrips(self.heartbeat)
        """every peer's round trips so far: its pings' timeouts and its silence window (kept across steps)"""
        if connector is None and signer is None:
            from swarm.net.auth import CallSigner, Identity

            signer = CallSigner(Identity.generate())
        self.connector = connector or GrpcConnector(signer=signer)
        self.metrics = metrics or Metrics()
        trace.start("trainer")  # where SWARM_TRACE_DIR asks for a timeline
        self._step_started = time.perf_counter()  # when the step in progress began (its Step reports the time)
        self.weights = weights or RouteWeights()
        self.tied = tied
        """whether the model ties its embedding and head: only then do the end stages sum a tied group"""
        self.suspects = suspects or Suspects()
        self.suspects.layout(self.n_stages)  # a re-plan onto other stages starts their norm history afresh
        self._peer_set = frozenset(p for row in ids for p in row)
        self.dead: set[str] = set(self._peer_set & self.suspects.banned.keys())
        """peer ids declared dead (by a failed call confirmed by a ping, or by missed heartbeats), or evicted"""
        self._stage_sq: dict[int, float] = {}
        """the squared norm each stage reported in the step's Grads (for `Suspects.applied`)"""
        # every call to a stage carries a token for that stage's peer id
        self._stubs = {
            (s, r): self.connector.stage(a, ids[s][r]) for s, row in enumerate(routes) for r, a in enumerate(row)
        }
        self.stubs = [self._stubs[(s, 0)] for s in range(len(routes))]
        self._tasks: set[Future] = set()
        """the driver's calls still running (`close` waits for them a moment)"""
        self._inflight: list[Task] = []
        self._control, self._control_lock = 0, threading.Lock()
        """bytes of the driver's calls (requests and replies, serialized) since the step began"""
        self._all = Traffic()
        """every attempt's stage-reported bytes since the step began (failed attempts included)"""
        self._reported: dict[tuple[int, int], stage_pb2.GradReply] = {}
        """(stage, replica) -> the gradient report its Reduce reply carried this attempt (`grads_in_reduce`)"""
        self.loss_scale = 0.0
        """the loss scale every stage holds for the next step, as their Grads and Step replies said (0: not
        heard yet); named in every call, so a stage holding another refuses (swarm.runtime.precision)"""
        self.router = CallRouter(
            self._call, self.replica_peers, self.counts, plan_version, schedule, deadline_s, lambda: self.loss_scale
        )
        """each micro-batch's call info and calls, which carry the route until the peer takes it from its plan"""
        self.on_liar = on_liar
        self.liars: list[tuple[str, str]] = []
        """(peer id, reason) of every replica evicted as a liar, in order"""
        self._abandons = 0
        """abandons sent so far: an audit concludes nothing once its attempt was abandoned"""
        self._audits: list[Task] = []
        """the running attempt's audits, gathered before its Step"""
        self._attempt = 0
        """the running attempt of the step (1, 2, ...; 0 outside `train_step`): audits draw afresh for each"""
        self._labels_raced = False
        """whether the running attempt sent its labels beside the pipeline (`labels_with_pipeline`)"""
        self._liars_before = 0
        """`len(liars)` when the running attempt began: the ones after it were evicted by its own audits"""
        self._used: list[Route] = []
        """the routes of the attempt that runs"""
        self._attempt_work: tuple[list[RouteWork], object, int] | None = None
        """the running attempt's work, its layout and the abandons sent when it began (`_audit_disproportion`)"""
        self._early: tuple[list, list] | None = None
        """the running attempt's Reduces sent with its pipeline (`reduce_with_pipeline`), for `_reduce`"""
        self._audited: set[tuple[int, int]] = set()
        """(route, micro-batch) of the running attempt's audits"""
        self.verifier = (
            StageVerifier(
                verify, self._call, self.replica_peers, self._evict, referee, self._fetch_state, self._count_control
            )
            if verify is not None and (verify.fraction > 0 or verify.digests)
            else None
        )
        """the audits of replicated stages' work (`swarm.runtime.verify`; None: off)"""
        self.on_commit: Callable[[StepCommit], None] | None = None
        """told each step's `StepCommit` before the step's first Step is sent (the trainer's journal: a trainer
        killed after it restarts finishes that step where it is missing, `finish_step`, and never runs it again)"""

    @property
    def n_stages(self) -> int:
        return len(self.route)

    @property
    def n_replicas(self) -> int:
        """The number of routes (with equal replica counts R: R routes)."""
        return len(self.routes)

    def _route(self, c: int) -> Route:
        at = route_replicas(c, self.counts)
        addresses = tuple(self.replica_addresses[s][r] for s, r in enumerate(at))
        return Route(c, addresses, tuple(self.replica_peers[s][r] for s, r in enumerate(at)))

    def _replicas(self, s: int, routes: Sequence[Route]) -> list[int]:
        """The distinct replicas of stage `s` that `routes` run on, in replica order: each gets one call."""
        return sorted({c.index % self.counts[s] for c in routes})

    def live_routes(self) -> list[int]:
        """The routes whose every peer is alive."""
        return [c.index for c in self.routes if not self.dead.intersection(c.peers)]

    # ---- calls ------------------------------------------------------------------------------------------

    def _count_control(self, nbytes: int, method: str) -> None:
        with self._control_lock:
            self._control += nbytes
        self.metrics.control_call_bytes.labels(method).inc(nbytes)  # the same bytes, by kind (steps.csv columns)

    def _call(self, stage: int, replica: int, method: str, request, timeout: float | None = None):
        """`method` on replica `replica` of `stage` (route c's replica is c % counts[stage]); the request's and
        the reply's serialized bytes are counted as control bytes (a stream's items as they are pulled)."""
        if isinstance(request, Message):
            self._count_control(request.ByteSize(), method)
        elif isinstance(request, (list, tuple)):  # a stream's items at hand (one: its unary twin), counted now
            for item in request:
                self._count_control(len(item), method)
        else:
            request = self._counted(request, method)
        try:
            reply = getattr(self._stubs[(stage, replica)], method)(request, timeout=timeout or self.deadline_s)
            self._count_control(reply.ByteSize(), method)
            return reply
        except grpc.RpcError as e:
            peer, address = self.replica_peers[stage][replica], self.replica_addresses[stage][replica]
            raise name_failure(e, stage, peer, address) from e

    def _fetch_state(self, stage: int, replica: int):
        """GetState of that replica's stage under this plan (the referee's weights), its items counted as
        control bytes as they are pulled."""
        request = stage_pb2.StateRequest(stage=stage, plan_version=self.plan_version)
        self._count_control(request.ByteSize(), "GetState")
        call = self._stubs[(stage, replica)].GetState(request, timeout=self.deadline_s)
        return _CountedStream(call, lambda nbytes: self._count_control(nbytes, "GetState"))

    def _counted(self, items, method: str):
        for item in items:
            self._count_control(len(item), method)
            yield item

    def _spawn(self, fn, suspects: tuple[str, ...]) -> Task:
        task = (spawn(fn, "driver", self._tasks, fresh=not self.reuse_call_threads), suspects)
        self._inflight.append(task)
        return task

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Counts the body's seconds as the trainer's phase `name` of the step (`trainer_phase_seconds`; steps.csv
        has each step's share): where a step's time goes, failures included."""
        start = time.perf_counter()
        try:
            with trace.span(name, "trainer"):
                yield
        finally:
            self.metrics.trainer_phase_seconds.labels(name).inc(time.perf_counter() - start)

    def _result(self, task: Task):
        """The reply of a call spawned with `_spawn`, waited for at most as long as the call itself may take (its
        own deadline ends it first; the step's `gather` sees a dead peer or a failure at once either way)."""
        return task[0].result(timeout=self.deadline_s + CLOSE_WAIT_S)

    def _ping(self, peer: str, timeout_s: float) -> None:
        """A Ping to `peer`; raises only where the peer may be dead (a refusal, UNIMPLEMENTED too, is an answer)."""
        stage, replica = self._where(peer)
        try:
            self._call(stage, replica, "Ping", stage_pb2.PingRequest(), timeout=timeout_s)
        except StageCallError as e:
            if reroutable(e):
                raise

    def _alive(self, peer: str, timeout_s: float | None = None) -> bool:
        """One `Ping` (on its own thread, waited for at most `timeout_s`; default: the confirming probe's deadline
        for that peer, `RoundTrips.confirm_timeout`): does `peer` answer at all? A killed peer refuses at once."""
        return self._answering([peer], timeout_s)[peer]

    def _answering(self, peers: Sequence[str], timeout_s: float | None = None) -> dict[str, bool]:
        """`_alive` for each of `peers`, all pinged at once (a slow suspect never delays another's verdict)."""
        deadline = {p: timeout_s or self.round_trips.confirm_timeout(p) for p in peers}
        pings = {p: spawn(lambda p=p: self._ping(p, deadline[p]), "ping", self._tasks) for p in peers}
        out = {}
        for peer, ping in pings.items():
            try:
                ping.result(timeout=deadline[peer] + 1.0)
                out[peer] = True
            except Exception:
                out[peer] = False
        return out

    def _name(self, stage: int, replica: int) -> str:
        """How an error names a replica: "stage S replica R (peer ID at ADDR)"."""
        peer, address = self.replica_peers[stage][replica], self.replica_addresses[stage][replica]
        return f"stage {stage} replica {replica} (peer {peer} at {address})"

    def _where(self, peer: str) -> tuple[int, int]:
        """(stage, replica) of `peer`."""
        for s, peers in enumerate(self.replica_peers):
            if peer in peers:
                return s, peers.index(peer)
        raise KeyError(peer)

    def _ping_loop(self, routes: Sequence[Route], wake: threading.Event) -> PingLoop:
        def on_dead(peer: str) -> None:
            log.warning("peer %s silent past its window and its confirming probe failed: declared dead", peer)
            self.dead.add(peer)
            wake.set()

        peers = [p for c in routes for p in c.peers]
        return PingLoop(
            self._ping, peers, on_dead, self.heartbeat, self.round_trips, ping_at_once=not self.ping_recent_peers_late
        )

    # ---- one attempt ------------------------------------------------------------------------------------

    def _micro_batch(
        self, step: int, work: RouteWork, mb: int, layout=None, audits=None, first: _First | None = None
    ) -> _MicroResult:
        """One micro-batch's forward and backward on its route; `audits`: (attempt, abandons so far, the
        attempt's list of audit tasks), taken when the attempt began, so a late task never joins a later one.
        `first`: this is the step's first Forward on its route, sent before the step's other calls
        (`first_call_first`; its Backward start is spawned with them)."""
        last, data = self.n_stages - 1, work.micro[mb]
        first_r, last_r = work.route.index % self.counts[0], work.route.index % self.counts[last]

        def tokens(route: bool) -> Iterator[bytes]:
            wire = tokens_to_wire(data.tokens, data.sample_ids)
            items = self.router.start(step, mb, 0, work, layout, route, wire)
            if first is not None:
                first.out.set()  # built: this thread keeps the interpreter until the call is in gRPC's hands
            return items

        # communication: the backward starts at the route's last stage and flows back to its stage 0. Where that
        # stage runs it right after the forward (1F1B), it is sent with the forward, not after its reply: the last
        # stage holds it until its turn, so no trip last stage -> ... -> stage 0 -> trainer -> last stage waits
        # between them (GPipe runs every forward first: there it would only hold a data slot longer)
        start = lambda route: self.router.start(step, mb, last, work, layout, route)  # noqa: E731
        backward_call = lambda: self.router.routed(step, last, last_r, "Backward", start)  # noqa: E731
        schedule = layout[0] if layout is not None else self.schedule
        early = last > 0 and self.backward_early and backward_follows_forward(schedule, last + 1, len(work.micro))
        parked = None
        if early and first is None:
            parked = self._spawn(backward_call, work.route.peers)
        elif early:
            first.backward = backward_call
        # communication: tokens into stage 0 of the route; the activations flow on to its last stage, the loss
        # comes back
        with trace.span("Forward", "trainer", mb=mb, step=step):
            forward = self.router.routed(step, 0, first_r, "Forward", tokens)
        with trace.span("Backward", "trainer", mb=mb, step=step):
            if first is not None and first.backward is not None:
                parked = first.parked.result(timeout=self.deadline_s)  # spawned with the others (`_run_routes`)
            backward = backward_call() if parked is None else self._result(parked)
        verifier = self.verifier  # a sampled micro-batch is audited beside the step's Reduce, before its Step
        if (
            verifier is not None
            and audits is not None
            and verifier.sampled(step, audits[0], work.route.index, mb, *self._suspect(work.route))
        ):
            audit = lambda: self._audit(step, work, mb, layout, audits[1])  # noqa: E731
            audits[2].append(self._spawn(audit, work.route.peers))
            self._audited.add((work.route.index, mb))
        traffic = Traffic()
        for reply, direction in ((forward, "forward"), (backward, "backward")):
            links, fp32, why = self.suspects.counted_bytes(reply.traffic, self.n_stages - 1)
            if why is not None:  # summed along the route: whose lie cannot be told; it never reaches the metrics
                log.warning("step %d: route %s's %s reply counts impossible bytes, dropped: %s",
                            step, list(work.route.peers), direction, why)  # fmt: skip
            traffic.add(links, fp32, direction)
        self._record(traffic)  # counted even for a lie: every attempt's bytes are
        if (why := self.suspects.loss_lie(forward.loss, self.loss_scale)) is not None:
            # the last stage computed it (the stages before it relay its reply)
            raise Implausible(f"step {step}: {self._name(last, last_r)}: {why}", work.route.peers[last])
        return _MicroResult(forward.loss * work.loss_weights[mb], traffic, time.perf_counter())

    def _suspect(self, route: Route) -> tuple[bool, bool]:
        """Whether a peer of `route` has strikes or is on probation (its micro-batches are audited more often), and
        whether one is in its first `entry_steps` steps (every one of them is audited: `VerifyConfig.entry_steps`)."""
        config = self.verifier.config
        suspect = any(self.suspects.suspect(p, config.probation_steps) for p in route.peers)
        return suspect, any(self.suspects.entering(p, config.entry_steps) for p in route.peers)

    def _audit(self, step: int, work: RouteWork, mb: int, layout, abandons: int) -> None:
        """Audits micro-batch `mb` of `work` (`StageVerifier.audit`) against the other replicas of its stages
        that run this attempt."""
        at = route_replicas(work.route.index, self.counts)
        local = layout[1][(work.route.index, mb)][0] if layout is not None else [mb] * self.n_stages
        siblings = [
            [r for r in self._replicas(s, self._used) if r != at[s] and self.replica_peers[s][r] not in self.dead]
            for s in range(self.n_stages)
        ]
        self.verifier.audit(
            step, self.plan_version, at, local, siblings, work.micro[mb], work.loss_weights[mb],
            current=lambda: self._abandons == abandons,
        )  # fmt: skip

    def _evict(self, peer: str, reason: str) -> None:
        """Takes a liar out of the routes (as if dead: its step runs again without it) and tells `on_liar`."""
        with self._control_lock:  # audits run on the micro-batches' threads: one eviction per liar
            if any(p == peer for p, _ in self.liars):
                return
            self.liars.append((peer, reason))
        log.warning("evicting peer %s: %s", peer, reason)
        self.dead.add(peer)
        self.suspects.ban(peer, reason)  # an audit's verdict is evidence enough: banned for the run at once
        if self.on_liar is not None:
            self.on_liar(peer, reason)

    def _run_routes(
        self, step: int, work: list[RouteWork], wake: threading.Event, reduce: bool = False
    ) -> tuple[float, Traffic]:
        """Every route's micro-batches, all at once; the batch's mean loss and the bytes. Records each route's
        samples/s in `weights`. `reduce`: the step's Reduces leave with the pipeline (`reduce_with_pipeline`; kept
        in `_early` for `_reduce`)."""
        start = time.perf_counter()
        self._used, self._audits, self._audited = [w.route for w in work], [], set()
        layout = None
        if uneven(self.counts):  # shared replicas: number every replica's micro-batches (route, position) order
            numbering = stage_numbering({w.route.index: len(w.micro) for w in work}, self.counts)
            # a shared replica interleaves routes: 1F1B may then deadlock (from 3 stages on); GPipe never does
            schedule = self.schedule if runs_through(self.schedule, self.counts, numbering) else "gpipe"
            if schedule != self.schedule:
                log.info("step %d: %s would deadlock on these routes' shared replicas: gpipe", step, self.schedule)
            layout = (schedule, numbering)
        # one PutLabels per route (and per max_batch rows) rather than one per micro-batch; beside the pipeline (the
        # last stage waits for them: `StageHost.await_labels`), or before it where a last stage would not wait
        self._labels_raced = self.labels_with_pipeline
        audits = (self._attempt, self._abandons, self._audits)
        self._attempt_work = (work, layout, self._abandons)
        micro = lambda w, mb, first=None: self._spawn(  # noqa: E731
            lambda: self._micro_batch(step, w, mb, layout, audits, first), w.route.peers
        )
        send_labels = lambda: [  # noqa: E731
            self._spawn(lambda w=w: self.router.labels(step, w, layout), w.route.peers) for w in work
        ]
        if not self._labels_raced:
            labels = send_labels()
            with self._phase("labels"):
                gather(labels, wake, self.dead, self.deadline_s)
        with self._phase("pipeline"):
            firsts = []  # each route's first Forward, sent before the step's other calls (`first_call_first`)
            if self._labels_raced and self.first_call_first:
                starts = [_First() for _ in work]
                firsts = [micro(w, 0, first) for w, first in zip(work, starts, strict=True)]
                for w, first, (task, _) in zip(work, starts, firsts, strict=True):
                    task.add_done_callback(lambda _, out=first.out: out.set())  # one that fails first frees them too
                    first.out.wait(self.deadline_s)  # built and leaving: the rest may start
                    if first.backward is not None and not task.done():
                        first.parked.set_result(self._spawn(first.backward, w.route.peers))
            if self._labels_raced:
                labels = send_labels()
            tasks = [
                ([firsts[i]] if firsts else []) + [micro(w, mb) for mb in range(1 if firsts else 0, len(w.micro))]
                for i, w in enumerate(work)
            ]
            sent = labels if self._labels_raced else []
            # one route only: there every group's other member has the step open before this one's backwards end
            # (the tied pair's other end computed this route's forwards); replicas on other routes may not yet
            early = reduce and self.reduce_with_pipeline and len(work) == 1
            piped = threading.Event() if early else None
            self._early = self._send_reduces(step, self._used, piped) if early else None
            try:
                gather(sent + [t for calls in tasks for t in calls], wake, self.dead, self.deadline_s)
            finally:
                if piped is not None:
                    piped.set()  # a Reduce an older stage refused early is sent again now
        traffic, loss, rates = Traffic(), 0.0, {}
        for w, calls in zip(work, tasks, strict=True):
            results = [f.result() for f, _ in calls]
            for r in results:
                traffic.merge(r.traffic)
                loss += r.loss
            rates[w.route.key] = w.rows / max(max(r.ended for r in results) - start, 1e-9)
        self.weights.observe(rates)
        return loss, traffic

    def _record(self, traffic: Traffic) -> None:
        with self._control_lock:
            self._all.merge(traffic)

    def _reduce_requests(self, step: int, routes: list[Route]):
        """The step's Reduce calls, (stage, replica, request, the peers it involves) each, and the (stage, replica)
        of each stage with nothing to sum (see `_reduce`)."""
        last = self.n_stages - 1
        ends = (0, last) if last > 0 and self.tied else ()
        tied = [(s, r) for s in ends for r in self._replicas(s, routes)]
        reduces, alone = [], []
        for s in range(self.n_stages):
            replicas = self._replicas(s, routes)
            if len(replicas) < 2 and s not in ends:  # a group of one: nothing to sum
                alone.append((s, replicas[0]))
                continue
            request = stage_pb2.ReduceRequest(
                step=step,
                plan_version=self.plan_version,
                stage=s,
                group_peers=[self.replica_peers[s][r] for r in replicas],
                group_addresses=[self.replica_addresses[s][r] for r in replicas],
                deadline_s=min(self.deadline_s, REDUCE_DEADLINE_S),
                attempt_id=self.router.attempt_id,
            )
            if s in ends:
                request.tied_peers.extend(self.replica_peers[t][r] for t, r in tied)
                request.tied_addresses.extend(self.replica_addresses[t][r] for t, r in tied)
            group = tuple(request.group_peers) + tuple(request.tied_peers)
            reduces.extend((s, r, request, group) for r in replicas)
        return reduces, alone

    def _send_reduces(self, step: int, routes: list[Route], piped: threading.Event | None = None):
        """Spawns the step's Reduce calls: ((stage, replica, task) each, the (stage, replica) of each stage with
        nothing to sum). `piped`: they leave with the pipeline (`reduce_with_pipeline`), and it is set once the
        pipeline ended; a stage that refuses a Reduce before its backwards ran (an older version, which does not
        wait for them) is asked again then, and no Reduce leaves early again."""

        def call(s: int, r: int, request) -> stage_pb2.ReduceReply:
            try:
                return self._call(s, r, "Reduce", request)
            except StageCallError as e:
                if piped is None or EARLY_REDUCE not in str(e):
                    raise
                with self._control_lock:
                    first, self.reduce_with_pipeline = self.reduce_with_pipeline, False
                if first:
                    log.warning("stage %d refused a Reduce sent with the pipeline (%s); sending Reduce after the "
                                "pipeline from now on", s, e)  # fmt: skip
                piped.wait(self.deadline_s)
                return self._call(s, r, "Reduce", request)

        reduces, alone = self._reduce_requests(step, routes)
        return [(s, r, self._spawn(lambda s=s, r=r, q=q: call(s, r, q), group)) for s, r, q, group in reduces], alone

    def _reduce(self, step: int, routes: list[Route], wake: threading.Event, sent: tuple | None = None) -> Traffic:
        """Sums each stage's gradients over the distinct replicas `routes` used (`Reduce`, one call per replica),
        bytes under direction "average"; with 2+ stages of a model that ties its embedding and head (`tied`), the
        end stages' replicas also sum the tied gradient (their tied group: stage 0's replicas, then the last
        stage's), bytes under ("tied", "tied"). A stage whose routes share one replica has nothing to sum (an
        end stage of a tied model still joins the tied group). Every Reduce reply carries the replica's gradient
        report (`_reported`, read by `_grads`); a stage with nothing to sum is asked Grads in the same round
        (`grads_in_reduce`; not Reduce as a group of one, which would take the stage's one Reduce slot for nothing).
        `sent`: what `_send_reduces` sent with the pipeline; else the Reduces are sent now."""
        traffic = Traffic()
        tasks, lone = sent if sent is not None else self._send_reduces(step, routes)
        self._reported = {}
        alone = []  # (stage, replica, Grads call) of the stages with nothing to sum
        if self.grads_in_reduce:
            grads = stage_pb2.StepRequest(step=step)
            for s, r in lone:
                call = lambda s=s, r=r: self._call(s, r, "Grads", grads)  # noqa: E731
                alone.append((s, r, self._spawn(call, (self.replica_peers[s][r],))))
        gather([t for _, _, t in tasks + alone], wake, self.dead, self.deadline_s)
        self._reported.update({(s, r): future.result() for s, r, (future, _) in alone})
        for s, r, (future, _) in tasks:
            reply = future.result()
            if self.grads_in_reduce and reply.HasField("grads"):
                self._reported[(s, r)] = reply.grads
            if reply.wire_bytes or reply.fp32_wire_bytes:
                traffic.sent[(s, "average")] = traffic.sent.get((s, "average"), 0) + reply.wire_bytes
            traffic.fp32_wire_bytes += reply.fp32_wire_bytes
            if reply.tied_wire_bytes or reply.tied_fp32_wire_bytes:
                traffic.sent[("tied", "tied")] = traffic.sent.get(("tied", "tied"), 0) + reply.tied_wire_bytes
                traffic.tied_fp32_bytes += reply.tied_fp32_wire_bytes
        self._record(traffic)
        return traffic

    def _grads(self, step: int, routes: list[Route], wake: threading.Event) -> float:
        """The global gradient norm (stage 0 counts the tied group's sum in its own, the last stage not), from the
        reports the Reduce round took (`_reported`); a replica it has none of is asked Grads now."""
        request = stage_pb2.StepRequest(step=step)
        groups = [self._replicas(s, routes) for s in range(self.n_stages)]
        reported = self._reported
        tasks = {
            (s, r): self._spawn(lambda s=s, r=r: self._call(s, r, "Grads", request), (self.replica_peers[s][r],))
            for s, group in enumerate(groups)
            for r in group
            if (s, r) not in reported
        }
        gather(list(tasks.values()), wake, self.dead, self.deadline_s)
        replies = {**reported, **{key: future.result() for key, (future, _) in tasks.items()}}
        grads = {(s, r): from_wire(GradReport, replies[(s, r)]) for s, group in enumerate(groups) for r in group}
        try:
            # every number is checked before any is used: a lie raises Implausible (the step is then skipped), or
            # a sibling replica's reply stands in for the liar's (the step goes on)
            peers = {k: self.replica_peers[k[0]][k[1]] for k in grads}
            grads = self.suspects.judge_grads(step, grads, peers, self._name)
            self.loss_scale, norm = agreed_step(step, grads, [(s, group[0]) for s, group in enumerate(groups)])
            self._stage_sq = {s: grads[(s, group[0])].grad_sq_norm for s, group in enumerate(groups)}
        except StageCallError:
            self.abandon(step)
            raise
        return norm

    def _apply(self, step: int, routes: list[Route], norm: float, wake: threading.Event) -> float:
        """`Step` on every distinct live replica `routes` used, once each. A replica that dies now is left behind
        (the others apply the step: the reduced gradient is already theirs); a live one that failed is asked once
        more (Step is idempotent). Once any replica applied the step it counts as applied: a replica whose Step
        hangs past the deadline is declared dead (it catches up later), the step is never run again."""

        def step_stage(s: int, replica: int) -> stage_pb2.StepReply:
            skip = not math.isfinite(norm)  # every stage skips, drops its gradients and lowers its loss scale
            req = stage_pb2.StepRequest(
                step=step, global_grad_norm=norm, plan_version=self.plan_version, skip=skip, loss_scale=self.loss_scale
            )
            if want_digest and len(self._replicas(s, routes)) > 1:  # the replicas' weights, compared after
                req.want_digest, req.digest_stride = True, self.verifier.config.digest_stride
                req.digest_seed, req.previous_digest_seed = self.verifier.digest_seeds(step)
            req.trainer_elapsed_s = time.perf_counter() - self._step_started
            return self._call(s, replica, "Step", req)

        keys = [(s, r) for s in range(self.n_stages) for r in self._replicas(s, routes)]
        lrs: dict[tuple[int, int], stage_pb2.StepReply] = {}
        want_digest = self.verifier is not None and self.verifier.config.digests
        digests: dict[tuple[int, int], tuple[str, str]] = {}
        if want_digest:  # the first digested step: the replicas' weights digests before it (`StageVerifier.baseline`)
            self.verifier.baseline(keys)
        for retry in range(2):
            tasks = [self._spawn(lambda k=k: step_stage(*k), (self.replica_peers[k[0]][k[1]],)) for k in keys]
            try:
                outcomes = gather(tasks, wake, self.dead, self.deadline_s, fail_fast=False)
            except Failed:  # gave up on a Step that hangs on a peer that may still answer pings
                outcomes = [f if f.done() else None for f, _ in tasks]
                if not lrs and not any(o is not None and o.exception() is None for o in outcomes):
                    raise  # nobody applied it: the step may run again
                for (_, suspects), outcome in zip(tasks, outcomes, strict=True):
                    if outcome is None:
                        log.warning("step %d: Step hangs on %s: declared dead (applied elsewhere)", step, suspects)
                        self.dead.update(suspects)
            failed = []
            for key, outcome in zip(keys, outcomes, strict=True):
                if outcome is None:
                    continue  # died (or hung) before it answered
                if outcome.exception() is None:
                    lrs[key] = outcome.result()
                    digests[key] = (outcome.result().weights_digest, outcome.result().previous_digest)
                    continue
                peer = self.replica_peers[key[0]][key[1]]
                if not self._alive(peer):
                    self.dead.add(peer)
                elif retry or not reroutable(outcome.exception()):
                    raise outcome.exception()
                else:
                    failed.append(key)
            keys = failed
            if not keys:
                break
        if not lrs:
            raise NoLiveRoute(f"step {step}: every replica died before applying it")
        if want_digest:  # replicas whose weights diverged are evicted (the step is applied: the others' is right)
            self.verifier.check_digests(step, digests)
        # every stage moved the scale alike: a reply that says otherwise is struck, not believed (the scale is named
        # in every next call, and a stage holding another refuses it)
        peers = {k: self.replica_peers[k[0]][k[1]] for k in lrs}
        self.loss_scale, lr = self.suspects.judge_steps(
            step, lrs, peers, self._name, self.loss_scale, skipped=not math.isfinite(norm)
        )
        return lr

    # ---- the step ---------------------------------------------------------------------------------------

    def _live(self, step: int, failure: Failed | None = None) -> list[Route]:
        """The live routes; raises NoLiveRoute naming the stage with no live replica (and the last failure)."""
        live = [self.routes[i] for i in self.live_routes()]
        if live:
            return live

        def gone(s: int, dead_only: bool) -> str:
            at = zip(self.replica_peers[s], self.replica_addresses[s], strict=True)
            return f"stage {s} ({'; '.join(f'peer {p} at {a}' for p, a in at if p in self.dead or not dead_only)})"

        stages = range(self.n_stages)
        lost = [gone(s, False) for s in stages if self.dead.issuperset(self.replica_peers[s])]
        if not lost:  # every route lost a replica, of different stages
            lost = [gone(s, True) for s in stages if self.dead.intersection(self.replica_peers[s])]
        why = f"; last failure: {failure.error}" if failure is not None and failure.error is not None else ""
        raise NoLiveRoute(f"step {step}: no live replica of {', '.join(lost)}{why}", grpc.StatusCode.UNAVAILABLE)

    def _work(self, batch: Batch, routes: list[Route]) -> list[RouteWork]:
        if len(batch.sample_ids) < len(routes):
            # a route without a sample would have no step to reduce and apply: its replicas would fall behind
            raise ValueError(f"a batch of {len(batch.sample_ids)} samples cannot feed {len(routes)} live routes")
        return route_work(batch, routes, self.weights.weights([c.key for c in routes]), self.n_micro)

    def forward_backward(self, step: int, batch: Batch) -> tuple[float, Traffic]:
        """Every micro-batch's forward and backward on the live routes (gradients accumulate on the stages); the
        mean loss and the bytes. No reroute: raises StageCallError naming the stage and peer that failed,
        after abandoning the step."""
        routes = self._live(step)
        wake, self._inflight = threading.Event(), []
        self.router.new_attempt()  # an abandon then refuses its late calls (a Backward start may still be on its way)
        try:
            with self._ping_loop(routes, wake):
                done = self._run_routes(step, self._work(batch, routes), wake)
                gather(self._audits, wake, self.dead, self.deadline_s)
                return done
        except Failed as f:
            self.abandon(step)
            raise as_error(f, step) from f.error

    def train_step(self, step: int, batch: Batch) -> StepResult:
        """One optimizer step on `batch` over the live routes, run again on the survivors when a peer dies.

        Raises:
            NoLiveRoute: a stage has no live replica left (the step is abandoned everywhere).
            StageCallError: a call failed for another reason (plan-mismatch included), or `max_attempts` ran out.
        """
        m, start, before = self.metrics, time.perf_counter(), self.metrics.snapshot()
        self._step_started = start
        dead_before = set(self.dead)
        with self._control_lock:
            self._control, self._all = 0, Traffic()
        loss, traffic = math.nan, Traffic()  # a step skipped before its losses came back has none
        for attempt in range(1, self.max_attempts + 1):
            self.dead.update(self.suspects.banned.keys() & self._peer_set)  # evicted: as good as dead
            routes = self._live(step)
            work = self._work(batch, routes)
            used = [w.route for w in work]
            wake, self._inflight = threading.Event(), []  # calls of earlier attempts are on their own
            self.router.new_attempt()  # a stage told to abandon it refuses its late calls
            norm, lr = math.nan, 0.0
            self._attempt, self._liars_before = attempt, len(self.liars)
            try:
                with self._ping_loop(used, wake):
                    loss, traffic = self._run_routes(step, work, wake, reduce=True)
                    with self._phase("reduce"):
                        traffic.merge(self._reduce(step, used, wake, self._early))
                    with self._phase("grads"):
                        norm = self._grads(step, used, wake)
                        gather(self._audits, wake, self.dead, self.deadline_s)  # a liar found: nothing is applied
                    with self._phase("commit"):
                        self._commit(step, loss, norm, used)
                    with self._phase("step"):
                        lr = self._apply(step, used, norm, wake)
                if math.isfinite(norm):
                    self.suspects.applied(self._stage_sq)
                break
            except (Failed, Implausible) as caught:
                if self._struck(step, caught, attempt):
                    norm, lr = math.nan, 0.0  # skipped: nothing of it was applied anywhere
                    break
        seconds = time.perf_counter() - start
        with self._control_lock:
            control, every = self._control, self._all
        sync_bytes = traffic.direction_bytes("tied")
        for (link, direction), nbytes in traffic.sent.items():
            m.wire_bytes.labels(str(link), direction).inc(nbytes)
        m.fp32_bytes.labels("all", "both").inc(traffic.fp32_wire_bytes)
        m.fp32_bytes.labels("tied", "tied").inc(traffic.tied_fp32_bytes)
        m.sync_bytes.inc(sync_bytes)
        m.control_bytes.inc(control)
        m.steps.inc()
        m.step_seconds.observe(seconds)
        m.loss.set(loss)
        m.plan_version.set(self.plan_version)
        counters = {k: v for k, v in delta(before, m.snapshot()).items() if "_total" in k and v}
        ids = tuple(int(i) for w in work for b in w.micro for i in b.sample_ids.tolist())
        return StepResult(
            loss, norm, lr, traffic, seconds, sync_bytes, counters,
            sample_ids=ids, attempts=attempt, dead_peers=tuple(sorted(self.dead - dead_before)),
            routes=len(used), reduce_bytes=traffic.direction_bytes("average"), control_bytes=control,
            skipped=not math.isfinite(norm), loss_scale=self.loss_scale,
            total_wire_bytes=sum(every.sent.values()) + control,
            fp32_total_wire_bytes=every.fp32_wire_bytes + every.tied_fp32_bytes + control,
        )  # fmt: skip

    def _commit(self, step: int, loss: float, norm: float, routes: list[Route]) -> None:
        """Tells `on_commit` what every Step of `step` will say, before the first one leaves."""
        if self.on_commit is not None:
            peers = tuple(self.replica_peers[s][r] for s in range(self.n_stages) for r in self._replicas(s, routes))
            self.on_commit(StepCommit(step, norm, self.loss_scale, self.plan_version, loss, peers))

    def finish_step(self, commit: StepCommit) -> dict[str, float | Exception]:
        """Sends `commit`'s Step again to each of its peers (a trainer's restart after a kill while the Steps were
        in flight): a stage that applied it answers with its lr and changes nothing, one that still holds the
        step open applies it. Returns each peer's lr, or the error of a peer that refused or did not answer."""
        request = stage_pb2.StepRequest(
            step=commit.step, global_grad_norm=commit.grad_norm, plan_version=commit.plan_version,
            skip=commit.skip, loss_scale=commit.loss_scale,
        )  # fmt: skip
        at = {peer: self._where(peer) for peer in commit.peers if peer in self._peer_set}
        calls = {
            peer: spawn(lambda k=k: self._call(*k, "Step", request), "finish", self._tasks) for peer, k in at.items()
        }
        wait(list(calls.values()), timeout=self.deadline_s + 1)
        out: dict[str, float | Exception] = {
            peer: KeyError(f"peer {peer} is not in this plan") for peer in commit.peers if peer not in at
        }
        for peer, call in calls.items():
            error = call.exception() if call.done() else TimeoutError(f"no reply in {self.deadline_s:.0f} s")
            out[peer] = error if error is not None else call.result().lr
        return out

    def _struck(self, step: int, caught: Failed | Implausible, attempt: int) -> bool:
        """After an attempt failed or a reply's numbers were refused (`Implausible`): a failure nobody's reply
        caused goes to `_recover` (False: run again, or it raises). One a peer's reply caused (`culprit`) is a
        strike for that peer (unless the check that raised it struck it already), and the step is abandoned
        everywhere; True: skip the step; False: the strike evicted the peer, run the step again without it."""
        error = caught.error if isinstance(caught, Failed) else caught
        if isinstance(caught, Failed) and self._lost_labels_race(error):
            # a last stage that does not wait for labels sent beside the pipeline: labels first from now on (a
            # refusal when they went first is judged as any other)
            log.warning("step %d: %s; sending labels before the pipeline from now on", step, error)
            self.labels_with_pipeline = False
            self._recover(step, caught, attempt)
            return False
        if isinstance(caught, Failed):
            self._audit_disproportion(step, caught)  # may evict a liar: then `_out_of` names it
        if isinstance(caught, Failed) and self._out_of(caught):
            self._recover(step, caught, attempt)  # a peer of that call is out: whatever it said, run again
            return False
        # a failed call may blame only a peer of its own route (a liar on it cannot name a stranger's replica)
        named = set(caught.suspects) if isinstance(caught, Failed) and caught.suspects else self._peer_set
        peer = culprit(error, named - self.dead)
        if peer is None and isinstance(caught, Failed):
            self._recover(step, caught, attempt)
            return False
        if peer is not None and not getattr(error, "struck", False):
            self.suspects.strike(peer, step, str(error))
        self._drop(step)
        if peer is None or peer not in self.suspects.banned:
            log.warning("step %d%s skipped (%s)", step, csv_row(step), error)
            return True
        self.dead.add(peer)
        failure = caught if isinstance(caught, Failed) else Failed(caught, (peer,))
        self._live(step, failure)  # raises NoLiveRoute when it was its stage's last replica: the plan must change
        if attempt >= self.max_attempts:
            raise as_error(failure, step, f"gave up after {attempt} attempts")
        log.warning("step %d%s: peer %s evicted; running the step again without it", step, csv_row(step), peer)
        return False

    def _lost_labels_race(self, error: BaseException | None) -> bool:
        """Whether `error` is a last stage's refusal for want of labels that this attempt sent beside the pipeline:
        a stage that does not wait for them, not a fault of anyone's (`labels_with_pipeline`)."""
        return self._labels_raced and labels_missing(error)

    def _recover(self, step: int, failure: Failed, attempt: int) -> None:
        """After a failed attempt: find the dead (one Ping per suspect), abandon the step on every live
        replica so that none keeps gradients from it, and raise unless another attempt may run."""
        error = failure.error
        audited = isinstance(error, LiarFound | AuditDisputed)  # the liar is out (or nobody is): run again
        raced = self._lost_labels_race(error)
        fatal = error is not None and not (reroutable(error) or route_needed(error) or busy(error) or audited or raced)
        if fatal and (out := self._out_of(failure)):
            # e.g. an evicted liar's own Reduce refusing its honest sibling's sum: its step runs again without it
            log.warning("step %d: %s (from a call with %s, declared dead or evicted): running the step again "
                        "without them", step, error, ", ".join(out))  # fmt: skip
            fatal = False
        suspects = [] if fatal else [p for p in dict.fromkeys(failure.suspects) if p not in self.dead]
        for peer, answers in self._answering(suspects).items():
            if not answers:
                log.warning("step %d: peer %s does not answer: declared dead", step, peer)
                self.dead.add(peer)
        self._drop(step)
        if fatal:
            raise as_error(failure, step) from error
        self._live(step, failure)  # raises NoLiveRoute when nothing is left
        if attempt >= self.max_attempts:
            raise as_error(failure, step, f"gave up after {attempt} attempts")
        log.warning(
            "step %d%s: attempt %d failed (%s); running the step again",
            step, csv_row(step), attempt, as_error(failure, step),
        )  # fmt: skip

    def _audit_disproportion(self, step: int, failure: Failed) -> None:
        """Where `failure` is a replica's Reduce refusal of a member's gradients as out of proportion to its own
        (`disproportionate`), audits every micro-batch of this attempt on the routes through the refuser and that
        member (`StageVerifier.audit`), not only the sampled ones, before anyone is struck. Either replica may be
        honest: in the full attacks run a x300 liar upstream of the refuser on its route made the refuser's own
        gradients tiny, its micro-batches were not sampled, and the honest refuser was struck and the step
        skipped, twice. A liar the audits find is evicted (`_evict`): the step then runs again without it and
        nobody is struck (`_out_of`). Where they find none, the refusal is judged as before. Costs, only on such
        a refusal, one audit per micro-batch of those routes (a lying refuser pays for it with its strike)."""
        found = disproportionate(failure.error)
        if found is None or self.verifier is None or self._attempt_work is None:
            return
        stage, refuser, member = found
        work, layout, abandons = self._attempt_work
        if not 0 <= stage < self.n_stages or self._abandons != abandons:
            return  # not this pipeline's stage, or the attempt was abandoned: its records may be gone
        at = {r for r, p in enumerate(self.replica_peers[stage]) if p in (refuser, member)}
        wait([f for f, _ in self._audits], timeout=self.deadline_s)  # the sampled audits first: one may find it
        if len(self.liars) > self._liars_before or not at:
            return
        todo = [
            (w, mb)
            for w in work
            if route_replicas(w.route.index, self.counts)[stage] in at
            for mb in range(len(w.micro))
            if (w.route.index, mb) not in self._audited
        ]
        log.warning("step %d: stage %d (peer %s) refused member %s's gradients as out of proportion: auditing the "
                    "%d micro-batches of their routes not sampled before striking anyone",
                    step, stage, refuser, member, len(todo))  # fmt: skip
        tasks = [self._spawn(lambda w=w, mb=mb: self._audit(step, w, mb, layout, abandons), w.route.peers)
                 for w, mb in todo]  # fmt: skip
        self._audits.extend(tasks)
        self._audited.update((w.route.index, mb) for w, mb in todo)
        wait([f for f, _ in tasks], timeout=self.deadline_s)
        found_liars = [p for p, _ in self.liars[self._liars_before :]]
        log.warning("step %d: the audits of the refused Reduce's routes %s", step,
                    f"evicted {', '.join(found_liars)}" if found_liars else "found no liar")  # fmt: skip

    def _out_of(self, failure: Failed) -> list[str]:
        """The peers that make a failed call no verdict on anyone: those of the call that are out (declared dead or
        evicted), or, where this attempt's own audits evicted a liar, that liar (what it sent poisoned the
        attempt: an honest replica on its route refused its own sibling's sum as 64x its tiny gradients in the
        loaded full run). Waits briefly for the attempt's audits first where neither is known yet: an audit may
        conclude just after the call failed. The step then runs again without them; it never ends the run."""
        if failure.error is None or not failure.suspects:
            return []
        evicted = lambda: [p for p, _ in self.liars[self._liars_before :]]  # noqa: E731
        settled = self.dead.intersection(failure.suspects) or evicted() or reroutable(failure.error)
        if not settled and not busy(failure.error) and self._audits:  # (`_recover` pings a peer that may be dead)
            wait([f for f, _ in self._audits], timeout=ABANDON_GRACE_S)
        return sorted(self.dead.intersection(failure.suspects) | set(evicted()))

    def _drop(self, step: int) -> None:
        """Abandons the step on every live replica so that none keeps gradients from it."""
        # calls among live peers end soon after the abandon; wait for them (briefly), so that none of them opens
        # the step again behind the next attempt's (or, after a fatal error, the next step's) back, then abandon
        # once more
        self.abandon(step)
        live = [f for f, suspects in self._inflight if not self.dead.intersection(suspects)]
        wait(live, timeout=ABANDON_GRACE_S)
        self.abandon(step)

    def abandon(self, step: int) -> None:
        """Best effort: tell every live replica to drop the step's gradients."""
        # a stage that is gone, busy or stuck is skipped: the caller already reports the failure that matters
        self._abandons += 1  # an audit still running concludes nothing from here on
        request = stage_pb2.StepRequest(step=step, abandon=True, attempt_id=self.router.attempt_id)
        calls = [
            spawn(lambda s=s, r=r: self._call(s, r, "Step", request, timeout=5), "abandon", self._tasks)
            for s in range(self.n_stages)
            for r, peer in enumerate(self.replica_peers[s])
            if peer not in self.dead
        ]
        wait(calls, timeout=5)

    def drop_behind(self) -> list[str]:
        """Takes out of the routes, as dead, every replica that applied fewer steps than another replica of its
        stage (their Status `steps_done`; one that does not answer is left to the step). A plan driven afresh
        after a stall re-admits the peers an earlier driver took for dead, and those sat out the steps run without
        them: driven again, their stale weights made every audit a dispute until the run stopped. They copy their
        replicas' state when a newer plan keeps them (`StateHandover.behind`). Returns them."""
        behind: list[str] = []
        for s, peers in enumerate(self.replica_peers):
            done: dict[str, int] = {}
            for r, peer in enumerate(peers):
                if peer in self.dead:
                    continue
                try:
                    done[peer] = int(self._call(s, r, "Status", stage_pb2.Empty(), timeout=10).steps_done)
                except (StageCallError, grpc.RpcError):
                    continue
            top = max(done.values(), default=0)
            behind += [p for p, n in done.items() if n < top]
        self.dead.update(behind)
        return behind

    def status(self) -> list[stage_pb2.StatusReply]:
        """Route 0's stages' status."""
        return [self._call(s, 0, "Status", stage_pb2.Empty(), timeout=10) for s in range(self.n_stages)]

    def check_model(self, identity: str, label: str = "") -> list[list[stage_pb2.StatusReply | None]]:
        """Refuses (`ModelMismatch`, naming both models and the stage's peer) unless every replica that answers
        Status serves a slice of the model whose `model_identity` is `identity` (`label` says which model that
        is). A replica that does not answer is left to the step's own failure handling. Returns the replies,
        `[stage][replica]` (None: no answer), for what else the trainer reads from them (its frozen prefix)."""
        from swarm.runtime.modelcheck import check_status

        replies: list[list[stage_pb2.StatusReply | None]] = []
        for s in range(self.n_stages):
            replies.append([])
            for r, peer in enumerate(self.replica_peers[s]):
                try:
                    reply = self._call(s, r, "Status", stage_pb2.Empty(), timeout=10)
                except (StageCallError, grpc.RpcError):
                    replies[s].append(None)
                    continue
                check_status(reply, identity, label, f"stage {s} (peer {peer} at {self.replica_addresses[s][r]})")
                replies[s].append(reply)
        return replies

    def evaluate(self, data: SampleSet, rows: int, step: int, hidden: int) -> HeldOutLoss:
        """The held-out loss of the weights the stages hold before step `step`, on `data` through the first live
        route (`swarm.runtime.heldout`: forward only, no state of a step touched). Raises NoLiveRoute without
        one, StageCallError or WireError as `held_out_loss` does."""
        live = self.live_routes()
        if not live:
            raise NoLiveRoute("no live route to evaluate on")
        at = route_replicas(live[0], self.counts)
        return held_out_loss(self._call, at, data, rows, step, self.plan_version, hidden, self.deadline_s)

    def replica_status(self, timeout_s: float = 10.0) -> list[list[stage_pb2.StatusReply | None]]:
        """Every replica's status, `[stage][replica]`, all asked at once, each within `timeout_s` (hung peers cost the
        whole about `timeout_s`, not that once per replica); None for a dead peer. Raises the first failed call's
        error, in stage and replica order."""
        asked = [
            [
                None
                if p in self.dead
                else spawn(
                    lambda s=s, r=r: self._call(s, r, "Status", stage_pb2.Empty(), timeout=timeout_s),
                    "status", self._tasks,
                )
                for r, p in enumerate(self.replica_peers[s])
            ]
            for s in range(self.n_stages)
        ]  # fmt: skip
        return [[None if f is None else f.result(timeout=timeout_s + CLOSE_WAIT_S) for f in row] for row in asked]

    def close(self) -> None:
        """Closes the connector and waits a moment for the calls still running (closed, they end at once); stuck
        ones run out on their deadline."""
        self.connector.close()
        wait(list(self._tasks), timeout=CLOSE_WAIT_S)


def csv_row(step: int) -> str:
    """What a retry message adds to a step's number: the stages and the wire count steps from 0, steps.csv's
    `step` column counts applied steps from 1, so step 13 is steps.csv's row 14."""
    return f" (steps.csv step {step + 1})"


REDUCE_DEADLINE_S = 30.0
"""longest a replica waits for the other replicas' gradients in `Reduce`"""
ABANDON_GRACE_S = 5.0
"""longest the driver waits for a failed attempt's calls among live peers to end before the next attempt"""
CLOSE_WAIT_S = 2.0


class _CountedStream:
    """A server stream whose items' bytes are counted as they are pulled; `cancel` ends the call."""

    def __init__(self, call, count: Callable[[int], None]):
        self._call, self._count = call, count

    def __iter__(self):
        for item in self._call:
            self._count(item.ByteSize())
            yield item

    def cancel(self) -> None:
        for end in (getattr(self._call, "cancel", None), getattr(self._call, "close", None)):
            if end is not None:
                end()
