"""The stage host: one stage's compute, its boundary ends and its schedule, between the calls that reach it.

A host runs the same whether its neighbours are in this process or on other peers: it reaches them through
a `Connector` (gRPC, or the in-process `LocalNetwork`), and every call it serves runs in the order of its
stage's schedule program (`ScheduleGate`). Forward calls flow stage 0 -> last stage, each stage sending
its activation straight to the next one and returning the loss back along the route; backward calls flow
last -> stage 0 the same way.

The host works with tensors and dataclasses (`swarm.runtime.messages`); the servicer reads each call into them
and writes the protobuf replies. It composes its step ledger (`StepLedger`: the open step, its calls in flight,
the steps applied) and its outbox (`Outbox`: the calls to its neighbours); what the plan assigns it arrives
whole, between steps, through `apply(StageAssignment)`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from swarm import trace
from swarm.compression import CodecConfig, WireError, WireLimits
from swarm.metrics import Metrics
from swarm.model.spec import AnyModelConfig, build_stage, model_identity
from swarm.net.connect import Connector
from swarm.net.stream import PLAN_MISMATCH, CallRefused, tokens_from_wire
from swarm.peers.routes import local_micro
from swarm.runtime.audit import AuditTrail, Recomputed, recompute
from swarm.runtime.average import GradientAverager, parameters_digest, sampled_digest
from swarm.runtime.boundary import LinkEnds, need_message
from swarm.runtime.budget import StageBudget
from swarm.runtime.callinfo import DEFAULT_SCHEDULE, NO_LABELS, call_wait_s
from swarm.runtime.device import to_device
from swarm.runtime.freeze import apply_frozen, cached_forward, check_frozen, grad_report
from swarm.runtime.gate import GateError, ScheduleGate
from swarm.runtime.ledger import StepLedger
from swarm.runtime.messages import CallInfo, GradReport, StageCall, StageStatus, StepOrder
from swarm.runtime.outbox import Outbox, timed_phase
from swarm.runtime.precision import check_scale, check_step
from swarm.runtime.schedules import Kind
from swarm.runtime.worker import StageConfig, StageWorker

__all__ = ["StageAssignment", "StageHost", "StageRole"]

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


@dataclass(frozen=True)
class StageAssignment:
    """What the plan assigns a stage host, applied whole between steps (`StageHost.apply`)."""

    role: StageRole
    links: LinkEnds
    """the stage's boundary ends (codecs, their state, shaping); a new object starts fresh codec state"""
    link_codecs: tuple[CodecConfig, ...] = ()
    """the (forward send, backward send, forward receive, backward receive) configs `links` were made from, as
    the plan named them (empty: the peer's own), so a later plan can tell whether they change"""
    compute_layers_per_s: float = 0.0
    """this peer's measured speed (Status reports it)"""
    epilogue: tuple[CodecConfig | None, CodecConfig | None] = field(default=(None, None))
    """the codecs of the replicas' sum and of the tied group's (None: the backward receiving end's)"""


