"""The stage service: thin gRPC handlers that read and check a call, then hand it to the stage host.

The same servicer answers gRPC calls from other peers and in-process calls through `LocalNetwork`. It also
owns what outlives one host: the swap to another host between two steps when the plan changes, and the
previous host kept for handing its state over.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from typing import TYPE_CHECKING

import grpc

from swarm import trace
from swarm.compression import BufferMissError, CodecConfig, WireError, WireLimits, frame, make_codec
from swarm.compression.framing import DEFAULT_CHUNK_BYTES
from swarm.metrics import STATE_SENT_LOG
from swarm.net.stream import (
    BUFFER_MISS,
    PLAN_MISMATCH,
    CallRefused,
    StageCallError,
    StreamTimeout,
    name_failure,
    read_stream,
)
from swarm.peers.shaper import paced, paced_chunk_bytes
from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.runtime.audit_wire import (
    audit_inputs_reply,
    audit_reply,
    fetched_sketch,
    fill_fetched,
    pack_reply,
    recompute_inputs,
    recompute_reply,
    unpack_reply,
)
from swarm.runtime.budget import CallerSlots, CallSlots, SlotsExhausted, StageBudget
from swarm.runtime.callinfo import fill_route, info_from_wire, plan_gives_route
from swarm.runtime.checkpoint import handover_tensors
from swarm.runtime.gate import GateError
from swarm.runtime.host import StageHost
from swarm.runtime.messages import CallInfo, ReduceOrder, StageCall, StepOrder, from_wire
from swarm.runtime.policy import CallPolicy, Roster, bind_calls
from swarm.runtime.routing import REROUTE_CODES
from swarm.runtime.schedules import Kind

if TYPE_CHECKING:
    from swarm.net.auth import CallVerifier

__all__ = [
    "StageServicer",
    "audit_reply",
    "recompute_inputs",
    "recompute_reply",
    "reduce_order",
    "named_state_items",
    "step_order",
]

log = logging.getLogger("swarm.runtime.service")


EXPECTED_FAILURES = (grpc.RpcError, CallRefused, BufferMissError, WireError, GateError, SlotsExhausted, StageCallError,
                     ValueError)  # fmt: skip
"""What ends a call with a status and no traceback (`StageServicer._status`); ValueError: e.g. NaN to encode."""

HEARD_MAX = 1024
"""Callers whose last call time `StageServicer.heard` keeps: a stranger minting keys fills it at most this far,
after which new callers go unrecorded (the planner then judges them by pings alone, as before)."""
EARLY_REDUCES = 2
"""Most Reduces a stage holds at once while they wait for their step's last backward (`StageHost.await_backwards`);
more are refused with RESOURCE_EXHAUSTED."""
REDUCE_SLOT_WAIT_S = 10.0
"""Longest a Reduce waits for the one Reduce slot (held by a failed attempt's Reduce that is ending) before it
is refused with RESOURCE_EXHAUSTED."""


class StageServicer(stage_pb2_grpc.StageServicer):
    """Thin gRPC handlers: read and check the call, run the host's compute, pass the result on."""

    def __init__(
        self,
        host: StageHost | None,
        verifier: CallVerifier | None = None,
        roster: Roster | None = None,
        budget: StageBudget | None = None,
    ):
        self.host = host
        self.verifier = verifier
        """Establishes each call's caller; None: calls are anonymous and nothing is authorized (measurement)."""
        self.policy = CallPolicy(roster)
        self.roster_source: Callable[[], Roster | None] | None = None
        """Where a stage without a roster may find one (an even split's announcements); None: wait for set_roster."""
        self._next_roster_fetch = 0.0
        self._roster_fetch = threading.Lock()
        self.budget = budget or (host.budget if host is not None else StageBudget())
        self._data_slots = CallerSlots(
            self.budget.data_calls, "data", self.budget.caller_cap, self.budget.reserved_data_calls
        )
        """Data calls held at once, and by one caller: past it they are refused at once, so control calls always
        find a thread and the plan's peers a data slot (`_named_senders`)."""
        self._named: tuple[object, int, frozenset[str]] = (None, -1, frozenset())
        """(roster, stage, the plan peers it names as this stage's data senders), cached per roster and stage"""
        self._calling = threading.local()
        """The caller of the call this thread serves (for the one line a cancelled or stalled call logs)."""
        self.heard: dict[str, float] = {}
        """peer id -> when (`time.monotonic`) an authenticated call of it last arrived: proof of life that the
        planner's heartbeats take where a ping's answer waits behind a saturated link (`heard_from`)."""
        self._large_slots = CallerSlots(
            self.budget.large_streams, "large stream", self.budget.caller_large_streams, reserved=1
        )
        """Messages over `large_stream_bytes` read at once: what a flood of big streams may hold in memory; one
        caller holds at most half, and each plan sender finds one."""
        self._state_slots = CallerSlots(self.budget.state_calls, "GetState", self.budget.caller_state_calls)
        """GetState streams sent at once, and to one caller: each holds a copy of the stage's state."""
        self._probe_slots = CallSlots(self.budget.probe_calls, "link probe")
        self.held_state: Callable[[grpc.ServicerContext, int], object] | None = None
        """Serves GetState for a held checkpoint copy (swarm.daemon.held) when the call asks for one: an
        iterator of items, or None for the served stage's state."""
        self._recompute_slots = CallSlots(1, "Recompute")
        """One audit recomputation at a time: a trainer's audits never hold more than one thread's compute."""
        self._reduce_slots = CallSlots(1, "Reduce")
        """One Reduce waits for its peers' gradients at a time: the other threads stay free for Step and Status."""
        self._early_reduces = CallSlots(EARLY_REDUCES, "Reduce waiting for its step's backwards")
        """Reduces sent with the pipeline that wait for the step's last backward (an attempt's, and a rerun's while
        the abandoned one's ends): no caller parks more of the server's threads that way."""
        self.state_sent: Callable[[int], None] = lambda nbytes: None
        """Told the bytes of every GetState stream this servicer sent, whole or cut short (the peer's
        `swarm_state_bytes_total`): copies and takeovers are bytes the run puts on the network too."""
        self.previous: StageHost | None = None
        """The host this peer served before its last plan change, kept to hand its state over."""
        self.standby_version: int | None = None
        """The plan that left this peer without a stage, if one did: calls meant for its old stage are
        refused as from another plan, so the trainer moves on to the new plan instead of failing."""
        self.on_newer_plan: Callable[[int], None] = lambda version: None
        """Told the plan version of a call that follows a plan newer than this stage's (before it is refused as of
        another plan): the daemon then reads the DHT for it at once instead of at its next look."""
        self._admission = threading.Condition()
        bind_calls(self)  # each call's proof must sign that call (swarm.net.auth, swarm.runtime.policy)

    def _not_serving(self) -> CallRefused:
        if self.standby_version is not None:
            return CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} this peer is on standby under plan {self.standby_version}",
            )
        return CallRefused(grpc.StatusCode.UNAVAILABLE, "this peer is not serving a stage yet")

    def _serving(self) -> StageHost:
        host = self.host
        if host is None:
            raise self._not_serving()
        return host

    def _limits(self) -> WireLimits:
        host = self.host
        return host.limits if host is not None else WireLimits()

    # ---- authentication and authorization (swarm.net.auth, swarm.runtime.policy) ----------------------------

    def set_roster(self, roster: Roster | None) -> None:
        """The plan's peers, whose calls this stage serves from now on."""
        self.policy = CallPolicy(roster)

    def _caller(self, context: grpc.ServicerContext) -> str | None:
        """The calling peer's id from the call's token (None with authentication off); reads only metadata."""
        self._calling.caller = None
        if self.verifier is None:
            return None
        from swarm.net.auth import AuthError

        try:
            caller = self.verifier.caller(context.invocation_metadata())
        except AuthError as e:
            raise CallRefused(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {e}") from None
        self._calling.caller = caller
        if caller in self.heard or len(self.heard) < HEARD_MAX:  # bounded: any key can authenticate
            self.heard[caller] = time.monotonic()
        self._fetch_roster()
        return caller

    def heard_from(self, peer_id: str) -> float | None:
        """When `peer_id`'s last authenticated call arrived (`time.monotonic`), None if never."""
        return self.heard.get(peer_id)

    def _fetch_roster(self) -> None:
        """Without a roster yet, asks `roster_source` for one (at most once a second; concurrent calls wait for
        the one fetch): a stage of an even split learns its neighbours as they announce, and a trainer may call
        before the periodic refresh ran."""
        if self.policy.roster is not None or self.roster_source is None:
            return
        with self._roster_fetch:
            now = time.monotonic()
            if self.policy.roster is not None or now < self._next_roster_fetch:
                return
            self._next_roster_fetch = now + 1.0
            roster = self.roster_source()
            if roster is not None and self.policy.roster is None:
                self.set_roster(roster)

    def _sender(self, context: grpc.ServicerContext, method: str) -> str | None:
        """Authenticates a data call and checks its caller may send it to this stage, before its body is read."""
        caller = self._caller(context)
        if caller is not None:
            self.policy.check_sender(method, self._serving().role.stage, caller)
        return caller

    def _checked(self, context: grpc.ServicerContext, check) -> None:
        """Authenticates a call outside `_guard` and runs `check(caller)`; aborts the call if either refuses."""
        try:
            caller = self._caller(context)
            if caller is not None and check is not None:
                check(caller)
        except CallRefused as e:
            context.abort(e.code, e.details)

    # ---- admission ------------------------------------------------------------------------------------------

    def _named_senders(self) -> frozenset[str]:
        """The plan peers that may send this stage data calls: its neighbouring stages' replicas, its own other
        replicas (Average), and the named trainers at an end stage. Each finds `reserved_data_calls` slots."""
        roster, host = self.policy.roster, self.host
        if roster is None or host is None:
            return frozenset()
        stage = host.role.stage
        cached_roster, cached_stage, named = self._named
        if cached_roster is roster and cached_stage == stage:
            return named
        last = roster.n_stages - 1
        peers: set[str] = set()
        for s in (stage - 1, stage, stage + 1):
            if 0 <= s <= last:
                peers.update(roster.replicas(s))
        if stage in (0, last) and roster.trainers is not None:
            peers.update(roster.trainers)
        peers.discard(host.peer_id)
        named = frozenset(peers)
        self._named = (roster, stage, named)
        return named

    def _data_slot(self, caller: str | None):
        """One data slot for `caller` (`CallerSlots`): SlotsExhausted past the total, its share, or the reserve."""
        return self._data_slots.take(caller, self._named_senders())

    def _large_slot(self, caller: str | None):
        """One large-stream slot for `caller`, waited for at most `max_wait_s` (its share, the plan senders'
        reserve and the total, as `_data_slot`)."""
        return self._large_slots.take(caller, self._named_senders(), wait_s=self.budget.max_wait_s)

    def _read(self, request_iterator, context, limits: WireLimits, **hooks):
        """`read_stream` under the budget's read deadlines: a stalled stream is cancelled (StreamTimeout)."""
        cancel = getattr(context, "cancel", None)  # in-process calls (LocalNetwork) cannot stall
        return read_stream(request_iterator, limits, timeouts=self.budget.read_timeouts(), cancel=cancel, **hooks)

    def _check_info(
        self, wire: stage_pb2.CallInfo, caller: str | None, method: str | None = None
    ) -> tuple[StageHost, CallInfo]:
        """Checks what a call's info alone decides: the host's rules, then the plan's route. Changes nothing.
        Returns the host and the info as the host takes it (a route-less call's route from the plan)."""
        host = self._serving()
        if wire.plan_version > host.role.plan_version:  # a caller already on a newer plan: this peer is behind
            self.on_newer_plan(wire.plan_version)
        info = fill_route(info_from_wire(wire), self.policy.roster, host.role, host.peer_id)
        # first: a call of another plan is told so, and the trainer moves on; a last stage's Forward may come
        # before the labels that close the open step (admission decides that, after them)
        host.check_call(info, caller, other_step=method == "Forward" and host.role.is_last)
        if caller is not None:
            self.policy.check_route(info, caller, method, host.peer_id)
        return host, info

    def _admit(
        self, info: CallInfo, call: StageCall | None, kind: Kind | None, caller: str | None, method: str | None = None
    ) -> StageHost:
        """Checks a whole call against the plan and the current host and opens its step there, atomically
        with `swap`. The caller must `leave()` the returned host when the call is answered."""
        with self._admission:
            host = self._serving()
            host.admit(call, info, kind, caller, self._route_check(host, caller, method))
            return host

    def _route_check(self, host: StageHost, caller: str | None, method: str | None):
        """The plan's route rule for an authenticated caller's call (None for an anonymous one)."""
        policy = self.policy
        return None if caller is None else lambda info: policy.check_route(info, caller, method, host.peer_id)

    def _await_labels(self, call: StageCall, caller: str | None, method: str, gone: threading.Event) -> None:
        """`StageHost.await_labels` under `_admit`'s checks (a call they refuse is refused before any wait)."""
        host = self._serving()
        host.await_labels(call, caller, self._route_check(host, caller, method), gone)

    def _stream_call(self, request_iterator, context, kind: Kind):
        """Forward or Backward: the call info is checked before the rest of the stream is read, the whole call
        before anything is decoded."""

        method = "Forward" if kind == Kind.FORWARD else "Backward"

        def run():
            caller = self._sender(context, method)
            gone = self._watch_caller(context)
            with self._data_slot(caller), contextlib.ExitStack() as reading:

                def on_header(header) -> None:  # a large message is read and decoded in a slot of its own
                    if header.body_bytes > self.budget.large_stream_bytes:
                        reading.enter_context(self._large_slot(caller))

                infos = []  # the call's info as the host takes it
                carried = []  # whether the call came with its route (before `fill_route` gives it one)

                def on_info(wire: stage_pb2.CallInfo) -> None:
                    carried.append(len(wire.route) > 0)
                    infos.append(self._check_info(wire, caller, method)[1])

                with trace.span(f"read {method}", "serve"):
                    read = self._read(request_iterator, context, self._limits(), on_info=on_info, on_header=on_header)
                call = StageCall(infos[0], read.message, read.tokens)
                if kind == Kind.FORWARD:  # a last stage's Forward may come before its labels (sent beside it)
                    self._await_labels(call, caller, method, gone)
                host = self._admit(call.info, call, kind, caller, method)
                fresh = host.fresh_ids(call, kind)  # first sights this call buffers: given back if it never runs
                try:
                    inputs = host.decode(call, kind)
                    reading.close()  # decoded: the slot is free before the call waits for its turn
                    forward = kind == Kind.FORWARD
                    try:
                        reply = host.forward(call, inputs, gone) if forward else host.backward(call, inputs, gone)
                    except GateError:  # its turn never came: it ran nothing
                        host.release_fresh(call, kind, fresh)
                        raise
                    # this stage's own answer (a Forward's reply may be the next stage's, which said its own)
                    reply.plan_route = carried[0] and plan_gives_route(
                        call.info, self.policy.roster, host.role, host.peer_id
                    )
                    return reply
                finally:
                    host.leave()

        with trace.span(f"serve {method}", "serve"):
            return self._guard(context, run)

    def _watch_caller(self, context: grpc.ServicerContext, host: StageHost | None = None) -> threading.Event:
        """Set once the call ends on the caller's side (it cancelled or passed its deadline), with every call
        waiting at the gate of `host` (default: the one serving then) woken to notice: a wait for the caller's turn
        stops waiting for it."""
        gone = threading.Event()

        def on_end() -> None:
            gone.set()
            serving = host if host is not None else self.host
            if serving is not None:
                serving.gate.wake()

        context.add_callback(on_end)
        return gone

    def when_idle(self, change, timeout_s: float) -> bool:
        """Runs `change(servicer)` between two steps, never while a step is open on this stage.

        Calls are admitted under the same lock, so no step can straddle the change: a call that arrives
        after it meets the new plan version and is refused, and the trainer retries the step on the new
        plan. Returns False if the open step was abandoned instead: it stayed open for `timeout_s`, or it is
        orphaned (no call in flight and none for `budget.orphan_step_s`: its trainer is gone, or a stage of
        the old plan died mid-step). The change is then made anyway.
        """
        deadline = time.monotonic() + timeout_s
        with self._admission:
            while not (idle := self.host is None or self.host.open_step is None):
                if time.monotonic() >= deadline or self.host.ledger.orphaned(self.budget.orphan_step_s):
                    break
                self._admission.wait(min(0.5, max(0.0, deadline - time.monotonic())))  # step ends notify it
            if not idle:
                log.warning("stage %d: abandoning unfinished step %s", self.host.role.stage, self.host.open_step)
                self.host.step(StepOrder(step=self.host.open_step or 0, abandon=True))
            change(self)
            self._admission.notify_all()
        return idle

    def swap(
        self, host: StageHost | None, timeout_s: float, plan_version: int = 0, roster: Roster | None = None
    ) -> bool:
        """Serves `host` (None: standby under `plan_version`) from the next step on, keeping the current
        one for state handover; `roster` (the new plan's peers) takes effect at the same moment."""

        def change(servicer: StageServicer) -> None:
            if servicer.host is not None:
                servicer.host.close()
                servicer.previous = servicer.host
            servicer.host = host
            servicer.standby_version = plan_version if host is None else None
            if roster is not None:
                servicer.set_roster(roster)

        return self.when_idle(change, timeout_s)

    def _guard(self, context: grpc.ServicerContext, fn):
        """Runs `fn`, turning every failure into a gRPC error that names the problem; the peer keeps serving.

        A stream its caller cancelled, or that stalled past its read deadline (and was cancelled here), costs one
        log line naming the caller (INFO, WARNING): never a traceback, which any caller could otherwise write."""
        host = self.host
        if host is None:
            refused = self._not_serving()
            context.abort(refused.code, refused.details)
        self._calling.caller = None
        try:
            return fn()
        except StreamTimeout as e:
            log.warning("stage %d: cancelled a stream from %s: %s", host.role.stage, self._who(context), e)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"stage {host.role.stage}: {e}")
        except EXPECTED_FAILURES as e:
            if not getattr(context, "is_active", lambda: True)():
                # the caller cancelled: its stream's read then fails, ends short, or ends whole (gRPC may close a
                # cancelled stream as if its caller had), and the call fails wherever it noticed
                log.info("stage %d: the call from %s was cancelled by its caller", host.role.stage, self._who(context))
                if isinstance(e, grpc.RpcError):
                    raise  # gRPC knows this error as its own: the call is over, nothing more is logged
            elif isinstance(e, grpc.RpcError):  # a call of ours failed: not the caller's doing
                code = e.code() if callable(getattr(e, "code", None)) else None
                if code in REROUTE_CODES:  # a neighbour died or is unreachable: expected churn, one line
                    log.warning("stage %d: a call to a neighbour failed (%s): %s", host.role.stage, code.name,
                                e.details() if callable(getattr(e, "details", None)) else e)  # fmt: skip
                else:
                    log.exception("stage %d: unexpected failure", host.role.stage)
            context.abort(*self._status(e, host, context))
        except Exception as e:
            log.exception("stage %d: unexpected failure", host.role.stage)
            stage = f"stage {host.role.stage} (peer {host.peer_id})"
            context.abort(grpc.StatusCode.INTERNAL, f"{stage} failed: {type(e).__name__}: {e}")

    def _status(self, e: Exception, host: StageHost, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str]:
        """The status and details an expected failure ends its call with."""
        if isinstance(e, grpc.RpcError):
            return grpc.StatusCode.INTERNAL, f"stage {host.role.stage} failed: {type(e).__name__}: {e}"
        if isinstance(e, (CallRefused, StageCallError)):
            return e.code, (e.details if isinstance(e, CallRefused) else str(e))
        if isinstance(e, BufferMissError):
            return grpc.StatusCode.FAILED_PRECONDITION, f"{BUFFER_MISS} {e}"
        if isinstance(e, WireError):  # the sender named: a neighbour's bad message reaches the trainer this way
            return grpc.StatusCode.INVALID_ARGUMENT, f"invalid message from {self._who(context)}: {e}"
        if isinstance(e, GateError):
            return grpc.StatusCode.ABORTED, f"schedule: {e}"
        if isinstance(e, SlotsExhausted):
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        return grpc.StatusCode.INVALID_ARGUMENT, f"stage {host.role.stage} (peer {host.peer_id}): {e}"  # ValueError

    def _who(self, context: grpc.ServicerContext) -> str:
        """The caller of this thread's call: its peer id if authenticated, else its address."""
        caller = self._calling.__dict__.get("caller")
        if caller is not None:
            return f"peer {caller}"
        return f"{getattr(context, 'peer', lambda: 'an unknown caller')()} (not authenticated)"

    def Forward(self, request_iterator, context):
        return self._stream_call(request_iterator, context, Kind.FORWARD)

    def Backward(self, request_iterator, context):
        return self._stream_call(request_iterator, context, Kind.BACKWARD)

    def ForwardItem(self, request, context):  # a Forward of one item, unary (`swarm.net.stream.ONE_ITEM`)
        return self._stream_call(iter((request,)), context, Kind.FORWARD)

    def BackwardItem(self, request, context):
        return self._stream_call(iter((request,)), context, Kind.BACKWARD)

    def PutLabels(self, request, context):
        def run():
            caller = self._sender(context, "PutLabels")
            with self._data_slot(caller):
                host, info = self._check_info(request.info, caller)
                targets = host.check_labels(info, request.labels, request.micro_rows)
                host = self._admit(info, None, None, caller)
                try:
                    host.put_labels(info, targets)
                finally:
                    host.leave()
            return stage_pb2.Empty()

        return self._guard(context, run)

    def Grads(self, request, context):
        self._checked(context, lambda caller: self.policy.check_step("Grads", caller))
        return self._guard(context, lambda: stage_pb2.GradReply(**asdict(self._serving().grads())))

    def Step(self, request, context):
        self._checked(context, lambda caller: self.policy.check_step("Step", caller))

        def run():
            host = self._serving()
            order = step_order(request)
            lr = host.step(order)
            with self._admission:
                self._admission.notify_all()  # a plan change may be waiting for the step to end
            skipped = order.skip and not order.abandon
            reply = stage_pb2.StepReply(step=order.step, lr=lr, loss_scale=host.worker.loss_scale, skipped=skipped)
            if order.want_digest and not order.abandon:  # the trainer compares replicas (swarm.runtime.verify)
                reply.weights_digest = host.sampled_digest(order.digest_stride, order.digest_seed)
                if order.previous_digest_seed:
                    reply.previous_digest = host.sampled_digest(order.digest_stride, order.previous_digest_seed)
            return reply

        return self._guard(context, run)

    def Reduce(self, request, context):
        order = reduce_order(request)

        def check(caller: str) -> None:
            self.policy.check_step("Reduce", caller)
            self.policy.check_group(order, self._serving().peer_id)

        self._checked(context, check)

        def run():
            host = self._serving()
            # sent with the pipeline: the sums start as this stage's last backward ends (no trip to the trainer
            # first); a Reduce after the pipeline finds the step's work done and goes on at once
            gone = self._watch_caller(context, host)
            # at most the Reduce's own deadline: a pipeline longer than that is refused (`EARLY_REDUCE`), and its
            # trainer sends its Reduces after the pipeline from then on
            left = context.time_remaining()  # None in process (`LocalNetwork`): no deadline there
            wait_s = min(self.budget.max_wait_s, order.deadline_s or math.inf, math.inf if left is None else left)
            with self._early_reduces.take():
                host.await_backwards(order.step, order.attempt_id, wait_s, gone)
            # a failed attempt's Reduce may still be ending (it waits on peers that the abandon releases): the
            # rerun's waits for it a while instead of failing the step (only the plan's trainer may call Reduce)
            with self._reduce_slots.take(wait_s=REDUCE_SLOT_WAIT_S):
                report = host.averager.reduce(order, keyed_by_peer=self.verifier is not None)
            # the gradients after the sums, as Grads would report them next: one round trip fewer a step
            return stage_pb2.ReduceReply(**asdict(report), grads=stage_pb2.GradReply(**asdict(host.grads())))

        return self._guard(context, run)

    def Average(self, request_iterator, context):
        """Another replica's gradients for the open step: authorized from the metadata, checked from the call
        info, before the body is read; held until this stage's own Reduce sums them."""

        def run():
            caller = self._caller(context)
            host = self._serving()
            if caller is not None:  # from the metadata: a replica of this stage, or of the tied group
                self.policy.check_average(host.role.stage, caller, host.peer_id, tied=None)
            sender: list[str] = []
            infos: list[CallInfo] = []

            def on_info(wire: stage_pb2.CallInfo) -> None:
                info = info_from_wire(wire)
                infos.append(info)
                if caller is not None:  # the call info says which sum: hold the caller to that one's members
                    self.policy.check_average(host.role.stage, caller, host.peer_id, tied=info.tied)
                sender.append(caller if caller is not None else f"#{info.micro_batch}")
                host.averager.check_average(info, sender[0])

            with self._data_slot(caller), contextlib.ExitStack() as reading:

                def on_header(header) -> None:
                    if header.body_bytes > self.budget.large_stream_bytes:
                        reading.enter_context(self._large_slot(caller))

                read = self._read(request_iterator, context, host.averager.limits, on_info=on_info, on_header=on_header)
                host.averager.receive(StageCall(infos[0], read.message), sender[0])
            return stage_pb2.Traffic(wire_bytes=read.wire_bytes)

        return self._guard(context, run)

    def Audit(self, request, context):
        """The open step's record of one micro-batch, for a trainer's audit (`swarm.runtime.verify`)."""
        self._checked(context, lambda caller: self.policy.check_step("Audit", caller))

        def run():
            host = self._serving()
            record = host.audit_record(request.step, request.plan_version, request.stage, request.micro_batch)
            role, q = host.role, request
            return audit_reply(
                record, role.is_first, role.is_last, q.backward, q.compact, q.sketch_seed, q.sketch_size, q.direct
            )

        return self._guard(context, run)

    def Recompute(self, request, context):
        """A sibling's micro-batch recomputed with this replica's weights, for a trainer's audit: one at a time."""
        self._checked(context, lambda caller: self.policy.check_step("Recompute", caller))

        def run():
            host = self._serving()
            fetched = self._fetch_audit_inputs(request, host) if request.fetch_peer else 0
            inputs, targets, grad = recompute_inputs(request, host)
            host.check_recompute(inputs, targets, grad)
            with self._recompute_slots.take(wait_s=self.budget.max_wait_s):
                done = host.recompute(request.step, request.plan_version, request.stage, inputs, targets, grad)
            reply = recompute_reply(
                done, request.compact, request.sketch_seed, request.sketch_size, request.sketch_digests_only
            )
            if request.fetch_peer:  # what it recomputed from, for the trainer to hold against the stage's sketches
                reply.fetched_bytes = fetched
                if request.input_digest:
                    reply.input_sketch_digest = fetched_sketch(inputs, request)
                if request.grad_digest and grad is not None:
                    reply.grad_sketch_digest = fetched_sketch(grad, request)
            return reply

        return self._guard(context, run)

    def _fetch_audit_inputs(self, request, host: StageHost) -> int:
        """A direct Recompute's input and gradient, fetched from the audited replica the request names (at the
        address this stage's roster gives it, never one the trainer writes) into `request`, checked against the
        digests that replica committed to; the fetch's bytes. A failed or mismatched fetch ends the Recompute
        ABORTED: the trainer asks again through itself, in fp32."""
        roster, stage, peer = self.policy.roster, host.role.stage, request.fetch_peer
        replicas = roster.replicas(stage) if roster is not None and stage < roster.n_stages else ()
        if not request.sketch_size:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "a direct Recompute names a sketch_size")
        if request.stage != stage or peer == host.peer_id or peer not in replicas:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"fetch_peer {peer} is not another replica of stage {stage}"
            )
        address = roster.replica_addresses(stage)[replicas.index(peer)]
        ask = stage_pb2.AuditRequest(
            step=request.step, plan_version=request.plan_version, stage=stage, micro_batch=request.micro_batch,
            backward=bool(request.grad_digest), compact=True,
        )  # fmt: skip
        try:
            fetched = host.outbox.connector.stage(address, peer).AuditInputs(ask, timeout=self.budget.max_wait_s)
        except grpc.RpcError as e:
            why = name_failure(e, stage, peer, address)
            raise CallRefused(grpc.StatusCode.ABORTED, f"fetching the audit inputs failed: {why}") from None
        try:
            inner = unpack_reply(fetched, host.limits)
        except WireError as e:
            raise CallRefused(grpc.StatusCode.ABORTED, f"the audit inputs from {peer}: {e}") from None
        if why := fill_fetched(request, inner, host.limits):
            raise CallRefused(grpc.StatusCode.ABORTED, f"the audit inputs from {peer}: {why}")
        return ask.ByteSize() + fetched.ByteSize()

    def AuditInputs(self, request, context):
        """A direct audit's record inputs (`audit_wire.audit_inputs_reply`), for the sibling recomputing them."""

        def check(caller: str) -> None:
            self.policy.check_audit_inputs(request.stage, caller, self._serving().peer_id)

        self._checked(context, check)
        caller = self._calling.__dict__.get("caller")

        def run():
            host = self._serving()
            with self._data_slot(caller):
                record = host.audit_record(request.step, request.plan_version, request.stage, request.micro_batch)
                return pack_reply(audit_inputs_reply(record, host.role.is_last, request.backward))

        return self._guard(context, run)

    def Probe(self, request, context):  # answered before a stage is assigned too: links are measured early
        self._checked(context, None)
        cap = self.budget.max_probe_reply_bytes
        if request.reply_bytes > cap:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reply_bytes: {request.reply_bytes} exceeds {cap}")
        return stage_pb2.ProbeReply(payload=bytes(request.reply_bytes))

    def Sink(self, request_iterator, context):  # no stage needed: links are measured before assignment
        self._checked(context, None)
        try:
            with self._probe_slots.take():
                call = self._read(request_iterator, context, self.budget.sink_limits())
        except SlotsExhausted as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except CallRefused as e:  # the first item's proof (bind_calls)
            context.abort(e.code, e.details)
        except StreamTimeout as e:  # a stalled probe gives its slot back like a stalled data stream
            log.warning("cancelled a link probe from %s: %s", self._who(context), e)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid message: {e}")
        return stage_pb2.Traffic(wire_bytes=call.wire_bytes)

    def Status(self, request, context):
        self._checked(context, None)
        return self._guard(context, lambda: stage_pb2.StatusReply(**asdict(self._serving().status())))

    def Ping(self, request, context):
        """Liveness only: what Status answers (any authenticated caller; not serving a stage fails alike),
        without its reply's bytes (the metrics map and digest: ~1.4 KB a heartbeat in the trainer's control bytes).
        A ping that says a newer plan (the planner's heartbeat, `PingRequest.newest_plan`) tells `on_newer_plan`,
        as a call on a newer plan does; standbys too."""
        self._checked(context, None)
        if request.newest_plan:
            self.on_newer_plan(request.newest_plan)

        def run() -> stage_pb2.Empty:
            self._serving()
            return stage_pb2.Empty()

        return self._guard(context, run)

    def GetState(self, request, context):
        self._checked(context, lambda caller: self.policy.check_state(caller))
        caller = self._calling.__dict__.get("caller")
        rate = request.max_bytes_per_s
        if not (math.isfinite(rate) and rate >= 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_bytes_per_s: {rate} is not a rate")
        chunk_bytes = paced_chunk_bytes(rate, DEFAULT_CHUNK_BYTES) if rate else DEFAULT_CHUNK_BYTES
        items = self._state_items(request, context, caller, chunk_bytes)
        sent = 0
        try:
            for item in paced(items, rate) if rate else items:
                sent += item.ByteSize()
                yield item
        finally:
            if sent:
                self.state_sent(sent)
                log.info("%s %d bytes (stage %d) to %s", STATE_SENT_LOG, sent, request.stage, caller or "a caller")

    def _state_items(self, request, context, caller: str | None, chunk_bytes: int):
        """GetState's items (a held copy's, or the stage's under the request's plan), in chunks of `chunk_bytes`."""
        with contextlib.ExitStack() as held:  # the slots are held until the last item is sent
            try:  # a state slot (per caller: each holds a copy of the state), then a data slot
                held.enter_context(self._state_slots.take(caller, wait_s=self.budget.state_wait_s))
                held.enter_context(self._data_slot(caller))
            except SlotsExhausted as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            if self.held_state is not None and (copy := self.held_state(context, chunk_bytes)) is not None:
                yield from copy
                return
            previous = self.previous
            if previous is not None and self.host is not None and _same_place(previous, self.host):
                # replaced in place (it fell behind, or only its codecs changed): the current host holds its layers
                # at least as fresh; serving it as its plan's state handed a taker weights steps older than the stage's
                previous = None
            hosts = [h for h in (self.host, previous) if h is not None]
            if not hosts:
                context.abort(grpc.StatusCode.UNAVAILABLE, "this peer is not serving a stage yet")
            wanted = [
                h for h in hosts if h.role.stage == request.stage and request.plan_version in (0, h.role.plan_version)
            ]
            if not wanted:  # the shared marker: the caller follows the newer plan (export, state fetch)
                holds = ", ".join(f"stage {h.role.stage} of plan {h.role.plan_version}" for h in hosts)
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{PLAN_MISMATCH} this peer holds {holds}, not stage {request.stage} of plan "
                    f"{request.plan_version or 'now'}",
                )
            host = wanted[0]
            with host.compute_lock:  # copies taken under the lock; framed (and compressed) after it
                tensors = handover_tensors(host.worker, host.steps_done)
            yield from named_state_items(tensors, chunk_bytes)


