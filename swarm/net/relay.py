"""Serving without an inbound port: relayed byte tunnels for peers behind NAT.

A peer P that nobody can dial keeps an outbound `Attach` stream open to a reachable peer R (`Attachment`).
A caller C that wants P dials a 127.0.0.1 listener of its own (`Tunnels`) in place of P's announced address;
each TCP connection accepted there becomes a `Connect(target=P)` stream on R. R asks P over the Attach to
open a fresh outbound `Accept(conn_id)` stream, and pipes the frames of the two streams into each other
(`RelayServicer`). On P, each Accept is piped to a TCP connection to P's own gRPC server. So gRPC runs end
to end, unchanged, inside the tunnel: C's calls stay signed for P and are checked by P; R forwards bytes it
can neither read as calls nor forge. When C is R itself (P's pipeline neighbour is its relay), the tunnel
opens the pipe inside R's process: the reverse connection, no extra hop.

Bounds (`RelayLimits`): attached peers, connections per attached peer and in all, bytes per frame, how long
P may take to accept. Only P can attach as P (the Attach is signed by P's key) and only while P announces R
as its relay (`may_attach`); a connection to a peer that is not attached is refused (NOT_FOUND); a newer
Attach of the same peer replaces the older (a restarted P is not locked out by its own dead stream). A
relay that dies ends every tunnel through it, so the calls inside fail with UNAVAILABLE and the driver's
reroute and repair take over. R paces relayed bytes by its shaper per destination, and counts them as
`swarm_relayed_bytes_total{link="<src>-><dst>"}`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import grpc

from swarm.peers.transport import TransportConfig
from swarm.proto import stage_pb2, stage_pb2_grpc

if TYPE_CHECKING:
    from swarm.metrics import Metrics
    from swarm.net.auth import CallSigner, CallVerifier
    from swarm.net.reach import DialBackHelper, NonceBook
    from swarm.peers.shaper import LinkShaping

__all__ = ["Attachment", "RelayError", "RelayLimits", "RelayRoute", "RelayServicer", "Tunnels"]

log = logging.getLogger("swarm.relay")

READ_BYTES = 256 << 10
"""Bytes read from a socket per frame (a frame carries at most `RelayLimits.max_frame_bytes`)."""


@dataclass(frozen=True)
class RelayLimits:
    """What one relay serves at most."""

    max_attached: int = 8
    """peers attached at once"""
    conns_per_peer: int = 16
    """open connections to one attached peer (each caller's channel holds one)"""
    max_conns: int = 32
    """open connections through this relay in all"""
    conns_per_caller: int = 4
    """open connections of one caller to one attached peer (a gRPC channel holds one; a stranger cannot take
    the attached peer's every slot)"""
    max_frame_bytes: int = 1 << 20
    """data bytes of one frame; a larger frame ends its connection (INVALID_ARGUMENT)"""
    accept_timeout_s: float = 5.0
    """how long the attached peer may take to open the Accept of a new connection"""
    keepalive_s: float = 15.0
    """an Attach stream carries an empty message this often (NAT mappings forget idle flows)"""
    attach_wait_s: float = 5.0
    """how long a Connect waits for the Attach of a target that announces this relay but has not attached yet
    (it is moving here from another relay, or reattaching after a drop)"""
    max_waiting: int = 8
    """Connects waiting for such an Attach at once (beyond: NOT_FOUND at once)"""
    attach_connect_s: float = 3.0
    """how long an Attach waits for its relay's connection: a relay that announces reach=direct before its own
    check found it behind NAT drops the SYN, and gRPC's own connect timeout (~10 s) kept the peer unreached
    long enough for the planner to drop it (`swarm experiment nat --netns`)"""

    def threads(self) -> int:
        """Server threads the relay may hold: one per Attach, two per connection (Connect and Accept)."""
        return self.max_attached + 2 * self.max_conns


class RelayError(Exception):
    """A relay refused or lost a connection: the gRPC status code and what happened."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Attached:
    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.requests: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.conns = 0
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        self.requests.put(None)


class _Pending:
    def __init__(self, caller: str, target: str, frames: Iterator):
        self.caller, self.target, self.frames = caller, target, frames
        self.accepted = threading.Event()
        self.accept_frames: Iterator | None = None
        self.error: RelayError | None = None
        """why one leg failed: the other leg ends with the same error, not as a clean close"""

    def pipe(self, frames: Iterator) -> Iterator:
        try:
            yield from frames
        except RelayError as e:
            self.error = self.error or e
        if self.error is not None:
            raise self.error


class RelayServicer(stage_pb2_grpc.RelayServicer):
    """The relay side (any reachable peer, unless --no-relay), plus the dial-back helper and the Echo of its
    own reachability check (`swarm.net.reach`), all on the `Relay` service beside the stage service.

    Args:
        peer_id: this peer's id (the relay's half of every link label).
        verifier: establishes each caller's peer id; without one every call is refused (a relay serves only
            peers it can name).
        may_attach: whether a peer may attach here (daemon: it announces reach="relay", relay=this peer).
        limits: bounds.
        shaping: paces forwarded bytes per destination (keyed by `address_of(peer)`, else the peer id).
        metrics: counts `relayed_bytes`.
        serve_relay: False (--no-relay): Attach and Connect are refused; DialBack and Echo still served.
        dial_back: the dial-back helper (None: DialBack refused).
        nonces: this peer's pending reachability nonces, answered by Echo.
    """

    def __init__(
        self,
        peer_id: str,
        verifier: CallVerifier | None,
        may_attach: Callable[[str], bool],
        limits: RelayLimits | None = None,
        shaping: LinkShaping | None = None,
        address_of: Callable[[str], str | None] = lambda peer: None,
        metrics: Metrics | None = None,
        serve_relay: bool = True,
        dial_back: DialBackHelper | None = None,
        nonces: NonceBook | None = None,
    ):
        self.peer_id, self.verifier, self.may_attach = peer_id, verifier, may_attach
        self.limits = limits or RelayLimits()
        self.shaping, self.address_of, self.metrics = shaping, address_of, metrics
        self.serve_relay, self.dial_back, self.nonces = serve_relay, dial_back, nonces
        self._attached: dict[str, _Attached] = {}
        self._pending: dict[int, _Pending] = {}
        self._conns = 0
        self._pairs: dict[tuple[str, str], int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        """notified when a peer attaches (Connects waiting for it)"""
        self._waiting = 0

    # ---- who calls --------------------------------------------------------------------------------------

    def _caller(self, context) -> str:
        from swarm.net.auth import AuthError

        if self.verifier is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this relay serves authenticated peers only")
        try:
            return self.verifier.caller(context.invocation_metadata())
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    def attached(self) -> list[str]:
        with self._lock:
            return sorted(self._attached)

    def holds(self, peer_id: str) -> bool:
        """Whether `peer_id` is attached here now."""
        with self._lock:
            return peer_id in self._attached

    # ---- reachability (swarm.net.reach) -----------------------------------------------------------------

    def DialBack(self, request, context):
        caller = self._caller(context)
        if self.dial_back is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer does not dial back")
        try:
            reached, detail = self.dial_back.dial_back(caller, bytes(request.nonce))
        except RelayError as e:
            context.abort(e.code, e.details)
        return stage_pb2.DialBackReply(reached=reached, detail=detail)

    def Echo(self, request, context):
        self._caller(context)
        known = self.nonces is not None and self.nonces.seen(bytes(request.nonce))
        return stage_pb2.EchoReply(known=known)

    # ---- relaying ---------------------------------------------------------------------------------------

    def Attach(self, request_iterator, context):
        caller = self._caller(context)
        if not self.serve_relay:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer does not relay (--no-relay)")
        if not self.may_attach(caller):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"peer {caller} does not announce relay={self.peer_id}")
        entry = _Attached(caller)
        with self._lock:
            old = self._attached.get(caller)
            if old is None and len(self._attached) >= self.limits.max_attached:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.limits.max_attached} peers attached")
            self._attached[caller] = entry
            self._arrived.notify_all()
        if old is not None:
            log.info("peer %s attached again: the newer Attach replaces the older", caller)
            old.close()
        context.add_callback(entry.close)
        log.info("peer %s attached", caller)
        try:
            yield stage_pb2.AttachDown(conn_id=0)  # accepted: the peer may announce this relay now
            while not entry.closed.is_set():
                try:
                    conn_id = entry.requests.get(timeout=self.limits.keepalive_s)
                except queue.Empty:
                    conn_id = 0
                if conn_id is None:
                    break
                yield stage_pb2.AttachDown(conn_id=conn_id)
        finally:
            with self._lock:
                if self._attached.get(caller) is entry:
                    del self._attached[caller]
            entry.close()
            log.info("peer %s detached", caller)

    def connect(self, caller: str, target: str, frames: Iterator) -> Iterator:
        """A connection from `caller` to the attached `target`: yields the target's `RelayFrame`s while `frames`
        (the caller's, the first already read) are piped to it. Raises RelayError when refused."""
        if not self.serve_relay:
            raise RelayError(grpc.StatusCode.UNAVAILABLE, "this peer does not relay (--no-relay)")
        pending = _Pending(caller, target, frames)
        self._await_attach(target)
        with self._lock:
            entry = self._attached.get(target)
            if entry is None:
                raise RelayError(grpc.StatusCode.NOT_FOUND, f"peer {target} is not attached to relay {self.peer_id}")
            pair = (caller, target)
            if (
                entry.conns >= self.limits.conns_per_peer
                or self._conns >= self.limits.max_conns
                or self._pairs.get(pair, 0) >= self.limits.conns_per_caller
            ):
                raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"relay {self.peer_id}: too many connections")
            entry.conns += 1
            self._conns += 1
            self._pairs[pair] = self._pairs.get(pair, 0) + 1
            conn_id = next(self._ids)
            self._pending[conn_id] = pending
        try:
            entry.requests.put(conn_id)
            if entry.closed.is_set() or not pending.accepted.wait(self.limits.accept_timeout_s):
                raise RelayError(grpc.StatusCode.UNAVAILABLE, f"peer {target} did not accept through relay")
            yield from pending.pipe(self._pipe(pending.accept_frames, src=target, dst=caller))
        finally:
            with self._lock:
                self._pending.pop(conn_id, None)
                entry.conns -= 1
                self._conns -= 1
                self._pairs[pair] -= 1
                if not self._pairs[pair]:
                    del self._pairs[pair]

    def _await_attach(self, target: str) -> None:
        """Waits (at most `attach_wait_s`, at most `max_waiting` Connects at once) for the Attach of a target that
        is not attached but announces this relay: a peer moving its Attach here announces first and attaches
        a moment later, and a caller that read the new announcement must not find it missing meanwhile."""
        with self._lock:
            if target in self._attached or self._waiting >= self.limits.max_waiting:
                return
        if not self.may_attach(target):  # a DHT read (rate-limited): outside the lock
            return
        deadline = time.monotonic() + self.limits.attach_wait_s
        with self._lock:
            self._waiting += 1
            try:
                while target not in self._attached and (left := deadline - time.monotonic()) > 0:
                    self._arrived.wait(left)
            finally:
                self._waiting -= 1

    def Connect(self, request_iterator, context):
        caller = self._caller(context)
        first = next(request_iterator, None)
        if first is None or not first.target or len(first.target) > 64 or first.data:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Connect's first frame names its target, nothing else")
        try:
            yield from self.connect(caller, first.target, request_iterator)  # frames as they came
        except RelayError as e:
            context.abort(e.code, e.details)

    def Accept(self, request_iterator, context):
        caller = self._caller(context)
        first = next(request_iterator, None)
        conn_id = 0 if first is None else first.conn_id
        with self._lock:
            pending = self._pending.get(conn_id)
            if pending is None or pending.target != caller or pending.accept_frames is not None:
                pending = None
            else:
                pending.accept_frames = request_iterator
        if pending is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no connection {conn_id} waits for peer {caller}")
        pending.accepted.set()
        try:
            yield from pending.pipe(self._pipe(pending.frames, src=pending.caller, dst=caller))
        except RelayError as e:
            context.abort(e.code, e.details)

    def _pipe(self, frames: Iterator, src: str, dst: str) -> Iterator:
        """`frames` (from `src`) as they came, each checked (data only, at most `max_frame_bytes`), paced toward
        `dst` and counted: forwarded without building a new message per frame (`swarm bench relay`)."""
        shaper = None
        if self.shaping is not None:
            shaper = self.shaping.for_destination(self.address_of(dst) or dst)
        counter = None if self.metrics is None else self.metrics.relayed_bytes.labels(f"{src}->{dst}")
        try:
            for frame in frames:
                n = len(frame.data)
                if n > self.limits.max_frame_bytes:
                    raise RelayError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"frame of {n} bytes exceeds {self.limits.max_frame_bytes} (from {src})",
                    )
                if frame.target or frame.conn_id:
                    raise RelayError(grpc.StatusCode.INVALID_ARGUMENT, f"frame of {n} bytes not data only (from {src})")
                if shaper is not None:
                    shaper.consume(n)
                if counter is not None:
                    counter.inc(n)
                yield frame
        except grpc.RpcError as e:  # the other leg's stream ended under us
            raise RelayError(grpc.StatusCode.UNAVAILABLE, f"relayed stream from {src} ended: {e}") from None


