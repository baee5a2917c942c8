"""The stage host: one stage's compute, its boundary ends and its schedule, between the calls that reach it.

A host runs the same whether its neighbours are in this process or on other peers: it reaches them through
a `Connector` (gRPC, or the in-process `LocalNetwork`), and every call it serves runs in the order of its
stage's schedule program (`ScheduleGate`). Forward calls flow stage 0 -> last stage, each stage sending
its activation straight to the next one and returning the loss back along the chain; backward calls flow
last -> stage 0 the same way.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import torch

from swarm.compression import CodecConfig, WireError, WireLimits, frame, make_codec
from swarm.metrics import Metrics
from swarm.model.spec import AnyModelConfig, build_stage, model_identity
from swarm.net.connect import Connector
from swarm.net.stream import (
    BUFFER_MISS,
    PLAN_MISMATCH,
    CallRefused,
    Incoming,
    tokens_from_wire,
)
from swarm.peers.routes import local_micro
from swarm.proto import stage_pb2
from swarm.runtime.average import GradientAverager, parameters_digest
from swarm.runtime.boundary import LinkEnds, need_message
from swarm.runtime.budget import StageBudget
from swarm.runtime.callinfo import DEFAULT_DEADLINE_S, DEFAULT_SCHEDULE, RouteAcks
from swarm.runtime.device import to_device
from swarm.runtime.freeze import apply_frozen, cached_forward, check_frozen, grad_reply
from swarm.runtime.gate import GateError, ScheduleGate
from swarm.runtime.neighbours import BufferMiss, NeighbourCalls
from swarm.runtime.precision import check_scale, check_step
from swarm.runtime.schedules import Kind
from swarm.runtime.worker import StageConfig, StageWorker

__all__ = ["StageHost", "StageRole"]

log = logging.getLogger("swarm.runtime.host")


@dataclass(frozen=True)
class StageRole:
    """Which slice of the model this peer serves, under which plan."""

    stage: int
    n_stages: int
    layer_start: int
    layer_end: int
    plan_version: int = 0
    replica: int = 0
    """This peer's index among its stage's replicas (it serves the routes c with c % R_stage == replica)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1


