"""The trainer's side of a networked pipeline: drive one step across stage peers given their route.

Token ids go to stage 0 and labels to the last stage; activations and gradients then travel stage to stage
directly, never through the trainer. The trainer only collects each micro-batch's loss, and once per step
the tied embedding's two gradients (summed and sent back) and each stage's squared gradient norm.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from swarm.compression import CodecConfig, make_codec
from swarm.model.data import Batch
from swarm.net.stream import StageCallError, name_failure, tokens_to_wire
from swarm.peers.transport import Channels, TransportConfig
from swarm.proto import stage_pb2, stage_pb2_grpc


@dataclass(frozen=True)
class RemoteStepResult:
    loss: float
    grad_norm: float
    lr: float
    forward_bytes: int
    """bytes of activations on the wire during the step, all links"""
    backward_bytes: int
    """bytes of activation gradients on the wire during the step, all links"""
    fp32_wire_bytes: int
    """what the same tensors would have cost in fp32"""
    seconds: float
    link_bytes: tuple[int, ...] = ()
    """bytes on each link (link k joins stage k and k+1), both directions"""
    sync_bytes: int = 0
    """bytes of the tied embedding's gradient synchronisation (stages to trainer and back, fp32); these travel
    outside the stage links, so the application's link shaper does not pace them (the kernel testbed does)"""

    @property
    def wire_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


class RemotePipeline:
    """Drives training steps over the stage peers at `route` (gRPC addresses in pipeline order)."""

    def __init__(
        self,
        route: list[str],
        peers: list[str],
        schedule: str = "1f1b",
        n_micro: int = 4,
        deadline_s: float = 120.0,
        transport: TransportConfig | None = None,
        plan_version: int = 0,
    ):
        if len(route) != len(peers) or not route:
            raise ValueError("route and peers must name the same, non-zero number of stages")
        self.route, self.peers = list(route), list(peers)
        self.schedule, self.n_micro, self.deadline_s = schedule, n_micro, deadline_s
        self.plan_version = plan_version
        self.channels = Channels(transport or TransportConfig())
        self.stubs = [stage_pb2_grpc.StageStub(self.channels.get(a)) for a in route]
        self._pool = ThreadPoolExecutor(max_workers=max(2, n_micro), thread_name_prefix="trainer")
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

    def _micro_batch(self, step: int, mb: int, data: Batch) -> tuple[float, int, int, int, list[int]]:
        last = self.n_stages - 1
        labels = stage_pb2.LabelsRequest(info=self._info(step, mb, last), labels=tokens_to_wire(data.targets))
        self._call(last, self.stubs[last].PutLabels, labels)
        item = stage_pb2.StreamItem(info=self._info(step, mb, 0), tokens=tokens_to_wire(data.tokens, data.sample_ids))
        # communication: tokens into stage 0; the activations flow on to the last stage, the loss comes back
        fw = self._call(0, self.stubs[0].Forward, iter([item]))
        # communication: the backward starts at the last stage and flows back to stage 0
        bw = self._call(last, self.stubs[last].Backward, iter([stage_pb2.StreamItem(info=self._info(step, mb, last))]))
        fp32 = fw.traffic.fp32_wire_bytes + bw.traffic.fp32_wire_bytes
        links = [fw.traffic.link_bytes.get(k, 0) + bw.traffic.link_bytes.get(k, 0) for k in range(self.n_stages - 1)]
        return fw.loss, fw.traffic.wire_bytes, bw.traffic.wire_bytes, fp32, links

    def train_step(self, step: int, batch: Batch) -> RemoteStepResult:
        """One optimizer step on `batch`; raises StageCallError naming the stage and peer that failed."""
        start = time.perf_counter()
        micro = batch.split(self.n_micro)
        futures = [self._pool.submit(self._micro_batch, step, mb, data) for mb, data in enumerate(micro)]
        try:
            results = [f.result() for f in futures]
        except StageCallError:
            self.abandon(step)
            raise
        loss = sum(r[0] for r in results) / len(results)
        norm, lr, sync_bytes = self.finish_step(step)
        return RemoteStepResult(
            loss=loss,
            grad_norm=norm,
            lr=lr,
            forward_bytes=sum(r[1] for r in results),
            backward_bytes=sum(r[2] for r in results),
            fp32_wire_bytes=sum(r[3] for r in results),
            link_bytes=tuple(sum(r[4][k] for r in results) for k in range(self.n_stages - 1)),
            seconds=time.perf_counter() - start,
            sync_bytes=sync_bytes,
        )

    def finish_step(self, step: int) -> tuple[float, float, int]:
        """Sums the tied embedding's gradients, computes the global norm, steps every stage; returns the norm,
        the learning rate and the bytes the tied gradients took (both ways)."""
        request = stage_pb2.StepRequest(step=step)
        grads = list(self._pool.map(lambda s: self._call(s, self.stubs[s].Grads, request), range(self.n_stages)))
        sq = sum(g.grad_sq_norm for g in grads)
        tied_sum, sync_bytes = None, 0
        if self.n_stages > 1:
            # communication: the first and last stage's copies of the tied embedding get the same summed gradient
            first = self._fp32.decode(grads[0].tied_grad)
            last = self._fp32.decode(grads[-1].tied_grad)
            total = first + last
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
        self.channels.close()