# ---- the two ends of a tunnel --------------------------------------------------------------------------


def _socket_frames(sock: socket.socket, first: stage_pb2.RelayFrame | None = None) -> Iterator:
    """RelayFrames of the bytes read from `sock` until it closes (after `first`)."""
    if first is not None:
        yield first
    while True:
        try:
            data = sock.recv(READ_BYTES)
        except OSError:
            return
        if not data:
            return
        yield stage_pb2.RelayFrame(data=data)


def _drain(replies: Iterator, sock: socket.socket) -> None:
    """Writes the data of `replies` (RelayFrames) to `sock` until either ends, then closes `sock`."""
    try:
        for reply in replies:
            sock.sendall(reply.data)
    except (grpc.RpcError, RelayError, OSError) as e:
        log.debug("tunnel closed: %s", e)
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


_CHANNEL_OPTIONS = TransportConfig().channel_options()


class _Unconnected(grpc.RpcError):
    """An Attach whose relay did not take the connection within `RelayLimits.attach_connect_s`."""

    def __init__(self, address: str, timeout_s: float):
        self._details = f"no connection to {address} within {timeout_s:g} s"
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class RelayRoute(NamedTuple):
    """How to reach a peer that cannot be dialed: its id, and its relay's id and address."""

    peer_id: str
    relay_id: str
    relay_address: str