class StageHost(NeighbourCalls):
    """What one peer holds for its stage: the worker, its boundary ends, pending labels, the schedule gate.

    Args:
        role: the stage and layers served, under which plan.
        model: the model every stage and the trainer agree on.
        stage_cfg: optimizer and precision.
        links: this stage's boundary ends (codecs, their state, shaping).
        peer_id: this peer's id, for errors and status.
        connector: how to reach the neighbouring stages.
        limits: bounds on every message received (default: the budget's for this model).
        metrics: where the host counts bytes, phases, buffer hits and steps (default: its own registry).
        budget: what the host gives its callers at most (batch, micro-batches, waits, idle steps).
    """

    def __init__(
        self,
        role: StageRole,
        model: AnyModelConfig,
        stage_cfg: StageConfig,
        links: LinkEnds,
        peer_id: str,
        connector: Connector,
        limits: WireLimits | None = None,
        metrics: Metrics | None = None,
        budget: StageBudget | None = None,
    ):
        self.role, self.model, self.peer_id = role, model, peer_id
        self.model_identity = model_identity(model)
        self.metrics = metrics or Metrics()
        self.budget = budget or StageBudget()
        module = build_stage(model, role.layer_start, role.layer_end, role.is_first, role.is_last)
        placed = links.place_on(stage_cfg.device)  # DeviceError if absent
        module, self.device = module.to(placed), str(placed)  # the optimizer state follows the module
        self.worker = StageWorker(module, stage_cfg)
        self.links, self.connector = links, connector
        self.gate = ScheduleGate(role.stage, role.n_stages, self.budget.max_micro_batches)
        self.limits = limits or self.budget.wire_limits(model)
        self.labels: dict[int, torch.Tensor] = {}
        """The open step's labels by micro-batch (last stage); dropped when the step ends."""
        self.compute_lock = threading.Lock()
        self._abandoned: deque[tuple[int, int]] = deque(maxlen=16)
        """(step, attempt id) of the attempts this stage was told to abandon: their late calls are refused"""
        self.steps_done = 0
        self.last_step: int | None = None
        """The last step this stage applied, and the lr it used: a retried Step for it changes nothing."""
        self._last_lr = 0.0
        self._digest: tuple[tuple, str] | None = None
        self.open_step: int | None = None
        """The step this stage has taken calls for and not yet stepped or abandoned (None between steps)."""
        self._owner: str | None = None
        """Who opened the step (the caller's peer id, when calls are authenticated)."""
        self._inflight = 0
        self._calls = threading.Lock()
        """Guards `_inflight` and `_touched`, so ending a call never waits for the compute lock."""
        """Calls admitted and not yet answered; a step with none in flight and no progress closes itself."""
        self._progressed = False
        """Whether the open step ran any schedule action or took labels."""
        self._touched = time.monotonic()
        self._opened_at = 0.0
        self.compute_layers_per_s = 0.0
        self.on_step: Callable[[StageHost], None] | None = None
        """Called after every optimizer step (e.g. checkpointing)."""
        self.averager = GradientAverager(self)
        """The replicas' gradient sum (`Reduce`, `Average`) and its error-feedback residual."""
        self._route_acks = RouteAcks()
        """neighbours that take the route from their plan: boundary calls to them leave it out (`neighbours`)"""

    # ---- admission ----------------------------------------------------------------------------------------
    # A call is checked whole before it changes anything: `check_call` (its info, as soon as the first stream
    # item is in, before the body is read), then `admit` (the message or tokens against the budget and the
    # schedule, atomically with plan changes), and only then is anything decoded. `leave` ends every
    # admitted call; a step whose calls all failed before any progress closes again, so a bad call cannot
    # hold the stage for the next legitimate step.

    def check_call(self, info: stage_pb2.CallInfo, caller: str | None = None) -> None:
        """Refuses a call that this stage cannot serve whatever it carries; changes nothing."""
        if info.plan_version != self.role.plan_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the call follows plan {info.plan_version}, "
                f"this peer follows plan {self.role.plan_version}",
            )
        if info.stage != self.role.stage:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer serves stage {self.role.stage}, not stage {info.stage}",
            )
        self._check_attempt(info)
        if len(info.route) != self.role.n_stages or len(info.route_peers) != self.role.n_stages:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"route names {len(info.route)} stages, this pipeline has {self.role.n_stages}",
            )
        self.budget.check_info(info)
        check_scale(info.loss_scale, self.worker)
        if self.open_step is not None and info.step != self.open_step and not self._may_close(info.step, caller):
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {info.step} arrived while step {self.open_step} is unfinished on this stage",
            )

    def _may_close(self, step: int, caller: str | None) -> bool:
        """Whether the open step may give way to `step`: it is stale (no call in flight and none for
        `stale_step_s`), or the trainer that opened it moved on to another step (a trainer runs one step at a
        time: calls for another step mean it gave this one up)."""
        if self._inflight:
            return False
        if time.monotonic() - self._touched > self.budget.stale_step_s:
            return True
        return caller is not None and caller == self._owner

    def admit(
        self,
        call: Incoming | None,
        info: stage_pb2.CallInfo,
        kind: Kind | None,
        caller: str | None = None,
        route_check: Callable[[stage_pb2.CallInfo], None] | None = None,
    ):
        """Checks the whole call (info, then `route_check` of the plan's route, then message or tokens against
        the budget and the schedule), then opens its step. The caller must `leave()` once the call is
        answered, whatever happened."""
        self.check_call(info, caller)  # first: a call of another plan is told so, and the trainer moves on
        if route_check is not None:
            route_check(info)
        if kind is not None:
            replacing = self.open_step is not None and info.step != self.open_step
            mb, n_micro = local_micro(info, self.role.stage)
            self.gate.check(info.step, kind, mb, info.schedule or DEFAULT_SCHEDULE, n_micro, replacing)
        if call is not None:
            self._check_payload(call, kind)
        with self.compute_lock:
            self._check_attempt(info)  # again, atomic with the open: an abandon may have landed since check_call
            self.open(info.step, caller)
            with self._calls:
                self._inflight += 1

    def _check_attempt(self, info: stage_pb2.CallInfo) -> None:
        """Refuses a late call of an attempt this stage was told to abandon (it would open the step again)."""
        if info.attempt_id and (info.step, info.attempt_id) in self._abandoned:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"that attempt of step {info.step} was abandoned")

    def orphaned(self, idle_s: float) -> bool:
        """Whether the open step has had no call in flight, and none admitted, for `idle_s` seconds."""
        return self._inflight == 0 and time.monotonic() - self._touched > idle_s

    def leave(self) -> None:
        """Ends an admitted call. A step that made no progress and has no call left in flight closes again."""
        with self._calls:  # not the compute lock: a reply must not wait for another micro-batch's compute
            self._inflight -= 1
            self._touched = time.monotonic()
            idle = self._inflight == 0
        if idle and self.open_step is not None and not self._progressed:  # rare: the call failed early
            with self.compute_lock:
                if self._inflight == 0 and self.open_step is not None and not self._progressed:
                    self._close_step()

    def open(self, step: int, caller: str | None = None) -> None:
        """Marks `step` open on this stage (its first admitted call starts the step's clock); a stale step, or
        one its own trainer left for a later one, is abandoned first."""
        if self.open_step is not None and self.open_step != step:
            log.warning("stage %d: abandoning step %d for step %d", self.role.stage, self.open_step, step)
            self._abandon()
        if self.open_step != step:
            self.open_step, self._owner, self._progressed = step, caller, False
            self._opened_at = time.perf_counter()
            self.links.begin_step(step)  # codec state is journalled from here: kept at Step, undone on abandon
        self._touched = time.monotonic()

    def _check_payload(self, call: Incoming, kind: Kind) -> None:
        role, info = self.role, call.info
        if kind == Kind.FORWARD and role.is_first:
            if call.tokens is None or call.message is not None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "stage 0 takes a token batch")
            rows = list(call.tokens.shape)[:1]
            if rows and rows[0] > self.budget.max_batch:
                raise WireError("tokens.shape", f"{rows[0]} rows exceed the budget of {self.budget.max_batch}")
            call.parsed = tokens_from_wire(call.tokens, self.model.vocab_size, self.model.seq_len_tokens)
        elif kind == Kind.BACKWARD and role.is_last:
            if call.message is not None or call.tokens is not None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "the last stage's backward carries no tensor")
        else:
            if call.tokens is not None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"stage {role.stage} takes no token batch")
            self._check_activation(need_message(call), "an activation" if kind == Kind.FORWARD else "a gradient")
        if kind == Kind.FORWARD and role.is_last:
            targets = self.labels.get(self._mb(info)) if info.step == self.open_step else None
            if targets is None:
                missing = f"no labels for step {info.step} micro-batch {self._mb(info)}"
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, missing)
            inputs = list(call.tokens.shape if role.is_first else call.message.shape)[:2]
            if list(targets.shape) != inputs:
                raise WireError("labels.shape", f"{list(targets.shape)} vs inputs {inputs}")
        if kind == Kind.BACKWARD and not role.is_last:
            saved = self.worker.saved_shape(self._mb(info))
            if saved is None:
                raise CallRefused(
                    grpc.StatusCode.FAILED_PRECONDITION, f"micro_batch: {self._mb(info)} has no forward on this stage"
                )
            if list(call.message.shape) != list(saved):
                raise WireError("shape", f"{list(call.message.shape)} is not the activation's {list(saved)}")

    def _check_activation(self, msg, what: str) -> None:
        shape = list(msg.shape)
        if not (len(shape) == 3 and shape[1] <= self.model.seq_len_tokens and shape[2] == self.model.hidden_dim):
            raise WireError("shape", f"{shape} is not {what} [batch, seq, {self.model.hidden_dim}]")
        if not 1 <= shape[0] <= self.budget.max_batch:
            raise WireError("shape", f"{shape[0]} rows: a micro-batch holds 1..{self.budget.max_batch} samples")

    # ---- one micro-batch: forward and backward -------------------------------------------------------------

    def decode(self, call: Incoming, kind: Kind) -> torch.Tensor:
        """What an admitted call brings: the tokens into stage 0, the decoded activation or gradient elsewhere
        (for AQ-SGD the receiver's buffer m: the receiver computes on what the codec delivers)."""
        if kind == Kind.FORWARD and self.role.is_first:
            return call.parsed[0]
        if kind == Kind.BACKWARD and self.role.is_last:  # the micro-batch's share of the step's (batch-mean) loss
            return torch.tensor(call.info.loss_weight or 1.0 / max(1, call.info.num_micro_batches))
        direction = self.links.fw_recv if kind == Kind.FORWARD else self.links.bw_recv
        with self._phase("decode"):
            return self.links.incoming(direction, need_message(call), self.limits, step=call.info.step)

    def forward(
        self, call: Incoming, inputs: torch.Tensor | None = None, cancelled: threading.Event | None = None
    ) -> stage_pb2.ForwardReply:
        """Stage k's forward of one micro-batch (admitted: see `admit`): compute in schedule order, send on to
        stage k+1. `inputs` are the call's, decoded (default: decoded now); a set `cancelled` (the caller gave
        up) ends its wait for its turn."""
        info, role = call.info, self.role
        if inputs is None:
            inputs = self.decode(call, Kind.FORWARD)
        if role.is_first:
            ids = call.parsed[1].tolist()
        else:
            ids = [int(i) for i in call.message.sample_ids] or list(range(inputs.shape[0]))
        queued = time.perf_counter()
        with self._turn(info, Kind.FORWARD, cancelled) as current:
            self._observe("wait", queued)
            with self.compute_lock, self._phase("compute"):
                self._still(current, info)
                targets = self.labels.pop(self._mb(info)) if role.is_last else None
                inputs, targets = to_device(self.links.device, inputs, targets)
                out = cached_forward(self, info, self._mb(info), inputs, ids, targets)  # swarm.runtime.freeze
            if role.is_last:
                return stage_pb2.ForwardReply(has_loss=True, loss=float(out))
            # encoded in schedule order, still holding the turn: the codec's state (stochastic rounding draws,
            # AQ-SGD buffers) advances in the same order in every run, whatever the network's timing
            nxt = self._neighbour(info, role.stage + 1)
            items = self._outgoing_activation(out, ids, nxt)
        # communication: the activation goes straight to the next stage, which returns the loss
        return self._send_forward(nxt, items, out, ids)

    def backward(
        self, call: Incoming, grad_out: torch.Tensor | None = None, cancelled: threading.Event | None = None
    ) -> stage_pb2.BackwardReply:
        """Stage k's backward of one micro-batch (admitted): backpropagate in schedule order, send to stage k-1.
        `grad_out` is the call's gradient, decoded (default: decoded now)."""
        info = call.info
        if grad_out is None:
            grad_out = self.decode(call, Kind.BACKWARD)
        queued = time.perf_counter()
        with self._turn(info, Kind.BACKWARD, cancelled) as current:
            self._observe("wait", queued)
            with self.compute_lock, self._phase("compute"):
                self._still(current, info)
                grad_in = self.worker.backward(self._mb(info), *to_device(self.links.device, grad_out))
            if grad_in is None:
                return stage_pb2.BackwardReply()
            # in schedule order, as in forward(): gradq's error feedback and rounding draws follow the schedule
            prev = self._neighbour(info, self.role.stage - 1)
            to = prev.route[prev.stage]
            with self._phase("encode"):
                end = self.links.send_end("bw", to)
                items = self.links.outgoing(end, grad_in, None, self._wire_info(prev), to, step=info.step)
        # communication: the input gradient goes straight back to the previous stage
        reply, sent = self._call(prev, "Backward", items)
        self._count(reply.traffic, prev.stage, "backward", sent, 4 * grad_in.numel())
        return reply

    def _send_forward(
        self, nxt: stage_pb2.CallInfo, items: Iterator[bytes], out: torch.Tensor, ids: list[int]
    ) -> stage_pb2.ForwardReply:
        """Sends the activation; on a buffer miss at the next stage, re-sends these samples in full."""
        try:
            reply, sent = self._call(nxt, "Forward", items, retry_on=BUFFER_MISS)
        except BufferMiss:
            log.info("stage %d lost AQ-SGD buffers; re-sending %d samples in full", nxt.stage, len(ids))
            self.links.forget(ids, nxt.route[nxt.stage])
            # re-sending only the missed ids would desynchronise the others, whose sender-side m already moved
            reply, sent = self._call(nxt, "Forward", self._outgoing_activation(out, ids, nxt))
        self._count(reply.traffic, self.role.stage, "forward", sent, 4 * out.numel())
        return reply

    def _outgoing_activation(self, out: torch.Tensor, ids: list[int], nxt: stage_pb2.CallInfo) -> Iterator[bytes]:
        to = nxt.route[nxt.stage]
        end = self.links.send_end("fw", to)
        buffers = end.buffers
        if buffers is not None:  # AQ-SGD: buffered samples go as deltas, the others in full
            hits = sum(1 for i in ids if i in buffers)
            link = str(self.role.stage)
            self.metrics.buffer_hits.labels(link).inc(hits)
            self.metrics.buffer_misses.labels(link).inc(len(ids) - hits)
        with self._phase("encode"):
            return self.links.outgoing(end, out, ids, self._wire_info(nxt), to, step=nxt.step)

    def _count(self, traffic: stage_pb2.Traffic, link: int, direction: str, sent: int, fp32: int) -> None:
        """Counts what this stage sent, in its metrics and in the reply that carries it back to the driver."""
        self.metrics.wire_bytes.labels(str(link), direction).inc(sent)
        self.metrics.fp32_bytes.labels(str(link), direction).inc(fp32)
        traffic.wire_bytes += sent
        traffic.fp32_wire_bytes += fp32
        traffic.link_bytes[link] += sent

    def _phase(self, phase: str):
        return self.metrics.phase_seconds.labels(str(self.role.stage), phase).time()

    def _observe(self, phase: str, since: float) -> None:
        self.metrics.phase_seconds.labels(str(self.role.stage), phase).observe(time.perf_counter() - since)

    def _still(self, current, info: stage_pb2.CallInfo) -> None:
        """Under the compute lock: the call's step is still this stage's (not abandoned while it waited)."""
        if not current() or self.open_step != info.step:
            raise GateError(f"step {info.step} was abandoned before micro-batch {self._mb(info)} ran")
        self._progressed = True

    def _turn(self, info: stage_pb2.CallInfo, kind: Kind, cancelled: threading.Event | None = None):
        mb, n_micro = local_micro(info, self.role.stage)
        timeout_s = self._deadline(info)
        schedule = info.schedule or DEFAULT_SCHEDULE
        return self.gate.turn(info.step, kind, mb, schedule, n_micro, timeout_s, cancelled, lambda: self.open_step)

    def _mb(self, info: stage_pb2.CallInfo) -> int:
        """The call's micro-batch at this replica: its index among this replica's micro-batches of the step
        (`routes.local_micro`; `micro_batch` itself with equal replica counts)."""
        return local_micro(info, self.role.stage)[0]

    # ---- once per step ----------------------------------------------------------------------------------

    def check_labels(
        self, info: stage_pb2.CallInfo, labels: stage_pb2.TokenBatch, micro_rows=()
    ) -> list[tuple[int, torch.Tensor]]:
        """The checked targets of a PutLabels call, as (local micro-batch, targets) pairs; changes nothing.
        Labels are taken for the open step only (admission opens it), one batch per micro-batch (a retry replaces
        it), so the table never outgrows the budget. With `micro_rows`, one call holds the labels of consecutive
        micro-batches of the call's chain (`LabelsRequest.micro_rows`), together no more rows than one may."""
        if not self.role.is_last:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.role.stage} is not the last stage")
        rows = list(labels.shape)[:1]
        if rows and rows[0] > self.budget.max_batch:
            raise WireError("labels.shape", f"{rows[0]} rows exceed the budget of {self.budget.max_batch}")
        first, count = local_micro(info, self.role.stage)
        split = [int(r) for r in micro_rows]
        if len(split) > count - first or (split and (not rows or min(split) < 1 or sum(split) != rows[0])):
            raise WireError("micro_rows", f"{split[:8]}: not 1+ rows each of the {rows} rows, for micro-batches "
                            f"{first}.. of {count}")  # fmt: skip
        targets, _ = tokens_from_wire(labels, self.model.vocab_size, self.model.seq_len_tokens)
        return list(zip(range(first, count), targets.split(split or [len(targets)]), strict=False))

    def put_labels(self, info: stage_pb2.CallInfo, labels: list[tuple[int, torch.Tensor]]) -> None:
        """Stores checked labels (`check_labels`) of the open step (`admit` opened it)."""
        with self.compute_lock:
            if self.open_step != info.step:
                raise GateError(f"step {info.step} was abandoned before its labels were stored")
            self.labels.update(labels)
            self._progressed = True

    def grads(self) -> stage_pb2.GradReply:
        """This stage's gradients' squared norm; stage 0 counts the tied weight's (the tied group's sum, after
        Reduce), the last stage leaves its copy out, so the global norm counts it once.

        Under the compute lock, like every other reader and writer of the gradients: a Grads of an abandoned
        attempt that is still running when the next attempt's backward, Reduce or abandon touches the same
        gradients must not read them concurrently (torch does not make that safe; it crashed the process)."""
        with self.compute_lock:  # +Inf where this stage found Inf/NaN (fp16): every stage then skips
            return grad_reply(self.worker)  # with per-block norms, the trainer's freezing criterion

    def step(self, request: stage_pb2.StepRequest) -> float:
        """Steps the optimizer (or abandons the step's gradients). A Step for the step applied last (a retry after
        a lost reply) returns its lr and changes nothing."""
        lr, arrived = 0.0, time.perf_counter()
        with self.compute_lock:
            if not request.abandon and self._applied(request):
                return self._last_lr
            if request.abandon:
                if request.attempt_id:
                    self._abandoned.append((request.step, request.attempt_id))
                if self.open_step is not None and request.step != self.open_step:
                    raise CallRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"step {request.step} is not open on this stage (open step: {self.open_step})",
                    )
                self._abandon()
            else:
                self._check_step(request)
                check_step(request, self.worker)
                check_frozen(request, self.worker, self.model.n_layers)
                lr = self.worker.step(math.inf if request.skip else request.global_grad_norm)
                self.steps_done += 1
                self.last_step, self._last_lr = request.step, lr
                self.averager.commit()
                self._step_metrics()
                if 0 < request.trainer_elapsed_s <= 1e6:  # the whole step as the trainer saw it (calibration)
                    self._observe("trainer", arrived - request.trainer_elapsed_s)
                self._close_step(commit=True)
                apply_frozen(self, request.frozen_layers)  # from the next step on; reported in Status
        if self.on_step is not None and not request.abandon:
            self.on_step(self)
        return lr

    def _applied(self, request: stage_pb2.StepRequest) -> bool:
        return (
            request.step == self.last_step
            and request.plan_version == self.role.plan_version
            and self.open_step != request.step
        )

    def _abandon(self) -> None:
        """Drops the open step's gradients and in-flight activations (compute lock held)."""
        self.worker.zero_grad()
        self._close_step()

    def _close_step(self, commit: bool = False) -> None:
        """Ends the open step: applied (`commit`) or abandoned, which undoes its codec-state changes."""
        self.averager.end_step()
        self.links.end_step(commit)
        # closed before the gate resets: a call admitted for this step that reaches the gate after the reset
        # finds the step closed and does not begin it again (`ScheduleGate.turn`'s `open_step`)
        self.open_step, self._owner, self._progressed = None, None, False
        self.gate.reset()
        self.labels = {}

    def _deadline(self, info: stage_pb2.CallInfo) -> float:
        """How long a call may wait here or downstream: what it asks, capped by the budget."""
        return min(info.deadline_s or DEFAULT_DEADLINE_S, self.budget.max_wait_s)

    def _step_metrics(self) -> None:
        m, role = self.metrics, self.role
        m.steps.inc()
        m.step_seconds.observe(time.perf_counter() - self._opened_at)
        m.plan_version.set(role.plan_version)
        held = None if self.links.fw_recv.buffers is None else len(self.links.fw_recv.buffers)
        for count, link in ((held, role.stage - 1), (self.links.send_buffers("fw"), role.stage)):
            if count is not None and 0 <= link < role.n_stages - 1:
                m.buffered_samples.labels(str(link)).set(count)

    def _check_step(self, request: stage_pb2.StepRequest) -> None:
        if request.plan_version != self.role.plan_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the step follows plan {request.plan_version}, "
                f"this peer follows plan {self.role.plan_version}",
            )
        if self.open_step != request.step:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {request.step} never ran on this stage (open step: {self.open_step})",
            )
        if not self.gate.step_done:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, "step requested before every backward ran")
        if request.HasField("tied_grad_sum"):  # retired: the tied group sums it in Reduce
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "tied_grad_sum: the end stages sum it in Reduce")
        if not self.averager.tied_done(request.step):
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"step {request.step}: the tied gradient was not summed (Reduce)"
            )

    # ---- state ------------------------------------------------------------------------------------------

    def status(self) -> stage_pb2.StatusReply:
        """What this stage is and has done; `metrics` holds its counters and gauges (not the histograms'
        buckets), the figures `swarm status` shows."""
        self.metrics.compute_bits.set(32 if self.worker.precision == "fp32" else 16)  # the plan's, once switched
        snapshot = {k: v for k, v in self.metrics.snapshot().items() if "_bucket" not in k}
        return stage_pb2.StatusReply(
            metrics=snapshot,
            peer_id=self.peer_id,
            stage=self.role.stage,
            layer_start=self.role.layer_start,
            layer_end=self.role.layer_end,
            plan_version=self.role.plan_version,
            steps_done=self.steps_done,
            compute_layers_per_s=self.compute_layers_per_s,
            buffered_samples=self.links.buffered_samples(),
            device=self.device,
            weights_digest=self.weights_digest(),
            replica=self.role.replica,
            last_step=self.last_step or 0,
            model_identity=self.model_identity,
        )

    def weights_digest(self) -> str:
        """SHA-256 (hex) of the stage's parameters in name order: equal on replicas that applied the same
        steps. Recomputed only when a parameter changed (their version counters moved), so a heartbeat's
        Status stays cheap."""
        params = sorted(self.worker.module.named_parameters())
        key = tuple(p._version for _, p in params)
        cached = self._digest
        if cached is None or cached[0] != key:
            with self.compute_lock:
                cached = self._digest = (key, parameters_digest(params))
        return cached[1]

    def state_items(self) -> Iterator[stage_pb2.StateItem]:
        """The stage's state as named fp32 tensors, for handing the stage over to another peer: weights
        (`model.*`), optimizer moments (`optim.*`) and the schedule's position (`meta.*`)."""
        from swarm.runtime.checkpoint import handover_tensors

        codec = make_codec(CodecConfig("fp32"))
        for name, tensor in handover_tensors(self.worker, self.steps_done).items():
            for chunk in frame(codec.encode(tensor.float()), zstd_level=0):
                yield stage_pb2.StateItem(name=name, chunk=chunk)

    def close(self) -> None:
        self.connector.close()