class StageHost:
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
        on_step: called with the host after every optimizer step it applied (e.g. checkpointing).
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
        on_step: Callable[[StageHost], None] | None = None,
    ):
        self.model, self.peer_id, self.on_step = model, peer_id, on_step
        self.model_identity = model_identity(model)
        self.metrics = metrics or Metrics()
        self.budget = budget or StageBudget()
        module = build_stage(model, role.layer_start, role.layer_end, role.is_first, role.is_last)
        placed = links.place_on(stage_cfg.device)  # DeviceError if absent
        module, self.device = module.to(placed), str(placed)  # the optimizer state follows the module
        self.worker = StageWorker(module, stage_cfg)
        self.assignment = StageAssignment(role, links)
        self.outbox = Outbox(connector, self.metrics, self.budget)
        """the calls to the neighbouring stages, and which of them take the route from their plan"""
        self.gate = ScheduleGate(role.stage, role.n_stages, self.budget.max_micro_batches)
        self.limits = limits or self.budget.wire_limits(model)
        self.labels: dict[int, torch.Tensor] = {}
        """The open step's labels by micro-batch (last stage); dropped when the step ends."""
        self.labels_attempt = 0
        """the attempt of the open step whose labels `labels` holds (a later attempt's labels replace them all)"""
        self._labels_in = threading.Condition()
        """notified whenever labels are stored or dropped (`await_labels`)"""
        self.compute_lock = threading.Lock()
        self.ledger = StepLedger()
        """the open step (who opened it, its calls in flight) and the steps applied"""
        self._digest: tuple[tuple, str] | None = None
        """the weights' digest and the parameter versions it was computed at"""
        self.averager = GradientAverager(self)
        """The replicas' gradient sum (`Reduce`, `Average`) and its error-feedback residual."""
        self.audit = AuditTrail(self.budget.max_micro_batches)
        """the open step's records of each micro-batch, for the trainer's audits (`swarm.runtime.audit`)"""

    role = property(lambda self: self.assignment.role, doc="The stage and layers served, under which plan.")
    links = property(lambda self: self.assignment.links, doc="This stage's boundary ends.")
    open_step = property(lambda self: self.ledger.open_step, doc="The open step (None between steps).")
    steps_done = property(lambda self: self.ledger.steps_done, doc="Optimizer steps applied by this host.")

    def apply(self, assignment: StageAssignment) -> None:
        """Takes what the plan assigns this stage now: call between steps (`StageServicer.when_idle`). The layers
        served never change (a new host serves other layers); new links are placed on the stage's device and
        start with fresh codec state; a changed epilogue codec drops its group's residual."""
        old = self.assignment.role
        new = assignment.role
        if (new.stage, new.n_stages, new.layer_start, new.layer_end) != (
            old.stage, old.n_stages, old.layer_start, old.layer_end
        ):  # fmt: skip
            raise ValueError(f"this host serves layers [{old.layer_start}, {old.layer_end}) of stage {old.stage}")
        if assignment.links is not self.assignment.links:
            assignment.links.place_on(self.device)
        old_epilogue, self.assignment = self.assignment.epilogue, assignment
        if assignment.epilogue != old_epilogue:
            self.averager.set_codecs(*assignment.epilogue)

    def restore(self, steps_done: int) -> None:
        """Counts on from `steps_done` applied steps (a resumed checkpoint's, or a handed-over stage's)."""
        self.ledger.restore(steps_done)

    # ---- admission ----------------------------------------------------------------------------------------
    # A call is checked whole before it changes anything: `check_call` (its info, as soon as the first stream
    # item is in, before the body is read), then `admit` (the message or tokens against the budget and the
    # schedule, atomically with plan changes), and only then is anything decoded. `leave` ends every
    # admitted call; a step whose calls all failed before any progress closes again, so a bad call cannot
    # hold the stage for the next legitimate step.

    def check_call(self, info: CallInfo, caller: str | None = None, other_step: bool = False) -> None:
        """Refuses a call that this stage cannot serve whatever it carries; changes nothing. `other_step`: passes a
        call for another step than the open one, which `caller` may not close (`await_labels`: the labels, from the
        trainer that opened the open step, may come and close it)."""
        role, ledger = self.role, self.ledger
        if info.plan_version != role.plan_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the call follows plan {info.plan_version}, "
                f"this peer follows plan {role.plan_version}",
            )
        if info.stage != role.stage:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer serves stage {role.stage}, not stage {info.stage}",
            )
        ledger.check_attempt(info.step, info.attempt_id)
        if len(info.route) != role.n_stages or len(info.route_peers) != role.n_stages:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"route names {len(info.route)} stages, this pipeline has {role.n_stages}",
            )
        self.budget.check_info(info)
        check_scale(info.loss_scale, self.worker)
        open_step = ledger.open_step
        stale_s = self.budget.stale_step_s
        if (
            not other_step
            and open_step is not None
            and info.step != open_step
            and not ledger.may_close(info.step, caller, stale_s)
        ):
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {info.step} arrived while step {open_step} is unfinished on this stage",
            )

    def admit(
        self,
        call: StageCall | None,
        info: CallInfo,
        kind: Kind | None,
        caller: str | None = None,
        route_check: Callable[[CallInfo], None] | None = None,
    ):
        """Checks the whole call (info, then `route_check` of the plan's route, then message or tokens against
        the budget and the schedule), then opens its step: a stale step, or one its own trainer left for a later
        one, is abandoned first. The caller must `leave()` once the call is answered, whatever happened."""
        self._check_whole(call, info, kind, caller, route_check)
        with self.compute_lock:
            ledger = self.ledger
            ledger.check_attempt(info.step, info.attempt_id)  # again, atomic with the open: an abandon may have
            if ledger.open_step is not None and ledger.open_step != info.step:  # landed since check_call
                log.warning("stage %d: abandoning step %d for step %d", self.role.stage, ledger.open_step, info.step)
                self.worker.zero_grad()
                self._close_step()
            if ledger.open(info.step, caller):
                self.links.begin_step(info.step)  # codec state is journalled from here: kept at Step, undone on abandon

    def _check_whole(self, call, info, kind, caller, route_check, labels: bool = True) -> None:
        """`admit`'s checks, in order; changes nothing. `labels` False: all but a last stage's labels being here and
        the open step being its own or one it may close (the labels' trainer may close it: `await_labels`)."""
        self.check_call(info, caller, other_step=not labels)  # first: a call of another plan is told so
        if route_check is not None:
            route_check(info)
        if kind is not None:
            replacing = self.open_step is not None and info.step != self.open_step
            mb, n_micro = local_micro(info, self.role.stage)
            self.gate.check(info.step, kind, mb, info.schedule or DEFAULT_SCHEDULE, n_micro, replacing)
        if call is not None:
            self._check_payload(call, kind, labels)

    def leave(self) -> None:
        """Ends an admitted call. A step that made no progress and has no call left in flight closes again."""
        if self.ledger.leave():  # rare: the call failed early
            with self.compute_lock:  # not taken above: a reply must not wait for another micro-batch's compute
                if self.ledger.idle_unused():
                    self._close_step()

    def _check_payload(self, call: StageCall, kind: Kind, labels: bool = True) -> None:
        role, info, budget, model = self.role, call.info, self.budget, self.model
        mb = local_micro(info, role.stage)[0]
        if kind == Kind.FORWARD and role.is_first:
            if call.tokens is None or call.message is not None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "stage 0 takes a token batch")
            rows = list(call.tokens.shape)[:1]
            if rows and rows[0] > budget.max_batch:
                raise WireError("tokens.shape", f"{rows[0]} rows exceed the budget of {budget.max_batch}")
            call.parsed = tokens_from_wire(call.tokens, model.vocab_size, model.seq_len_tokens)
        elif kind == Kind.BACKWARD and role.is_last:
            if call.message is not None or call.tokens is not None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "the last stage's backward carries no tensor")
        else:
            if call.tokens is not None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"stage {role.stage} takes no token batch")
            shape = list(need_message(call).shape)
            _check_boundary(shape, model, "shape", "an activation" if kind == Kind.FORWARD else "a gradient")
            if not 1 <= shape[0] <= budget.max_batch:
                raise WireError("shape", f"{shape[0]} rows: a micro-batch holds 1..{budget.max_batch} samples")
        if kind == Kind.FORWARD and role.is_last and labels:
            targets = self.labels.get(mb) if self._labelled(info, mb) else None
            if targets is None:
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"{NO_LABELS} {info.step} micro-batch {mb}")
            inputs = list(call.tokens.shape if role.is_first else call.message.shape)[:2]
            if list(targets.shape) != inputs:
                raise WireError("labels.shape", f"{list(targets.shape)} vs inputs {inputs}")
        if kind == Kind.BACKWARD and not role.is_last:
            saved = self.worker.saved_shape(mb)
            if saved is None:
                raise CallRefused(
                    grpc.StatusCode.FAILED_PRECONDITION, f"micro_batch: {mb} has no forward on this stage"
                )
            if list(call.message.shape) != list(saved):
                raise WireError("shape", f"{list(call.message.shape)} is not the activation's {list(saved)}")

    # ---- admitted, not yet run: what a call holds in the AQ-SGD buffers ------------------------------------

    def _recv_store(self, kind: Kind):
        end = self.links.forward_recv if kind == Kind.FORWARD else self.links.backward_recv
        return end.buffers

    def fresh_ids(self, call: StageCall, kind: Kind) -> list[int]:
        """The sample ids an admitted call's message would newly buffer at this stage's receiving end (its first
        sights; none for codecs without buffers): what `release_fresh` gives back if the call never runs."""
        store = self._recv_store(kind)
        if store is None or call.message is None or (kind == Kind.FORWARD and self.role.is_first):
            return []
        return [int(i) for i in call.message.sample_ids if int(i) not in store]

    def release_fresh(self, call: StageCall, kind: Kind, ids: list[int]) -> None:
        """Forgets `ids` again (`fresh_ids`, buffered by this call's decode) when the call's turn never came: its
        step will be retried or abandoned anyway (which would undo them then), and meanwhile a stream of calls
        that never run cannot grow the buffers past what the calls in flight hold. An id another call of the
        step buffered meanwhile is forgotten too: the next sight of it is then a miss, which the sender answers
        by resending it in full (never an error)."""
        store = self._recv_store(kind)
        if store is None or not ids:
            return
        with self.links.lock:
            if self.open_step == call.info.step:
                store.forget(ids)

    # ---- one micro-batch: forward and backward -------------------------------------------------------------

    def decode(self, call: StageCall, kind: Kind) -> torch.Tensor:
        """What an admitted call brings: the tokens into stage 0, the decoded activation or gradient elsewhere
        (for AQ-SGD the receiver's buffer m: the receiver computes on what the codec delivers)."""
        if kind == Kind.FORWARD and self.role.is_first:
            return call.parsed[0]
        if kind == Kind.BACKWARD and self.role.is_last:  # the micro-batch's share of the step's (batch-mean) loss
            return torch.tensor(call.info.loss_weight or 1.0 / max(1, call.info.num_micro_batches))
        links = self.links
        end = links.forward_recv if kind == Kind.FORWARD else links.backward_recv_for(need_message(call))
        sender = _neighbour(call.info, self.role.stage - 1 if kind == Kind.FORWARD else self.role.stage + 1)
        with timed_phase(self.metrics, self.role.stage, "decode"):
            return links.incoming(end, need_message(call), self.limits, step=call.info.step, sender=sender)

    def forward(self, call: StageCall, inputs: torch.Tensor | None = None, cancelled: threading.Event | None = None):
        """Stage k's forward of one micro-batch (admitted: see `admit`): compute in schedule order, send on to
        stage k+1. `inputs` are the call's, decoded (default: decoded now); a set `cancelled` (the caller gave
        up) ends its wait for its turn. Returns the reply: the next stage's, with this stage's bytes added (the
        last stage's own: its loss)."""
        info, role, links = call.info, self.role, self.links
        if inputs is None:
            inputs = self.decode(call, Kind.FORWARD)
        if role.is_first:
            ids = call.parsed[1].tolist()
        else:
            ids = [int(i) for i in call.message.sample_ids] or list(range(inputs.shape[0]))
        mb, queued = local_micro(info, role.stage)[0], time.perf_counter()
        with self._turn(info, Kind.FORWARD, cancelled) as current:
            _observe(self.metrics, role.stage, "wait", queued, mb=mb, step=info.step)
            with self.compute_lock, timed_phase(self.metrics, role.stage, "compute", "forward", mb=mb, step=info.step):
                self.ledger.still(current(), info.step, mb)
                targets = self.labels.pop(mb) if role.is_last else None
                inputs, targets = to_device(links.device, inputs, targets)
                address = None if role.is_last else info.route[role.stage + 1]
                out = cached_forward(self.worker, links, address, mb, inputs, ids, targets, self.metrics)
                self.audit.forward(info.step, mb, inputs, out)  # references: kept until the step ends
            if role.is_last:
                return self.outbox.answer(float(out))
            # encoded in schedule order, still holding the turn (`Outbox.encode_forward`)
            nxt = self.outbox.to(info, role.stage + 1)
            items = self.outbox.encode_forward(links, out, ids, nxt)
        # communication: the activation goes straight to the next stage, which returns the loss
        return self.outbox.forward(links, nxt, items, out, ids)

    def backward(self, call: StageCall, grad_out: torch.Tensor | None = None, cancelled: threading.Event | None = None):
        """Stage k's backward of one micro-batch (admitted): backpropagate in schedule order, send to stage k-1.
        `grad_out` is the call's gradient, decoded (default: decoded now). Returns the reply: the previous
        stage's, with this stage's bytes added (stage 0's own)."""
        info, links = call.info, self.links
        if grad_out is None:
            grad_out = self.decode(call, Kind.BACKWARD)
        mb, queued = local_micro(info, self.role.stage)[0], time.perf_counter()
        with self._turn(info, Kind.BACKWARD, cancelled) as current:
            _observe(self.metrics, self.role.stage, "wait", queued, mb=mb, step=info.step)
            stage = self.role.stage
            with self.compute_lock, timed_phase(self.metrics, stage, "compute", "backward", mb=mb, step=info.step):
                self.ledger.still(current(), info.step, mb)
                grad_in = self.worker.backward(mb, *to_device(links.device, grad_out))
                self.audit.backward(info.step, mb, grad_out, grad_in, None if self.role.is_last else call.message)
            if grad_in is None:
                return self.outbox.answer()
            # in schedule order, as in forward(): gradq's error feedback and rounding draws follow the schedule
            prev = self.outbox.to(info, self.role.stage - 1)
            items = self.outbox.encode_backward(links, grad_in, prev)
        # communication: the input gradient goes straight back to the previous stage
        return self.outbox.backward(prev, items, grad_in)

    def _turn(self, info: CallInfo, kind: Kind, cancelled: threading.Event | None = None):
        """The call's turn in the schedule (a context manager), waited for at most as long as the call may wait."""
        mb, n_micro = local_micro(info, self.role.stage)
        timeout_s = call_wait_s(info, self.budget)
        schedule = info.schedule or DEFAULT_SCHEDULE
        return self.gate.turn(info.step, kind, mb, schedule, n_micro, timeout_s, cancelled, lambda: self.open_step)

    # ---- once per step ----------------------------------------------------------------------------------

    def check_labels(self, info: CallInfo, labels, micro_rows=()) -> list[tuple[int, torch.Tensor]]:
        """The checked targets of a PutLabels call, as (local micro-batch, targets) pairs; changes nothing.
        Labels are taken for the open step only (admission opens it), one batch per micro-batch (a retry replaces
        it), so the table never outgrows the budget. With `micro_rows`, one call holds the labels of consecutive
        micro-batches of the call's route (`LabelsRequest.micro_rows`), together no more rows than one may.
        `labels` is the call's token batch as it came (`tokens_from_wire` reads it within the model's bounds)."""
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

    def put_labels(self, info: CallInfo, labels: list[tuple[int, torch.Tensor]]) -> None:
        """Stores checked labels (`check_labels`) of the open step (`admit` opened it)."""
        with self.compute_lock:
            if self.open_step != info.step:
                raise GateError(f"step {info.step} was abandoned before its labels were stored")
            if info.attempt_id != self.labels_attempt:  # a step run again: its micro-batches may hold other samples
                self.labels, self.labels_attempt = {}, info.attempt_id
            self.labels.update(labels)
            self.ledger.progressed = True
        with self._labels_in:
            self._labels_in.notify_all()

    def await_labels(
        self,
        call: StageCall,
        caller: str | None = None,
        route_check: Callable[[CallInfo], None] | None = None,
        cancelled: threading.Event | None = None,
    ) -> None:
        """Waits, before its admission, until the labels of a Forward's micro-batch are here (last stage only):
        the trainer sends a step's labels beside its pipeline, not before it, so the first activation may come
        first. Every other check of the admission runs first, and again on each look (a call refused for anything
        else is refused at once, a repeat of one that ran and used its labels up too), but for the open step: a
        neighbour's Forward of the next step may come before the trainer's labels that close the step before (a
        trainer that died mid-step and came back sends no abandon). Bounded by the call's wait
        (`call_wait_s`), ended by `cancelled` (the caller gave up) and by the trainer's abandon of the attempt;
        holds no lock, so the PutLabels it waits for is admitted meanwhile. Admission then decides as before:
        labels still missing refuse the call (`NO_LABELS`)."""
        if not self.role.is_last:
            return
        info = call.info
        mb = local_micro(info, self.role.stage)[0]
        deadline = time.monotonic() + call_wait_s(info, self.budget)
        with self._labels_in:
            while not self._labelled(info, mb):
                left = deadline - time.monotonic()
                gone = cancelled is not None and cancelled.is_set()
                if left <= 0 or gone or self.ledger.was_abandoned(info.step, info.attempt_id):
                    return
                self._check_whole(call, info, Kind.FORWARD, caller, route_check, labels=False)
                self._labels_in.wait(min(left, 0.05))  # `cancelled` has no condition of its own: looked at often

    def _labelled(self, info: CallInfo, mb: int) -> bool:
        """Whether the labels of micro-batch `mb` of the call's step and attempt are here."""
        return info.step == self.open_step and info.attempt_id == self.labels_attempt and mb in self.labels

    def await_backwards(self, step: int, attempt_id: int, timeout_s: float, gone: threading.Event) -> bool:
        """Waits (at most `timeout_s`) until every action of `step`'s program here ran: a trainer sends its Reduce
        with the pipeline, not after it (`PipelineDriver.reduce_with_pipeline`), so the sums start as each stage's
        last backward ends. Stops waiting once that attempt is abandoned here, a later step is open, or the caller
        is `gone`; an earlier open step (a killed trainer's) is waited past, as this step's first call closes it.
        Whether the step's work is done (the Reduce's own checks refuse it otherwise)."""
        ledger = self.ledger

        def over() -> bool:
            open_step = ledger.open_step
            return (
                gone.is_set() or ledger.was_abandoned(step, attempt_id) or (open_step is not None and open_step > step)
            )

        return self.gate.wait_done(step, timeout_s, over)

    def grads(self) -> GradReport:
        """This stage's gradients' squared norm; stage 0 counts the tied weight's (the tied group's sum, after
        Reduce), the last stage leaves its copy out, so the global norm counts it once.

        Under the compute lock, like every other reader and writer of the gradients: a Grads of an abandoned
        attempt that is still running when the next attempt's backward, Reduce or abandon touches the same
        gradients must not read them concurrently (torch does not make that safe; it crashed the process)."""
        with self.compute_lock:  # +Inf where this stage found Inf/NaN (fp16): every stage then skips
            return grad_report(self.worker)  # with per-block norms, the trainer's freezing criterion

    def step(self, order: StepOrder) -> float:
        """Steps the optimizer (or abandons the step's gradients). A Step for the step applied last (a retry after
        a lost reply) returns its lr and changes nothing."""
        lr, arrived, ledger, version = 0.0, time.perf_counter(), self.ledger, self.role.plan_version
        with self.compute_lock:
            if not order.abandon and ledger.applied(order.step, order.plan_version, version):
                return ledger.last_lr
            if order.abandon:
                ledger.abandoned(order.step, order.attempt_id)
                if ledger.open_step is not None and order.step != ledger.open_step:
                    raise CallRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"step {order.step} is not open on this stage (open step: {ledger.open_step})",
                    )
                self.worker.zero_grad()
                self._close_step()
            else:
                ledger.check_apply(order.step, order.plan_version, version)
                if not self.gate.finished(order.step):  # this step's own program, not a reset gate's empty one
                    raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, "step requested before every backward ran")
                if order.tied_grad_sum:  # retired: the tied group sums it in Reduce
                    raise CallRefused(
                        grpc.StatusCode.INVALID_ARGUMENT, "tied_grad_sum: the end stages sum it in Reduce"
                    )
                if not self.averager.tied_done(order.step):
                    raise CallRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"step {order.step}: the tied gradient was not summed (Reduce)",
                    )
                check_step(order, self.worker)
                frozen = check_frozen(order, self.worker, self.model.n_layers)
                lr = self.worker.step(math.inf if order.skip else order.global_grad_norm)
                ledger.record(order.step, lr)
                self.averager.commit()
                _step_metrics(self.metrics, self.role, self.links, ledger.opened_at)
                if 0 < order.trainer_elapsed_s <= 1e6:  # the whole step as the trainer saw it (calibration)
                    _observe(self.metrics, self.role.stage, "trainer", arrived - order.trainer_elapsed_s)
                self._close_step(commit=True)
                apply_frozen(self, frozen)  # from the next step on; reported in Status
        if self.on_step is not None and not order.abandon:
            self.on_step(self)
        return lr

    def _close_step(self, commit: bool = False) -> None:
        """Ends the open step (compute lock held): applied (`commit`) or abandoned, which undoes its codec-state
        changes."""
        self.averager.end_step()
        self.links.end_step(commit)
        # closed before the gate resets: a call admitted for this step that reaches the gate after the reset
        # finds the step closed and does not begin it again (`ScheduleGate.turn`'s `open_step`)
        self.ledger.close()
        self.gate.reset()
        self.labels, self.labels_attempt = {}, 0
        self.audit.clear()
        with self._labels_in:  # a Forward waiting for labels of this step stops waiting: admission refuses it
            self._labels_in.notify_all()

    # ---- verified stage work (swarm.runtime.audit; the trainer's side: swarm.runtime.verify) ----------------

    def audit_record(self, step: int, plan_version: int, stage: int, mb: int):
        """The open step's record of local micro-batch `mb` (`AuditRecord`); refuses another plan, stage or step,
        and a micro-batch this stage holds no record of."""
        self._check_verify(plan_version, stage)
        if self.ledger.open_step != step:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"step {step} is not open on this stage (open: {self.open_step})"
            )
        record = self.audit.get(step, mb)
        if record is None or record.output is None:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"step {step} micro-batch {mb} has no record here")
        return record

    def recompute(self, step: int, plan_version: int, stage: int, inputs, targets=None, grad=None) -> Recomputed:
        """A sibling's micro-batch recomputed with this replica's weights (those of `step`: refused once this
        stage applied it). Inputs are checked (`check_recompute`) by the caller."""
        self._check_verify(plan_version, stage)
        with self.compute_lock:
            if self.ledger.last_step is not None and self.ledger.last_step >= step:
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"step {step} is applied here already")
            return recompute(self.worker, inputs, targets, grad)

    def check_recompute(self, inputs: torch.Tensor, targets, grad) -> None:
        """A Recompute's tensors against the stage's budget, as a Forward's and a Backward's would be."""
        role, model, budget = self.role, self.model, self.budget
        if not role.is_first:
            _check_boundary(list(inputs.shape), model, "input.shape", "an activation")
        rows = inputs.shape[0]
        if not 1 <= rows <= budget.max_batch:
            raise WireError("input.shape", f"{rows} rows: a micro-batch holds 1..{budget.max_batch} samples")
        if role.is_last and (targets is None or list(targets.shape) != list(inputs.shape)[:2]):
            raise WireError("targets", f"the last stage needs labels shaped {list(inputs.shape)[:2]}")
        if grad is not None and not role.is_last and list(grad.shape) != list(inputs.shape):
            raise WireError("grad.shape", f"{list(grad.shape)} is not the output's {list(inputs.shape)}")

    def _check_verify(self, plan_version: int, stage: int) -> None:
        role = self.role
        if plan_version != role.plan_version or stage != role.stage:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} stage {stage} of plan {plan_version}: this peer serves stage {role.stage} of plan "
                f"{role.plan_version}",
            )

    def sampled_digest(self, stride: int, seed: int) -> str:
        """SHA-256 of every `stride`-th element of the parameters from an offset drawn from `seed` (after Step,
        for the trainer's comparison of replicas; `swarm.runtime.average.sampled_digest`)."""
        with self.compute_lock:
            return sampled_digest(sorted(self.worker.module.named_parameters()), stride, seed)

    def weights_digest(self) -> str:
        """SHA-256 of the parameters, recomputed only when one changed (as Status reports it)."""
        params = sorted(self.worker.module.named_parameters())
        key = tuple(p._version for _, p in params)
        if self._digest is None or self._digest[0] != key:
            with self.compute_lock:
                self._digest = (key, parameters_digest(params))
        return self._digest[1]

    # ---- state ------------------------------------------------------------------------------------------

    def status(self) -> StageStatus:
        """What this stage is and has done; `metrics` holds its counters and gauges (not the histograms'
        buckets), the figures `swarm status` shows. The weights' digest is recomputed only when a parameter
        changed (their version counters moved), so a Status stays cheap."""
        self.metrics.compute_bits.set(32 if self.worker.precision == "fp32" else 16)  # the plan's, once switched
        snapshot = {k: v for k, v in self.metrics.snapshot().items() if "_bucket" not in k}
        digest = self.weights_digest()
        role, assigned = self.role, self.assignment
        return StageStatus(
            peer_id=self.peer_id,
            stage=role.stage,
            layer_start=role.layer_start,
            layer_end=role.layer_end,
            plan_version=role.plan_version,
            steps_done=self.ledger.steps_done,
            compute_layers_per_s=assigned.compute_layers_per_s,
            buffered_samples=self.links.buffered_samples(),
            device=self.device,
            weights_digest=digest,
            replica=role.replica,
            last_step=self.ledger.last_step or 0,
            step_open=self.ledger.open_step is not None,
            model_identity=self.model_identity,
            metrics=snapshot,
        )

    def close(self) -> None:
        self.outbox.close()