class Tunnels:
    """The caller's end: one 127.0.0.1 listener per relayed peer, dialed by the channel pool in its place.

    Args:
        signer: signs the Connect calls for the relay.
        route: announced address -> how to reach the peer there (None: dial it directly). Read at each new
            connection, so a peer that moves to another relay is reached through the new one.
        local: this peer's own relay servicer: a peer attached to it is reached in process (reverse connection).
    """

    def __init__(
        self,
        signer: CallSigner | None,
        route: Callable[[str], RelayRoute | None],
        local: RelayServicer | None = None,
    ):
        self.signer, self.route, self.local = signer, route, local
        self.my_id = local.peer_id if local is not None else None
        self._channels: dict[str, grpc.Channel] = {}
        self._listeners: dict[str, tuple[socket.socket, str]] = {}
        self._lock = threading.Lock()

    def dial(self, address: str) -> str:
        """The address to dial for `address`: itself, or the local listener of its tunnel."""
        if self.route(address) is None:
            return address
        with self._lock:
            if address not in self._listeners:
                listener = socket.create_server(("127.0.0.1", 0))
                self._listeners[address] = (listener, f"127.0.0.1:{listener.getsockname()[1]}")
                threading.Thread(target=self._serve, args=(address, listener), name="swarm-tunnel", daemon=True).start()
            return self._listeners[address][1]

    def _relay_channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
            return self._channels[address]

    def _serve(self, address: str, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._carry, args=(address, sock), name="swarm-tunnel-conn", daemon=True).start()

    def _carry(self, address: str, sock: socket.socket) -> None:
        route = self.route(address)
        if route is None:  # it became dialable: callers will re-resolve on their next channel
            sock.close()
            return
        try:
            # the reverse connection: the peer attached here (its announced relay, or its second Attach to this
            # pipeline neighbour) is reached in this process
            if self.local is not None and (route.relay_id == self.my_id or self.local.holds(route.peer_id)):
                replies = self.local.connect(self.my_id, route.peer_id, _socket_frames(sock))
            else:
                metadata = self.signer.metadata(route.relay_id) if self.signer is not None else ()
                stub = stage_pb2_grpc.RelayStub(self._relay_channel(route.relay_address))
                replies = stub.Connect(
                    _socket_frames(sock, stage_pb2.RelayFrame(target=route.peer_id)), metadata=metadata
                )
        except Exception as e:
            log.warning("cannot open a tunnel to %s: %s", route.peer_id, e)
            sock.close()
            return
        _drain(replies, sock)

    def close(self) -> None:
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for listener, _ in listeners:
            listener.close()
        for channel in channels:
            channel.close()