def reduce_order(request: stage_pb2.ReduceRequest) -> ReduceOrder:
    """A Reduce call's request as the host's averager takes it: the same fields (repeated ones as tuples)."""
    return from_wire(ReduceOrder, request)


def step_order(request: stage_pb2.StepRequest) -> StepOrder:
    """A Step call's request as the host takes it: the same fields, and whether it carries the retired tied sum."""
    carried = {f.name: getattr(request, f.name) for f in fields(StepOrder) if f.name != "tied_grad_sum"}
    return StepOrder(**carried, tied_grad_sum=request.HasField("tied_grad_sum"))


def _same_place(a: StageHost, b: StageHost) -> bool:
    """Whether two hosts serve the same stage index and layer range (one replaced the other in place)."""
    return (a.role.stage, a.role.layer_start, a.role.layer_end) == (b.role.stage, b.role.layer_start, b.role.layer_end)


STATE_ZSTD_LEVEL = 1
"""zstd level of GetState's frames, on every link: fp32 weights and moments travel split by byte significance
(`ZSTD_SPLIT`, `compression.framing.split_float_bytes`), 17-20% fewer bytes on the default model's stage for
about 10 ms of the sender's CPU a copy; a held copy paced at a share of a slow link holds it that much less long."""


def named_state_items(tensors, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[stage_pb2.StateItem]:
    """GetState's stream items for named tensors: each an fp32 frame (compressed, `STATE_ZSTD_LEVEL`), in chunks of
    `chunk_bytes` (a stage's state, or a held copy of one, `swarm.daemon.replication.HeldServer`)."""
    codec = make_codec(CodecConfig("fp32"))
    for name, tensor in tensors.items():
        for chunk in frame(codec.encode(tensor.float()), zstd_level=STATE_ZSTD_LEVEL, chunk_bytes=chunk_bytes):
            yield stage_pb2.StateItem(name=name, chunk=chunk)
