"""How a stage host or a trainer reaches a stage: over gRPC, or in-process, through one client interface.

A `Connector` hands out a `StageClient` per address; with a `CallSigner`, every call carries the signer's
token for the callee's peer id (`swarm.net.auth`), given by the caller or looked up by address, and a proof
signing that call's method and fields (its request, or its stream's first item, peeked before the call starts),
so a captured call cannot be sent again or turned into another. The gRPC
connector wraps channels and stubs; the in-process one (`LocalNetwork`) calls the registered servicer of
that address directly, with the same serialized stream items, metadata and errors (`grpc.RpcError` with a
code and details), so everything above this module runs unchanged in one process or across peers: the
convergence experiment and the unit tests exercise the code the swarm runs. One difference: over gRPC a Forward or
Backward of one item goes as its unary twin (`_one_item`), which spares gRPC's client a thread per call; in
process it stays the stream it was called as.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import grpc

from swarm.net.stream import METHODS, ONE_ITEM, STAGE_SERVICE, bind_method, message_type
from swarm.peers.transport import Channels, TransportConfig
from swarm.proto import stage_pb2

if TYPE_CHECKING:
    from swarm.net.auth import CallSigner

__all__ = [
    "Connector",
    "GrpcConnector",
    "LocalNetwork",
    "LocalRpcError",
    "SignedChannels",
    "StageClient",
    "method_path",
    "status_of",
]

Metadata = tuple[tuple[str, bytes], ...]
Resolve = Callable[[str], "str | None"]
"""address -> peer id of the stage there (None: unknown), for calls whose caller names no peer id"""
Sign = Callable[[str, Any], Metadata]
"""(method path, the call's fields: its request or its stream's first item) -> the call's metadata"""


class StageClient(Protocol):
    """The stage service as its callers see it. Tensor streams take serialized `StreamItem`s."""

    def Forward(self, items: Iterable[bytes], timeout: float | None = None) -> stage_pb2.ForwardReply: ...
    def Backward(self, items: Iterable[bytes], timeout: float | None = None) -> stage_pb2.BackwardReply: ...
    def Sink(self, items: Iterable[bytes], timeout: float | None = None) -> stage_pb2.Traffic: ...
    def PutLabels(self, request: stage_pb2.LabelsRequest, timeout: float | None = None) -> stage_pb2.Empty: ...
    def Grads(self, request: stage_pb2.StepRequest, timeout: float | None = None) -> stage_pb2.GradReply: ...
    def Step(self, request: stage_pb2.StepRequest, timeout: float | None = None) -> stage_pb2.StepReply: ...
    def Status(self, request: stage_pb2.Empty, timeout: float | None = None) -> stage_pb2.StatusReply: ...
    def Ping(self, request: stage_pb2.PingRequest, timeout: float | None = None) -> stage_pb2.Empty: ...
    def Probe(self, request: stage_pb2.ProbeRequest, timeout: float | None = None) -> stage_pb2.ProbeReply: ...
    def GetState(self, request: stage_pb2.StateRequest, timeout: float | None = None) -> Iterator: ...
    def Reduce(self, request: stage_pb2.ReduceRequest, timeout: float | None = None) -> stage_pb2.ReduceReply: ...
    def Average(self, items: Iterable[bytes], timeout: float | None = None) -> stage_pb2.Traffic: ...
    def Audit(self, request: stage_pb2.AuditRequest, timeout: float | None = None) -> stage_pb2.AuditReply: ...
    def Recompute(
        self, request: stage_pb2.RecomputeRequest, timeout: float | None = None
    ) -> stage_pb2.RecomputeReply: ...
    def AuditInputs(self, request: stage_pb2.AuditRequest, timeout: float | None = None) -> stage_pb2.AuditReply: ...
    # the one-item twins: `Forward` and `Backward` call them for a stream of one item (`_one_item`)
    def ForwardItem(self, item: bytes, timeout: float | None = None) -> stage_pb2.ForwardReply: ...
    def BackwardItem(self, item: bytes, timeout: float | None = None) -> stage_pb2.BackwardReply: ...


class Connector(Protocol):
    def stage(self, address: str, peer_id: str | None = None) -> StageClient: ...
    def close(self) -> None: ...


def _token_source(signer: CallSigner | None, peer_id: str | None) -> Sign | None:
    """What a call to `peer_id` carries: the signer's token for it and the call's proof, or None: nothing
    (anonymous, refused where authentication is on; a stream is then not peeked)."""
    if signer is None or not peer_id:
        return None
    return lambda method, fields: signer.metadata(peer_id, method, fields)


def _peek(items: Iterable) -> tuple[Iterator, Any]:
    """(the same items, the first of them or None): a stream's proof signs its first item."""
    items = iter(items)
    first = next(items, None)
    return (iter(()) if first is None else itertools.chain((first,), items)), first


