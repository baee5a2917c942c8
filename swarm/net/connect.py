"""How a stage host or a trainer reaches a stage: over gRPC, or in-process, through one client interface.

A `Connector` hands out a `StageClient` per address. The gRPC connector wraps channels and stubs; the
in-process one (`LocalNetwork`) calls the registered servicer of that address directly, with the same
serialized stream items and the same errors (`grpc.RpcError` with a code and details), so everything above
this module runs unchanged in one process or across peers: the convergence experiment and the unit tests
exercise the code the swarm runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import grpc

from swarm.net.stream import TensorStreams
from swarm.peers.transport import Channels, TransportConfig
from swarm.proto import stage_pb2, stage_pb2_grpc

__all__ = ["Connector", "GrpcConnector", "LocalNetwork", "LocalRpcError", "StageClient"]


class StageClient(Protocol):
    """The stage service as its callers see it. Tensor streams take serialized `StreamItem`s."""

    def Forward(self, items: Iterable[bytes], timeout: float | None = None) -> stage_pb2.ForwardReply: ...
    def Backward(self, items: Iterable[bytes], timeout: float | None = None) -> stage_pb2.BackwardReply: ...
    def Sink(self, items: Iterable[bytes], timeout: float | None = None) -> stage_pb2.Traffic: ...
    def PutLabels(self, request: stage_pb2.LabelsRequest, timeout: float | None = None) -> stage_pb2.Empty: ...
    def Grads(self, request: stage_pb2.StepRequest, timeout: float | None = None) -> stage_pb2.GradReply: ...
    def Step(self, request: stage_pb2.StepRequest, timeout: float | None = None) -> stage_pb2.StepReply: ...
    def Status(self, request: stage_pb2.Empty, timeout: float | None = None) -> stage_pb2.StatusReply: ...
    def Probe(self, request: stage_pb2.ProbeRequest, timeout: float | None = None) -> stage_pb2.ProbeReply: ...
    def GetState(self, request: stage_pb2.StateRequest, timeout: float | None = None) -> Iterator: ...


class Connector(Protocol):
    def stage(self, address: str) -> StageClient: ...
    def close(self) -> None: ...


class GrpcConnector:
    """Stage clients over gRPC channels, one channel per address, reused by every call to it."""

    def __init__(self, transport: TransportConfig | None = None):
        self.channels = Channels(transport or TransportConfig())
        self._clients: dict[str, _GrpcStage] = {}
        self._lock = threading.Lock()

    def stage(self, address: str) -> StageClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = _GrpcStage(self.channels.get(address))
            return self._clients[address]

    def close(self) -> None:
        with self._lock:
            self._clients.clear()
        self.channels.close()


class _GrpcStage:
    def __init__(self, channel: grpc.Channel):
        stub, streams = stage_pb2_grpc.StageStub(channel), TensorStreams(channel)
        self.Forward, self.Backward, self.Sink = streams.Forward, streams.Backward, streams.Sink
        self.PutLabels, self.Grads, self.Step = stub.PutLabels, stub.Grads, stub.Step
        self.Status, self.Probe, self.GetState = stub.Status, stub.Probe, stub.GetState


class LocalRpcError(grpc.RpcError):
    """What an in-process call fails with: the same code and details a gRPC client would see."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _LocalContext:
    """The part of `grpc.ServicerContext` the stage servicer uses."""

    def abort(self, code: grpc.StatusCode, details: str):
        raise LocalRpcError(code, details)

    def peer(self) -> str:
        return "local"


class LocalNetwork:
    """In-process connector: addresses map to servicers registered with `register`.

    Calls run in the caller's thread (a gRPC server would run them in its pool), stream items are parsed
    from their serialized bytes exactly as gRPC would hand them to the servicer, and a servicer's abort
    reaches the caller as a `LocalRpcError`. Timeouts are not enforced here; the stages' own waits are.
    """

    def __init__(self):
        self._servicers: dict[str, Any] = {}

    def register(self, address: str, servicer: Any) -> None:
        self._servicers[address] = servicer

    def stage(self, address: str) -> StageClient:
        servicer = self._servicers.get(address)
        if servicer is None:
            return _Unreachable(address)
        return _LocalStage(servicer)

    def close(self) -> None:
        pass


class _LocalStage:
    def __init__(self, servicer: Any):
        self._servicer = servicer

    def _stream(name: str):
        def call(self, items: Iterable[bytes], timeout: float | None = None):
            parsed = (stage_pb2.StreamItem.FromString(item) for item in items)
            return getattr(self._servicer, name)(parsed, _LocalContext())

        return call

    def _unary(name: str):
        def call(self, request, timeout: float | None = None):
            return getattr(self._servicer, name)(request, _LocalContext())

        return call

    Forward, Backward, Sink = _stream("Forward"), _stream("Backward"), _stream("Sink")
    PutLabels, Grads, Step = _unary("PutLabels"), _unary("Grads"), _unary("Step")
    Status, Probe, GetState = _unary("Status"), _unary("Probe"), _unary("GetState")


class _Unreachable:
    """A client for an address nobody registered: every call fails as an unreachable gRPC peer would."""

    def __init__(self, address: str):
        self.address = address

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"no stage at {self.address}")

        return call
