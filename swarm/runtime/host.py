"""The stage host: one stage's compute, its boundary ends and its schedule, between the calls that reach it.

A host runs the same whether its neighbours are in this process or on other peers: it reaches them through
a `Connector` (gRPC, or the in-process `LocalNetwork`), and every call it serves runs in the order of its
stage's schedule program (`ScheduleGate`). Forward calls flow stage 0 -> last stage, each stage sending
its activation straight to the next one and returning the loss back along the chain; backward calls flow
last -> stage 0 the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import torch

from swarm.compression import CodecConfig, WireError, WireLimits, frame, make_codec
from swarm.metrics import Metrics
from swarm.model.gpt import ModelConfig, build_stage
from swarm.net.connect import Connector
from swarm.net.stream import (
    BUFFER_MISS,
    PLAN_MISMATCH,
    CallRefused,
    Incoming,
    name_failure,
    tokens_from_wire,
)
from swarm.proto import stage_pb2
from swarm.runtime.boundary import LinkEnds, need_message
from swarm.runtime.gate import ScheduleGate
from swarm.runtime.schedules import Kind
from swarm.runtime.worker import StageConfig, StageWorker

__all__ = ["StageHost", "StageRole"]

log = logging.getLogger("swarm.runtime.host")

MAX_PENDING_LABELS = 1024
DEFAULT_DEADLINE_S = 120.0


@dataclass(frozen=True)
class StageRole:
    """Which slice of the model this peer serves, under which plan."""

    stage: int
    n_stages: int
    layer_start: int
    layer_end: int
    plan_version: int = 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1


class StageHost:
    """What one peer holds for its stage: the worker, its boundary ends, pending labels, the schedule gate.

    Args:
        role: the stage and layers served, under which plan.
        model: the model every stage and the trainer agree on.
        stage_cfg: optimizer and precision.
        links: this stage's boundary ends (codecs, their state, shaping).
        peer_id: this peer's id, for errors and status.
        connector: how to reach the neighbouring stages.
        limits: bounds on every message received.
        device: where the stage computes.
        metrics: where the host counts bytes, phases, buffer hits and steps (default: its own registry).
    """

    def __init__(
        self,
        role: StageRole,
        model: ModelConfig,
        stage_cfg: StageConfig,
        links: LinkEnds,
        peer_id: str,
        connector: Connector,
        limits: WireLimits | None = None,
        device: str = "cpu",
        metrics: Metrics | None = None,
    ):
        self.role, self.model, self.peer_id, self.device = role, model, peer_id, device
        self.metrics = metrics or Metrics()
        module = build_stage(model, role.layer_start, role.layer_end, role.is_first, role.is_last)
        self.worker = StageWorker(module, stage_cfg)
        self.links, self.connector = links, connector
        self.gate = ScheduleGate(role.stage, role.n_stages)
        self.limits = limits or WireLimits()
        self.labels: dict[tuple[int, int], torch.Tensor] = {}
        self.compute_lock = threading.Lock()
        self.steps_done = 0
        self.open_step: int | None = None
        """The step this stage has taken calls for and not yet stepped or abandoned (None between steps)."""
        self._opened_at = 0.0
        self.compute_layers_per_s = 0.0
        self.on_step: Callable[[StageHost], None] | None = None
        """Called after every optimizer step (e.g. checkpointing)."""

    # ---- admission ----------------------------------------------------------------------------------------

    def check_call(self, info: stage_pb2.CallInfo) -> None:
        if info.plan_version != self.role.plan_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the call follows plan {info.plan_version}, "
                f"this peer follows plan {self.role.plan_version}",
            )
        if self.open_step is not None and info.step != self.open_step:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {info.step} arrived while step {self.open_step} is unfinished on this stage",
            )
        if info.stage != self.role.stage:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer serves stage {self.role.stage}, not stage {info.stage}",
            )
        if len(info.route) != self.role.n_stages or len(info.route_peers) != self.role.n_stages:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"route names {len(info.route)} stages, this pipeline has {self.role.n_stages}",
            )

    def open(self, step: int) -> None:
        """Marks `step` open on this stage (its first admitted call starts the step's clock)."""
        if self.open_step != step:
            self.open_step, self._opened_at = step, time.perf_counter()

    def _check_activation(self, msg, what: str) -> None:
        shape = list(msg.shape)
        if not (len(shape) == 3 and shape[1] <= self.model.seq_len_tokens and shape[2] == self.model.hidden_dim):
            raise WireError("shape", f"{shape} is not {what} [batch, seq, {self.model.hidden_dim}]")

    # ---- one micro-batch: forward and backward -------------------------------------------------------------

    def forward(self, call: Incoming) -> stage_pb2.ForwardReply:
        """Stage k's forward of one micro-batch: decode, compute in schedule order, send on to stage k+1."""
        info, role = call.info, self.role
        if role.is_first:
            if call.tokens is None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "stage 0 takes a token batch")
            inputs, id_tensor = tokens_from_wire(call.tokens, self.model.vocab_size, self.model.seq_len_tokens)
            ids = id_tensor.tolist()
        else:
            msg = need_message(call)
            self._check_activation(msg, "an activation")
            # the receiver computes on what the codec delivers (for AQ-SGD, its buffer m)
            with self._phase("decode"):
                inputs = self.links.incoming(self.links.fw_recv, msg, self.limits)
            ids = [int(i) for i in msg.sample_ids] or list(range(inputs.shape[0]))
        queued = time.perf_counter()
        with self._turn(info, Kind.FORWARD):
            self._observe("wait", queued)
            targets = self._labels_for(info, inputs) if role.is_last else None
            with self.compute_lock, self._phase("compute"):
                out = self.worker.forward(info.micro_batch, inputs, torch.tensor(ids), targets)
            if role.is_last:
                return stage_pb2.ForwardReply(has_loss=True, loss=float(out))
            # encoded in schedule order, still holding the turn: the codec's state (stochastic rounding draws,
            # AQ-SGD buffers) advances in the same order in every run, whatever the network's timing
            nxt = self._neighbour(info, role.stage + 1)
            items = self._outgoing_activation(out, ids, nxt)
        # communication: the activation goes straight to the next stage, which returns the loss
        return self._send_forward(nxt, items, out, ids)

    def backward(self, call: Incoming) -> stage_pb2.BackwardReply:
        """Stage k's backward of one micro-batch: decode, backpropagate in schedule order, send to stage k-1."""
        info = call.info
        if self.role.is_last:
            grad_out = torch.tensor(1.0 / max(1, info.num_micro_batches))
        else:
            msg = need_message(call)
            self._check_activation(msg, "a gradient")
            with self._phase("decode"):
                grad_out = self.links.incoming(self.links.bw_recv, msg, self.limits)
        queued = time.perf_counter()
        with self._turn(info, Kind.BACKWARD):
            self._observe("wait", queued)
            with self.compute_lock, self._phase("compute"):
                grad_in = self.worker.backward(info.micro_batch, grad_out)
            if grad_in is None:
                return stage_pb2.BackwardReply()
            # in schedule order, as in forward(): gradq's error feedback and rounding draws follow the schedule
            prev = self._neighbour(info, self.role.stage - 1)
            to = prev.route[prev.stage]
            with self._phase("encode"):
                items = self.links.outgoing(self.links.send_end("bw", to), grad_in, None, prev, to)
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
        except _BufferMiss:
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
            return self.links.outgoing(end, out, ids, nxt, to)

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

    def _call(self, info: stage_pb2.CallInfo, method: str, items: Iterator[bytes], retry_on: str | None = None):
        address = info.route[info.stage]
        counted = _Counted(items)
        try:
            reply = getattr(self.connector.stage(address), method)(iter(counted), timeout=_deadline(info))
        except grpc.RpcError as e:
            if (
                retry_on is not None
                and e.code() == grpc.StatusCode.FAILED_PRECONDITION
                and retry_on in (e.details() or "")
            ):
                raise _BufferMiss() from e
            raise name_failure(e, info.stage, info.route_peers[info.stage], address) from e
        return reply, counted.nbytes

    def _neighbour(self, info: stage_pb2.CallInfo, stage: int) -> stage_pb2.CallInfo:
        out = stage_pb2.CallInfo()
        out.CopyFrom(info)
        out.stage = stage
        return out

    def _labels_for(self, info: stage_pb2.CallInfo, inputs: torch.Tensor) -> torch.Tensor:
        targets = self.labels.pop((info.step, info.micro_batch), None)
        if targets is None:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"no labels for step {info.step} micro-batch {info.micro_batch}"
            )
        if targets.shape != inputs.shape[:2]:
            raise WireError("labels.shape", f"{list(targets.shape)} vs inputs {list(inputs.shape[:2])}")
        return targets

    def _turn(self, info: stage_pb2.CallInfo, kind: Kind):
        return self.gate.turn(
            info.step,
            kind,
            info.micro_batch,
            info.schedule or "1f1b",
            info.num_micro_batches or 1,
            timeout_s=_deadline(info),
        )

    # ---- once per step ----------------------------------------------------------------------------------

    def put_labels(self, info: stage_pb2.CallInfo, labels: stage_pb2.TokenBatch) -> None:
        if not self.role.is_last:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.role.stage} is not the last stage")
        if len(self.labels) >= MAX_PENDING_LABELS:
            raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_PENDING_LABELS} label batches pending")
        targets, _ = tokens_from_wire(labels, self.model.vocab_size, self.model.seq_len_tokens)
        self.labels[(info.step, info.micro_batch)] = targets

    def grads(self) -> stage_pb2.GradReply:
        """This stage's tied-embedding gradient (if tied across stages) and its other gradients' squared norm."""
        tied = self.worker.module.tied_parameter() if self.role.n_stages > 1 else None
        sq = 0.0
        for p in self.worker.module.parameters():
            if p.grad is not None and p is not tied:
                sq += float(p.grad.detach().float().pow(2).sum())
        reply = stage_pb2.GradReply(grad_sq_norm=sq)
        if tied is not None:
            reply.tied_grad.CopyFrom(make_codec(CodecConfig("fp32")).encode(self.worker.tied_grad()))
        return reply

    def step(self, request: stage_pb2.StepRequest) -> float:
        """Applies the summed tied gradient and steps the optimizer (or abandons the step's gradients)."""
        lr = 0.0
        with self.compute_lock:
            if request.abandon:
                self.worker.zero_grad()
            else:
                self._check_step(request)
                if request.HasField("tied_grad_sum"):
                    self.worker.set_tied_grad(self._tied_sum(request))
                lr = self.worker.step(request.global_grad_norm)
                self.steps_done += 1
                self._step_metrics()
            self.links.end_step()
            self.gate.reset()
            self.open_step = None
            self.labels = {k: v for k, v in self.labels.items() if k[0] > request.step}
        if self.on_step is not None and not request.abandon:
            self.on_step(self)
        return lr

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

    def _tied_sum(self, request: stage_pb2.StepRequest) -> torch.Tensor:
        tied = self.worker.module.tied_parameter()
        if tied is None:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "this stage holds no tied embedding")
        grad = make_codec(CodecConfig("fp32")).decode(request.tied_grad_sum, limits=self.limits)
        if grad.shape != tied.shape:
            raise WireError("tied_grad_sum.shape", f"{list(grad.shape)}, expected {list(tied.shape)}")
        return grad

    # ---- state ------------------------------------------------------------------------------------------

    def status(self) -> stage_pb2.StatusReply:
        """What this stage is and has done; `metrics` holds its counters and gauges (not the histograms'
        buckets), the figures `swarm status` shows."""
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
        )

    def state_items(self) -> Iterator[stage_pb2.StateItem]:
        """The stage's parameters as named fp32 tensors, for handing the stage over to another peer."""
        codec = make_codec(CodecConfig("fp32"))
        for name, tensor in self.worker.state_dict().items():
            for chunk in frame(codec.encode(tensor.float()), zstd_level=0):
                yield stage_pb2.StateItem(name=name, chunk=chunk)

    def close(self) -> None:
        self.connector.close()


class _BufferMiss(Exception):
    pass


class _Counted:
    """Counts the bytes of the serialized items a stream yields."""

    def __init__(self, items: Iterator[bytes]):
        self.items, self.nbytes = items, 0

    def __iter__(self):
        for item in self.items:
            self.nbytes += len(item)
            yield item


def _deadline(info: stage_pb2.CallInfo) -> float:
    return info.deadline_s or DEFAULT_DEADLINE_S
