"""The trainer's side of a pipeline: drive one optimizer step across the stages of a route.

Token ids go to stage 0 and labels to the last stage; activations and gradients then travel stage to stage
directly, never through the driver. The driver only collects each micro-batch's loss, and once per step the
tied embedding's two gradients (summed and sent back) and each stage's squared gradient norm. The stages
are reached through a `Connector`: over gRPC in a swarm, in-process in `swarm.runtime.local`.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from swarm.compression import CodecConfig, make_codec
from swarm.metrics import Metrics, delta
from swarm.model.data import Batch
from swarm.net.connect import Connector, GrpcConnector
from swarm.net.stream import StageCallError, name_failure, tokens_to_wire
from swarm.proto import stage_pb2

if TYPE_CHECKING:
    from swarm.net.auth import CallSigner

__all__ = ["PipelineDriver", "StepResult", "Traffic"]


@dataclass
class Traffic:
    """Bytes on the stage links, as the stages counted them in their replies."""

    sent: dict[tuple[int, str], int] = field(default_factory=dict)
    """(link, direction) -> bytes; link k joins stage k and k+1, direction is forward or backward"""
    fp32_wire_bytes: int = 0
    """what the same tensors would have cost in fp32"""

    def add(self, reply: stage_pb2.Traffic, direction: str) -> None:
        self.fp32_wire_bytes += reply.fp32_wire_bytes
        for link, nbytes in reply.link_bytes.items():
            self.sent[(link, direction)] = self.sent.get((link, direction), 0) + nbytes

    def merge(self, other: Traffic) -> None:
        self.fp32_wire_bytes += other.fp32_wire_bytes
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
        """bytes on each link, both directions"""
        out: dict[int, int] = {}
        for (link, _), nbytes in self.sent.items():
            out[link] = out.get(link, 0) + nbytes
        return out


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    loss: float
    """Mean training loss of the mini-batch, as the last stage computed it (on decoded activations)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used."""
    traffic: Traffic
    """Bytes on the stage links during the step."""
    seconds: float
    """Wall time of the step."""
    sync_bytes: int = 0
    """Bytes of the tied embedding's gradient synchronisation (stages to the driver and back, fp32); these
    travel outside the stage links, so the application's link shaper does not pace them."""
    counters: dict[str, float] = field(default_factory=dict)
    """What every counter of the driver's metrics registry gained during the step (snapshot keys)."""

    @property
    def forward_bytes(self) -> int:
        return self.traffic.forward_bytes

    @property
    def backward_bytes(self) -> int:
        return self.traffic.backward_bytes

    @property
    def fp32_wire_bytes(self) -> int:
        return self.traffic.fp32_wire_bytes

    @property
    def wire_bytes(self) -> int:
        return self.traffic.forward_bytes + self.traffic.backward_bytes


@dataclass
class _MicroResult:
    loss: float
    traffic: Traffic


