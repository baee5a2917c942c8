"""A stage host's calls to its neighbours (the next stage's Forward, the previous stage's Backward), and the
route those calls leave out once the neighbour has said it takes it from its plan (`swarm.runtime.callinfo`).

A boundary call carries the route until a reply of the neighbour says `plan_route` (its validated roster of
this plan gives this call's chain, `callinfo.plan_gives_route`); from then on, under that plan version, the call
info it sends leaves the route out. A neighbour that refuses a route-less call (`ROUTE_NEEDED`, e.g. it lost its
roster) gets the route for the rest of that plan; the refused call fails, the trainer runs the step again
(`callinfo.route_needed`).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from swarm.net.stream import name_failure
from swarm.proto import stage_pb2
from swarm.runtime.callinfo import ROUTE_NEEDED, RouteAcks

__all__ = ["BufferMiss", "Counted", "NeighbourCalls"]


class BufferMiss(Exception):
    """The next stage lost its AQ-SGD buffers for these samples: send them again in full."""


class Counted:
    """Counts the bytes of the serialized items a stream yields."""

    def __init__(self, items: Iterator[bytes]):
        self.items, self.nbytes = items, 0

    def __iter__(self):
        for item in self.items:
            self.nbytes += len(item)
            yield item


class NeighbourCalls:
    """The host's side (a mixin of `StageHost`); uses its `connector`, `_deadline` and `_route_acks`."""

    _route_acks: RouteAcks

    def _call(self, info: stage_pb2.CallInfo, method: str, items: Iterator[bytes], retry_on: str | None = None):
        """`method` on the neighbour `info` names (its full route: `items` may carry the call info without it);
        the reply and the bytes sent."""
        address, peer = info.route[info.stage], info.route_peers[info.stage]
        counted = Counted(items)
        try:
            client = self.connector.stage(address, peer)  # the token names the callee
            reply = getattr(client, method)(iter(counted), timeout=self._deadline(info))
        except grpc.RpcError as e:
            details = e.details() or ""
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(ROUTE_NEEDED):
                self._route_acks.refused(peer, info.plan_version)  # its own refusal: the route from now on
            if retry_on is not None and e.code() == grpc.StatusCode.FAILED_PRECONDITION and retry_on in details:
                raise BufferMiss() from e
            raise name_failure(e, info.stage, peer, address) from e
        if reply.plan_route:
            self._route_acks.acked(peer, info.plan_version, info.step)
        return reply, counted.nbytes

    def _neighbour(self, info: stage_pb2.CallInfo, stage: int) -> stage_pb2.CallInfo:
        out = stage_pb2.CallInfo()
        out.CopyFrom(info)
        out.stage = stage
        return out

    def _wire_info(self, info: stage_pb2.CallInfo) -> stage_pb2.CallInfo:
        """The call info as it goes to the neighbour: without the route once that neighbour takes it from its plan."""
        if self._route_acks.carry(info.route_peers[info.stage], info.plan_version, info.step):
            return info
        out = stage_pb2.CallInfo()
        out.CopyFrom(info)
        out.ClearField("route")
        out.ClearField("route_peers")
        return out