def _one_item(name: str, request: Any, twins: bool = True) -> tuple[str, Any]:
    """The method and request a call of `name` goes as: with `twins`, a stream of `ONE_ITEM` that holds one item
    goes as its unary twin with that item. Known from the request alone, never by reading ahead: a list or tuple of
    one item, or a stream that says so once its first item is out (`one_item()`: `tensor_items`' `ItemStream`,
    `Outbox`'s counter around it). Any other stream goes as it is (a list of `ONE_ITEM`'s as an iterator, which gRPC
    takes)."""
    twin = ONE_ITEM.get(name)
    if twin is None:
        return name, request
    if isinstance(request, (list, tuple)):
        return (twin, request[0]) if twins and len(request) == 1 else (name, iter(request))
    one_item = getattr(request, "one_item", None)
    if not twins or one_item is None:
        return name, request
    items = iter(request)
    first = next(items, None)
    if first is None:
        return name, iter(())
    if one_item():
        return twin, first
    return name, itertools.chain((first,), items)


def method_path(name: str) -> str:
    """The gRPC path of the stage service's method `name` ("/swarm.Stage/Step"): what a call's proof signs."""
    return f"/{STAGE_SERVICE.full_name}/{name}"


class GrpcConnector:
    """Stage clients over gRPC channels, one channel per address, reused by every call to it.

    Args:
        transport: channel options.
        signer: signs every call for its callee (None: calls are anonymous).
        resolve: the peer id at an address, for `stage(address)` without one (e.g. from the plan's roster).
        dial: announced address -> address to dial (`swarm.net.relay.Tunnels.dial` for peers behind NAT).
    """

    def __init__(
        self,
        transport: TransportConfig | None = None,
        signer: CallSigner | None = None,
        resolve: Resolve | None = None,
        dial: Callable[[str], str] | None = None,
    ):
        self.channels = Channels(transport or TransportConfig(), dial)
        self.signer, self.resolve = signer, resolve
        self._clients: dict[tuple[str, str | None], _GrpcStage] = {}
        self._lock = threading.Lock()

    def stage(self, address: str, peer_id: str | None = None) -> StageClient:
        if peer_id is None and self.resolve is not None and self.signer is not None:
            peer_id = self.resolve(address)
        with self._lock:
            key = (address, peer_id)
            if key not in self._clients:
                if len(self._clients) > 4096:  # peers come and go: forget old clients (channels stay cached)
                    self._clients.clear()
                channel = functools.partial(self.channels.get, address)
                self._clients[key] = _GrpcStage(channel, _token_source(self.signer, peer_id))
            return self._clients[key]

    def close(self) -> None:
        with self._lock:
            self._clients.clear()
        self.channels.close()


def status_of(channel: grpc.Channel, timeout_s: float) -> stage_pb2.StatusReply:
    """The Status of the stage service on `channel` (a raw channel, or one whose calls are signed)."""
    return bind_method(channel, METHODS["Status"])(stage_pb2.Empty(), timeout=timeout_s)


class _GrpcStage:
    """A stage's signed calls on the channel `channel()` gives at each call: `Channels.get` makes a new channel
    when the address's dial target changed (a peer announced a relay, or left it), and a client held across
    that (a driver keeps its clients for a whole plan) would otherwise call on the closed old channel for good."""

    def __init__(self, channel: Callable[[], grpc.Channel], token: Sign | None):
        self._channel, self._token = channel, token
        self._bound: tuple[grpc.Channel | None, dict[str, Callable]] = (None, {})
        self._streams_only = False
        """set once the stage answered a one-item twin UNIMPLEMENTED (an older peer): streams from then on"""
        self._lock = threading.Lock()

    def _methods(self) -> dict[str, Callable]:
        channel = self._channel()
        with self._lock:
            if self._bound[0] is not channel:
                self._bound = (channel, {name: bind_method(channel, method) for name, method in METHODS.items()})
            return self._bound[1]

    def __getattr__(self, name: str):
        method = METHODS.get(name)
        if method is None:
            raise AttributeError(name)

        def call(request, timeout: float | None = None):
            used, request = _one_item(name, request, twins=not self._streams_only)
            try:
                return self._call(used, request, timeout)
            except grpc.RpcError as e:
                if used == name or e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
            # a peer of an older version serves no twins: the item goes as the stream it stands for, and every
            # later call to it as a stream
            self._streams_only = True
            return self._call(name, iter([request]), timeout)

        return call

    def _call(self, name: str, request, timeout: float | None):
        metadata: Metadata = ()
        if self._token is not None:
            if METHODS[name].client_streaming:
                request, fields = _peek(request)
            else:
                fields = request
            metadata = self._token(method_path(name), fields)
        return self._methods()[name](request, timeout=timeout, metadata=metadata)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds a call token and the call's proof to every call on a channel (for code that uses raw stubs on
    `Channels`)."""

    def __init__(self, token: Sign):
        self.token = token

    def _details(self, details, fields):
        metadata = (*tuple(details.metadata or ()), *self.token(details.method, fields))
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details, request), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, request), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        request_iterator, first = _peek(request_iterator)
        return continuation(self._details(details, first), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        request_iterator, first = _peek(request_iterator)
        return continuation(self._details(details, first), request_iterator)


class SignedChannels:
    """`Channels` whose every call carries `signer`'s token for the peer at the address (`resolve`), for the
    daemon's link probes and state transfers, which use raw stubs."""

    def __init__(self, channels: Channels, signer: CallSigner, resolve: Resolve):
        self.channels, self.signer, self.resolve = channels, signer, resolve
        self.config = channels.config
        self._signed: dict[str, tuple[grpc.Channel, grpc.Channel]] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        raw = self.channels.get(address)  # a new channel when the address's dial target changed
        with self._lock:
            cached = self._signed.get(address)
            if cached is None or cached[0] is not raw:

                def token(method: str, fields, address=address) -> Metadata:
                    sign = _token_source(self.signer, self.resolve(address))
                    return () if sign is None else sign(method, fields)

                cached = self._signed[address] = (raw, grpc.intercept_channel(raw, _TokenInterceptor(token)))
            return cached[1]

    def close(self) -> None:
        with self._lock:
            self._signed.clear()
        self.channels.close()


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

    def __init__(self, metadata: Metadata = ()):
        self._metadata = metadata

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def add_callback(self, callback) -> bool:
        """In-process callers never vanish mid-call: nothing to watch."""
        return True

    def time_remaining(self) -> float | None:
        """Timeouts are not enforced in process: no deadline."""
        return None

    def abort(self, code: grpc.StatusCode, details: str):
        raise LocalRpcError(code, details)

    def peer(self) -> str:
        return "local"