class PipelineDriver:
    """Drives training steps over the stages at `route` (addresses in pipeline order).

    Args:
        route: address of every stage, in pipeline order.
        peers: peer id of every stage (for errors).
        schedule: a name in `swarm.runtime.schedules.SCHEDULES`.
        n_micro: micro-batches per step.
        deadline_s: longest a micro-batch may take end to end.
        connector: how to reach the stages (default: gRPC, signed by `signer`).
        plan_version: the plan the stages follow.
        metrics: where the driver counts the steps' bytes, losses and times (default: its own registry).
        signer: the trainer's identity on the default gRPC connector (None: a fresh key, enough where any
            authenticated caller may train or ask for Status).
    """

    def __init__(
        self,
        route: list[str],
        peers: list[str],
        schedule: str = "1f1b",
        n_micro: int = 4,
        deadline_s: float = 120.0,
        connector: Connector | None = None,
        plan_version: int = 0,
        metrics: Metrics | None = None,
        signer: CallSigner | None = None,
    ):
        if len(route) != len(peers) or not route:
            raise ValueError("route and peers must name the same, non-zero number of stages")
        self.route, self.peers = list(route), list(peers)
        self.schedule, self.n_micro, self.deadline_s = schedule, n_micro, deadline_s
        self.plan_version = plan_version
        if connector is None and signer is None:
            from swarm.net.auth import CallSigner, Identity

            signer = CallSigner(Identity.generate())
        self.connector = connector or GrpcConnector(signer=signer)
        self.metrics = metrics or Metrics()
        # every call to a stage carries a token for that stage's peer id
        self.stubs = [self.connector.stage(a, p) for a, p in zip(self.route, self.peers, strict=True)]
        self._pool = ThreadPoolExecutor(max_workers=max(2, n_micro), thread_name_prefix="driver")
        self._fp32 = make_codec(CodecConfig("fp32"))

    @property
    def n_stages(self) -> int:
        return len(self.route)

    def _info(self, step: int, mb: int, stage: int) -> stage_pb2.CallInfo:
        return stage_pb2.CallInfo(
            step=step,
            micro_batch=mb,
            stage=stage,
            plan_version=self.plan_version,
            num_micro_batches=self.n_micro,
            schedule=self.schedule,
            route=self.route,
            route_peers=self.peers,
            deadline_s=self.deadline_s,
        )

    def _call(self, stage: int, fn, *args, timeout: float | None = None):
        try:
            return fn(*args, timeout=timeout or self.deadline_s)
        except grpc.RpcError as e:
            raise name_failure(e, stage, self.peers[stage], self.route[stage]) from e

    def _micro_batch(self, step: int, mb: int, data: Batch) -> _MicroResult:
        last = self.n_stages - 1
        labels = stage_pb2.LabelsRequest(info=self._info(step, mb, last), labels=tokens_to_wire(data.targets))
        self._call(last, self.stubs[last].PutLabels, labels)
        item = stage_pb2.StreamItem(info=self._info(step, mb, 0), tokens=tokens_to_wire(data.tokens, data.sample_ids))
        # communication: tokens into stage 0; the activations flow on to the last stage, the loss comes back
        fw = self._call(0, self.stubs[0].Forward, iter([item.SerializeToString()]))
        # communication: the backward starts at the last stage and flows back to stage 0
        start = stage_pb2.StreamItem(info=self._info(step, mb, last)).SerializeToString()
        bw = self._call(last, self.stubs[last].Backward, iter([start]))
        traffic = Traffic()
        traffic.add(fw.traffic, "forward")
        traffic.add(bw.traffic, "backward")
        return _MicroResult(fw.loss, traffic)

    def forward_backward(self, step: int, batch: Batch) -> tuple[float, Traffic]:
        """Every micro-batch's forward and backward (gradients accumulate on the stages); the mean loss and the
        bytes. Raises StageCallError naming the stage and peer that failed, after abandoning the step."""
        micro = batch.split(self.n_micro)
        futures = [self._pool.submit(self._micro_batch, step, mb, data) for mb, data in enumerate(micro)]
        try:
            results = [f.result() for f in futures]
        except StageCallError:
            self.abandon(step)
            raise
        traffic = Traffic()
        for r in results:
            traffic.merge(r.traffic)
        # the last stage weighs every micro-batch's loss by 1 / n_micro in its backward: the same mean here
        return sum(r.loss for r in results) / len(results), traffic

    def train_step(self, step: int, batch: Batch) -> StepResult:
        """One optimizer step on `batch`; raises StageCallError naming the stage and peer that failed."""
        m, start, before = self.metrics, time.perf_counter(), self.metrics.snapshot()
        loss, traffic = self.forward_backward(step, batch)
        norm, lr, sync_bytes = self.finish_step(step)
        seconds = time.perf_counter() - start
        for (link, direction), nbytes in traffic.sent.items():
            m.wire_bytes.labels(str(link), direction).inc(nbytes)
        m.fp32_bytes.labels("all", "both").inc(traffic.fp32_wire_bytes)
        m.sync_bytes.inc(sync_bytes)
        m.steps.inc()
        m.step_seconds.observe(seconds)
        m.loss.set(loss)
        m.plan_version.set(self.plan_version)
        counters = {k: v for k, v in delta(before, m.snapshot()).items() if "_total" in k and v}
        return StepResult(loss, norm, lr, traffic, seconds, sync_bytes, counters)

    def finish_step(self, step: int) -> tuple[float, float, int]:
        """Sums the tied embedding's gradients, computes the global norm, steps every stage; returns the norm,
        the learning rate and the bytes the tied gradients took (both ways)."""
        request = stage_pb2.StepRequest(step=step)
        grads = list(self._pool.map(lambda s: self._call(s, self.stubs[s].Grads, request), range(self.n_stages)))
        sq = sum(g.grad_sq_norm for g in grads)
        tied_sum, sync_bytes = None, 0
        if self.n_stages > 1:
            # communication: the first and last stage's copies of the tied embedding get the same summed gradient
            total = self._fp32.decode(grads[0].tied_grad) + self._fp32.decode(grads[-1].tied_grad)
            sq += float(total.pow(2).sum())
            tied_sum = self._fp32.encode(total)
            sync_bytes = grads[0].tied_grad.ByteSize() + grads[-1].tied_grad.ByteSize() + 2 * tied_sum.ByteSize()
        norm = math.sqrt(sq)

        def step_stage(s: int) -> float:
            req = stage_pb2.StepRequest(step=step, global_grad_norm=norm, plan_version=self.plan_version)
            if tied_sum is not None and s in (0, self.n_stages - 1):
                req.tied_grad_sum.CopyFrom(tied_sum)
            return self._call(s, self.stubs[s].Step, req).lr

        lrs = list(self._pool.map(step_stage, range(self.n_stages)))
        return norm, lrs[0], sync_bytes

    def abandon(self, step: int) -> None:
        """Best effort: tell every reachable stage to drop the step's gradients."""
        # a stage that is gone or busy is skipped: the caller already reports the failure that matters
        for stub in self.stubs:
            with contextlib.suppress(grpc.RpcError):
                stub.Step(stage_pb2.StepRequest(step=step, abandon=True), timeout=5)

    def status(self) -> list[stage_pb2.StatusReply]:
        return [self._call(s, stub.Status, stage_pb2.Empty(), timeout=10) for s, stub in enumerate(self.stubs)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.connector.close()