class Attachment:
    """The unreachable peer's end: keeps an Attach open to its relay and opens an Accept, piped to its own
    gRPC server at `local_address`, for every connection the relay announces. Reattaches after a failure
    (backoff up to 5 s) until `close()`.

    Args:
        relay: () -> (relay peer id, relay address) to attach to now (re-read at every attempt).
        signer: signs the Attach and Accept calls for the relay.
        local_address: this peer's own gRPC server, as it listens (127.0.0.1 under --reach relay).
        on_fail: (relay id, status code or None) after an Attach to it failed or ended.
    """

    def __init__(
        self,
        relay: Callable[[], tuple[str, str] | None],
        signer: CallSigner,
        local_address: str,
        limits: RelayLimits | None = None,
        on_fail: Callable[[str, grpc.StatusCode | None], None] | None = None,
    ):
        self.relay, self.signer, self.local_address, self.on_fail = relay, signer, local_address, on_fail
        self.limits = limits or RelayLimits()
        self.attached = threading.Event()
        """set while the relay holds our Attach"""
        self.relay_id: str | None = None
        self._stop = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, name="swarm-attach", daemon=True)

    def start(self) -> Attachment:
        self._thread.start()
        return self

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            target = self.relay()
            if target is not None:
                relay_id, relay_address = target
                code = None
                try:
                    self._attach(relay_id, relay_address)
                    backoff = 0.2
                except grpc.RpcError as e:
                    code = e.code()
                    if not self._stop.is_set():
                        log.warning("attach to relay %s at %s failed: %s", relay_id, relay_address, e.details())
                finally:
                    self.attached.clear()
                if self.on_fail is not None and not self._stop.is_set():
                    self.on_fail(relay_id, code)
            self._stop.wait(backoff)
            backoff = min(5.0, backoff * 2)

    def _attach(self, relay_id: str, relay_address: str) -> None:
        stop = self._stop
        # keepalive: a relay that vanishes without a word is noticed within keepalive_s + keepalive_timeout_s
        with grpc.insecure_channel(relay_address, options=_CHANNEL_OPTIONS) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=self.limits.attach_connect_s)
            except grpc.FutureTimeoutError:
                raise _Unconnected(relay_address, self.limits.attach_connect_s) from None
            stub = stage_pb2_grpc.RelayStub(channel)
            metadata = self.signer.metadata(relay_id)

            def upstream():
                while not stop.wait(self.limits.keepalive_s):
                    yield stage_pb2.AttachUp(keepalive=True)

            self._call = stub.Attach(upstream(), metadata=metadata)
            for down in self._call:
                if not self.attached.is_set():
                    self.relay_id = relay_id
                    self.attached.set()
                    log.info("attached to relay %s at %s", relay_id, relay_address)
                if down.conn_id:
                    threading.Thread(
                        target=self._accept, args=(stub, metadata, down.conn_id), name="swarm-accept", daemon=True
                    ).start()

    def _accept(self, stub, metadata, conn_id: int) -> None:
        host, port = self.local_address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            log.warning("cannot reach this peer's own server at %s: %s", self.local_address, e)
            return
        try:
            replies = stub.Accept(_socket_frames(sock, stage_pb2.RelayFrame(conn_id=conn_id)), metadata=metadata)
        except grpc.RpcError:
            sock.close()
            return
        _drain(replies, sock)

    def reattach(self) -> None:
        """Ends the current Attach; the next is made to whichever relay `relay()` names then."""
        call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5.0)