class LocalNetwork:
    """In-process connector: addresses map to servicers registered with `register`.

    Calls run in the caller's thread (a gRPC server would run them in its pool), stream items are parsed
    from their serialized bytes exactly as gRPC would hand them to the servicer, and a servicer's abort
    reaches the caller as a `LocalRpcError`. Timeouts are not enforced here; the stages' own waits are.
    The network itself calls anonymously; `connector(signer)` gives a caller whose calls carry its tokens,
    handed to the servicer as gRPC would (`context.invocation_metadata()`).
    """

    def __init__(self, signer: CallSigner | None = None, _servicers: dict | None = None, _peers: dict | None = None):
        self.signer = signer
        self._servicers: dict[str, Any] = {} if _servicers is None else _servicers
        self._peers: dict[str, str] = {} if _peers is None else _peers

    def register(self, address: str, servicer: Any, peer_id: str | None = None) -> None:
        """Serves `servicer` at `address`; `peer_id` is whom calls to that address are signed for."""
        self._servicers[address] = servicer
        if peer_id is not None:
            self._peers[address] = peer_id

    def unregister(self, address: str) -> None:
        """Stops serving `address`: calls to it fail from now on as to an unreachable peer (UNAVAILABLE)."""
        self._servicers.pop(address, None)

    def connector(self, signer: CallSigner | None) -> LocalNetwork:
        """The same network, as seen by a caller whose calls carry `signer`'s tokens."""
        return LocalNetwork(signer, self._servicers, self._peers)

    def stage(self, address: str, peer_id: str | None = None) -> StageClient:
        servicer = self._servicers.get(address)
        if servicer is None:
            return _Unreachable(address)
        return _LocalStage(servicer, _token_source(self.signer, peer_id or self._peers.get(address)))

    def close(self) -> None:
        pass


class _LocalStage:
    """A registered servicer's methods, called in the caller's thread: a client-streaming call's items are parsed
    from their serialized bytes, as gRPC would hand them to the servicer."""

    def __init__(self, servicer: Any, token: Sign | None):
        self._servicer, self._token = servicer, token

    def __getattr__(self, name: str):
        method = METHODS.get(name)
        if method is None:
            raise AttributeError(name)

        parse = message_type(method.input_type).FromString if method.client_streaming else None
        path = method_path(name)

        def call(request, timeout: float | None = None):
            # a stream stays a stream here, one item or many (`ONE_ITEM`'s twins spare gRPC's client a thread;
            # in process there is none to spare): the servicer gets the method it was called as
            if self._token is None:
                context = _LocalContext()
            elif parse is not None:
                request, first = _peek(request)
                context = _LocalContext(self._token(path, first))
            else:
                context = _LocalContext(self._token(path, request))
            if parse is not None:
                request = (parse(item) for item in request)
            elif isinstance(request, bytes):  # a twin called by name: its one item, parsed as gRPC would
                request = message_type(method.input_type).FromString(request)
            return getattr(self._servicer, name)(request, context)

        return call


class _Unreachable:
    """A client for an address nobody registered: every call fails as an unreachable gRPC peer would."""

    def __init__(self, address: str):
        self.address = address

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"no stage at {self.address}")

        return call
