"""A stage host's outbox: the calls it makes to its neighbours (the next stage's Forward, the previous stage's
Backward), what they carry and cost, and the route those calls leave out once the neighbour takes it from its
plan (`swarm.runtime.callinfo`).

A boundary call carries the route until a reply of the neighbour says `plan_route` (its validated roster of
this plan gives this call's route, `callinfo.plan_gives_route`); from then on, under that plan version, the call
info it sends leaves the route out. A neighbour that refuses a route-less call (`ROUTE_NEEDED`, e.g. it lost its
roster) gets the route for the rest of that plan; the refused call fails, the trainer runs the step again
(`callinfo.route_needed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import grpc
import torch

from swarm import trace
from swarm.metrics import Metrics
from swarm.net.connect import Connector
from swarm.net.stream import BUFFER_MISS, name_failure
from swarm.proto import stage_pb2
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.budget import StageBudget
from swarm.runtime.callinfo import ROUTE_NEEDED, RouteAcks, call_wait_s, info_to_wire
from swarm.runtime.messages import CallInfo

__all__ = ["BufferMiss", "Counted", "Outbox", "timed_phase"]

log = logging.getLogger("swarm.runtime.host")


class BufferMiss(Exception):
    """The next stage lost its AQ-SGD buffers for these samples: send them again in full."""


class Counted:
    """Counts the bytes of the serialized items a stream yields."""

    def __init__(self, items: Iterator[bytes]):
        self.items, self.nbytes = items, 0

    def one_item(self) -> bool:
        """Whether the first item held the whole message (`swarm.net.stream.ItemStream`; False if it cannot say)."""
        one_item = getattr(self.items, "one_item", None)
        return one_item is not None and one_item()

    def __iter__(self):
        for i, item in enumerate(self.items):  # when the transport takes the first and the last item, traced
            self.nbytes += len(item)
            if i == 0:
                trace.mark("first item", "call")
            yield item
        trace.mark("last item", "call")


class Outbox:
    """What one stage host sends along its routes, and the neighbours that take the route from their plan.

    Args:
        connector: how to reach the neighbouring stages.
        metrics: where the sent bytes, buffer hits and encode times are counted.
        budget: how long a call may wait downstream at most.
    """

    def __init__(self, connector: Connector, metrics: Metrics, budget: StageBudget):
        self.connector, self.metrics, self.budget = connector, metrics, budget
        self.acks = RouteAcks()
        """neighbours that take the route from their plan: boundary calls to them leave it out"""

    @staticmethod
    def to(info: CallInfo, stage: int) -> CallInfo:
        """`info` as the call to `stage` of the same route carries it."""
        return dataclasses.replace(info, stage=stage)

    def encode_forward(self, links: LinkEnds, out: torch.Tensor, ids: list[int], nxt: CallInfo):
        """The stream items of the activation `out` of samples `ids` for the next stage. Called in schedule order,
        holding the turn: the codec's state (stochastic rounding draws, AQ-SGD buffers) advances in the same order
        in every run, whatever the network's timing."""
        to = nxt.route[nxt.stage]
        end = links.send_end("fw", to)
        buffers = end.buffers
        if buffers is not None:  # AQ-SGD: buffered samples go as deltas, the others in full
            hits = sum(1 for i in ids if i in buffers)
            link = str(nxt.stage - 1)
            self.metrics.buffer_hits.labels(link).inc(hits)
            self.metrics.buffer_misses.labels(link).inc(len(ids) - hits)
        with self._phase(nxt.stage - 1, "encode"):
            return links.outgoing(end, out, ids, info_to_wire(self.wire_info(nxt)), to, step=nxt.step)

    def forward(
        self, links: LinkEnds, nxt: CallInfo, items: Iterator[bytes], out: torch.Tensor, ids: list[int]
    ) -> stage_pb2.ForwardReply:
        """Sends the activation's items; on a buffer miss at the next stage, re-sends these samples in full."""
        try:
            reply, sent = self.call(nxt, "Forward", items, retry_on=BUFFER_MISS)
        except BufferMiss:
            log.info("stage %d lost AQ-SGD buffers; re-sending %d samples in full", nxt.stage, len(ids))
            links.forget(ids, nxt.route[nxt.stage])
            # re-sending only the missed ids would desynchronise the others, whose sender-side m already moved
            reply, sent = self.call(nxt, "Forward", self.encode_forward(links, out, ids, nxt))
        self._count(reply.traffic, nxt.stage - 1, "forward", sent, 4 * out.numel())
        return reply

    def encode_backward(self, links: LinkEnds, grad_in: torch.Tensor, prev: CallInfo) -> Iterator[bytes]:
        """The stream items of the input gradient for the previous stage (in schedule order, as `encode_forward`)."""
        to = prev.route[prev.stage]
        with self._phase(prev.stage + 1, "encode"):
            # epilogue-only compression: a message a forward hides goes at the precise codec (`LinkEnds.backward_kind`)
            end = links.send_end(links.backward_kind(prev), to)
            return links.outgoing(end, grad_in, None, info_to_wire(self.wire_info(prev)), to, step=prev.step)

    def backward(self, prev: CallInfo, items: Iterator[bytes], grad_in: torch.Tensor):
        """Sends the input gradient's items to the previous stage."""
        reply, sent = self.call(prev, "Backward", items)
        self._count(reply.traffic, prev.stage, "backward", sent, 4 * grad_in.numel())
        return reply

    @staticmethod
    def answer(loss: float | None = None):
        """The reply to a call that ends at this stage: a Forward at the last stage (the micro-batch's `loss`), or a
        Backward that sends nothing on (`loss` None)."""
        return stage_pb2.BackwardReply() if loss is None else stage_pb2.ForwardReply(has_loss=True, loss=loss)

    def call(self, info: CallInfo, method: str, items: Iterator[bytes], retry_on: str | None = None):
        """`method` on the neighbour `info` names (its full route: `items` may carry the call info without it);
        the reply and the bytes sent."""
        address, peer = info.route[info.stage], info.route_peers[info.stage]
        counted = Counted(items)
        try:
            client = self.connector.stage(address, peer)  # the token names the callee
            with trace.span(f"call {method}", "call", stage=info.stage, step=info.step):
                reply = getattr(client, method)(counted, timeout=call_wait_s(info, self.budget))
        except grpc.RpcError as e:
            details = e.details() or ""
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(ROUTE_NEEDED):
                self.acks.refused(peer, info.plan_version)  # its own refusal: the route from now on
            if retry_on is not None and e.code() == grpc.StatusCode.FAILED_PRECONDITION and retry_on in details:
                raise BufferMiss() from e
            raise name_failure(e, info.stage, peer, address) from e
        if reply.plan_route:
            self.acks.acked(peer, info.plan_version, info.step)
        return reply, counted.nbytes

    def wire_info(self, info: CallInfo) -> CallInfo:
        """The call info as it goes to the neighbour: without the route once that neighbour takes it from its plan."""
        if self.acks.carry(info.route_peers[info.stage], info.plan_version, info.step):
            return info
        return dataclasses.replace(info, route=(), route_peers=())

    def close(self) -> None:
        self.connector.close()

    def _count(self, traffic: stage_pb2.Traffic, link: int, direction: str, sent: int, fp32: int) -> None:
        """Counts what this stage sent, in its metrics and in the reply that carries it back to the driver."""
        self.metrics.wire_bytes.labels(str(link), direction).inc(sent)
        self.metrics.fp32_bytes.labels(str(link), direction).inc(fp32)
        traffic.wire_bytes += sent
        traffic.fp32_wire_bytes += fp32
        traffic.link_bytes[link] += sent

    def _phase(self, stage: int, phase: str):
        return timed_phase(self.metrics, stage, phase)


@contextlib.contextmanager
def timed_phase(metrics: Metrics, stage: int, phase: str, span: str | None = None, **args):
    """Times a block as `phase` of `stage` (`swarm_phase_seconds`) and, where tracing is on, as a span named `span`
    (default `phase`): the stage's encode, decode and compute."""
    timer = metrics.phase_seconds.labels(str(stage), phase).time()
    with timer, trace.span(span or phase, "stage", stage=stage, **args):
        yield