def _neighbour(info: CallInfo, stage: int) -> str:
    """The route's peer at `stage`, for a refusal naming who sent what it refuses (the caller: the plan's route
    check admitted only that peer); "" when it names none."""
    return info.route_peers[stage] if 0 <= stage < len(info.route_peers) else ""


def _observe(metrics: Metrics, stage: int, phase: str, since: float, **args) -> None:
    """Counts the seconds from `since` (`time.perf_counter`) to now as `phase` of `stage` (and a span)."""
    seconds = time.perf_counter() - since
    metrics.phase_seconds.labels(str(stage), phase).observe(seconds)
    if trace.active() is not None:
        trace.since(phase, time.monotonic_ns() - int(seconds * 1e9), "stage", stage=stage, **args)


def _step_metrics(metrics: Metrics, role: StageRole, links: LinkEnds, opened_at: float) -> None:
    """An applied step's figures: the step count and time, the plan, the samples held in AQ-SGD buffers."""
    metrics.steps.inc()
    metrics.step_seconds.observe(time.perf_counter() - opened_at)
    metrics.plan_version.set(role.plan_version)
    held = None if links.forward_recv.buffers is None else len(links.forward_recv.buffers)
    for count, link in ((held, role.stage - 1), (links.send_buffers("fw"), role.stage)):
        if count is not None and 0 <= link < role.n_stages - 1:
            metrics.buffered_samples.labels(str(link)).set(count)


def _check_boundary(shape: list[int], model, field: str, what: str) -> None:
    """A tensor crossing a stage boundary is [batch, seq, boundary_dim] with seq within the model's; else a
    WireError on `field` naming `what` it should have been."""
    if not (len(shape) == 3 and shape[1] <= model.seq_len_tokens and shape[2] == model.boundary_dim):
        raise WireError(field, f"{shape} is not {what} [batch, seq, {model.boundary_dim}]")
