"""The two ends of a relayed tunnel (swarm/net/relay.py has the relay between them): the caller's 127.0.0.1
listeners (`Tunnels`) and the unreachable peer's Attach (`Attachment`), with the bounds both sides share
(`RelayLimits`) and the relay's refusals (`RelayError`). Moved out of relay.py, which had reached 595 lines.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import grpc

from swarm.net.splice import COPY_BYTES, DataPortPaths, shut, splice
from swarm.peers.transport import TransportConfig
from swarm.proto import stage_pb2, stage_pb2_grpc

if TYPE_CHECKING:
    from swarm.net.auth import CallSigner
    from swarm.net.relay import RelayServicer

__all__ = [
    "READ_BYTES", "RELAY_SERVICE", "Attachment", "RelayError", "RelayLimits", "RelayRoute", "Standing", "Tunnels",
    "relay_metadata", "relay_path",
]  # fmt: skip

log = logging.getLogger("swarm.relay")

READ_BYTES = COPY_BYTES
"""Bytes read from a socket per frame (a frame carries at most `RelayLimits.max_frame_bytes`)."""
RELAY_SERVICE = stage_pb2.DESCRIPTOR.services_by_name["Relay"].full_name


def relay_path(name: str) -> str:
    """The gRPC path of the relay service's method `name` ("/swarm.Relay/Attach"): what a relay call's proof
    signs."""
    return f"/{RELAY_SERVICE}/{name}"


def relay_metadata(signer: CallSigner | None, relay_id: str, method: str, fields=None) -> tuple:
    """The metadata of one call of the relay service's `method` to `relay_id`: the token and a proof of this call
    over `fields` (a unary call's request, a Connect's or an Accept's first frame, None for an Attach), good
    once (`swarm.net.auth`); empty without a signer."""
    return () if signer is None else signer.metadata(relay_id, relay_path(method), fields)


class Standing(enum.IntEnum):
    """What the run vouches for a peer as, in a relay's eyes (the daemon answers: `NatWiring.may_attach`).
    A callable that answers a bool reads as STRANGER (False) or ANNOUNCED (True)."""

    STRANGER = 0
    """neither announced in the run naming this relay nor named by the plan: its Attach is refused"""
    ANNOUNCED = 1
    """announced in the run (a PeerAnnouncement signed by its key) with reach="relay" and this relay: it attaches
    in the open slots (`RelayLimits.open_attached`), and is evicted for a PLANNED peer when the relay is full"""
    PLANNED = 2
    """named by the plan this relay follows: takes any free slot, else evicts an ANNOUNCED peer"""


@dataclass(frozen=True)
class RelayLimits:
    """What one relay serves at most, and what an attached peer takes from its relay at most.

    The rule (issue 27): strangers never shut out the plan. A caller the plan names (its trainers, its stage
    peers: `RelayServicer`'s `planned`) may hold every connection slot; callers it does not name share what
    the reserves leave (`open_conns_per_peer`, `open_conns`). A peer the plan names attaches in any free slot
    and, the relay full, evicts the last attached peer the plan does not name; those attach only while fewer
    than `open_attached` of them are attached."""

    max_attached: int = 8
    """peers attached at once"""
    reserved_attached: int = 4
    """of `max_attached`, the slots peers the plan does not name may not take"""
    conns_per_peer: int = 16
    """open connections to one attached peer (each caller's channel holds one)"""
    reserved_conns_per_peer: int = 8
    """of `conns_per_peer`, the slots kept for callers the plan names (the trainer, pipeline neighbours)"""
    max_conns: int = 32
    """open connections through this relay in all"""
    reserved_conns: int = 16
    """of `max_conns`, the slots kept for callers the plan names"""
    conns_per_caller: int = 4
    """open connections of one caller to one attached peer (a gRPC channel holds one; a stranger cannot take
    the attached peer's every slot)"""
    conns_per_caller_total: int = 8
    """open connections of one caller through this relay, to all attached peers together"""
    waiting_per_caller: int = 2
    """Connects of one caller waiting for a target's Attach at once (`attach_wait_s`; beyond: NOT_FOUND at once)"""
    accepts_per_attach: int = 24
    """the attached peer's side: connections it takes from one relay at once (each costs it two threads and
    three descriptors). An honest relay asks at most `conns_per_peer`; the margin covers the moments when a
    connection's end has reached one side and not yet the other. Further requests are dropped, and a relay
    that asks `accepts_per_attach` more than that within one Attach is left (a flooding relay)"""
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

    def __post_init__(self) -> None:
        for name, whole in (
            ("reserved_attached", "max_attached"),
            ("reserved_conns_per_peer", "conns_per_peer"),
            ("reserved_conns", "max_conns"),
        ):
            if not 0 <= getattr(self, name) <= getattr(self, whole):
                raise ValueError(f"RelayLimits.{name} must be within 0..{whole} ({getattr(self, whole)})")
        if min(self.max_attached, self.conns_per_peer, self.max_conns, self.accepts_per_attach) < 1:
            raise ValueError("RelayLimits: max_attached, conns_per_peer, max_conns and accepts_per_attach must be >= 1")

    @property
    def open_attached(self) -> int:
        """Peers the plan does not name that may be attached at once."""
        return self.max_attached - self.reserved_attached

    @property
    def open_conns_per_peer(self) -> int:
        """Connections to one attached peer that callers the plan does not name may hold together."""
        return self.conns_per_peer - self.reserved_conns_per_peer

    @property
    def open_conns(self) -> int:
        """Connections through this relay that callers the plan does not name may hold together."""
        return self.max_conns - self.reserved_conns

    def threads(self) -> int:
        """Server threads the relay may hold: one per Attach, two per connection (Connect and Accept)."""
        return self.max_attached + 2 * self.max_conns


class RelayError(Exception):
    """A relay refused or lost a connection: the gRPC status code and what happened."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


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
        log.info("tunnel closed: %s", e)
    finally:
        shut(sock)


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


class _Flooding(grpc.RpcError):
    """An Attach whose relay asked for more connections at once than `RelayLimits.accepts_per_attach` allows, by
    more than that again: the peer leaves it (`Attachment.on_fail` sees RESOURCE_EXHAUSTED)."""

    def __init__(self, relay_id: str, dropped: int):
        self._details = f"relay {relay_id} asked {dropped} connections over the bound: left"
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

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
        raw: ask relays to carry connections' bytes by their data ports (False: always frames).
    """

    def __init__(
        self,
        signer: CallSigner | None,
        route: Callable[[str], RelayRoute | None],
        local: RelayServicer | None = None,
        raw: bool = True,
    ):
        self.signer, self.route, self.local = signer, route, local
        self._raw = DataPortPaths(raw and signer is not None, RelayLimits.attach_connect_s)
        self.my_id = local.peer_id if local is not None else None
        self.own_address: str | None = None
        """this peer's own server as it listens (set once it is relayed): its calls to itself are dialed there,
        not out through its relay and back (`swarm experiment nat --netns` saw them as relayed bytes P->P)"""
        self._channels: dict[str, grpc.Channel] = {}
        self._listeners: dict[str, tuple[socket.socket, str, str]] = {}
        """announced address -> (its listener, the listener's address, the relay it was made for)"""
        self._lock = threading.Lock()

    def dial(self, address: str) -> str:
        """The address to dial for `address`: itself, this peer's own server when it names this peer, or the
        local listener of its tunnel."""
        route = self.route(address)
        if route is None:
            return address
        if self.own_address is not None and self.my_id is not None and route.peer_id == self.my_id:
            return self.own_address
        with self._lock:
            held = self._listeners.get(address)
            if held is not None and held[2] != route.relay_id:
                # its relay changed: a new listener, so the caller's channel pool sees a new target and retires
                # the old channel (calls on it finish through the old relay, which keeps the peer's old Attach
                # for MOVE_GRACE_S); new connections no longer pin themselves to the relay being left
                shut(held[0])  # a listener whose thread sits in accept() stays listening after a plain close
                held = None
            if held is None:
                listener = socket.create_server(("127.0.0.1", 0))
                held = (listener, f"127.0.0.1:{listener.getsockname()[1]}", route.relay_id)
                self._listeners[address] = held
                threading.Thread(target=self._serve, args=(address, listener), name="swarm-tunnel", daemon=True).start()
            return held[1]

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
            log.info("no relay route to %s any more: its tunnel connection closes", address)
            sock.close()
            return
        try:
            # the reverse connection: the peer attached here (its announced relay, or its second Attach to this
            # pipeline neighbour) is reached in this process
            if self.local is not None and (route.relay_id == self.my_id or self.local.holds(route.peer_id)):
                self.local.carry_local(self.my_id, route.peer_id, sock)
                return
            stub = stage_pb2_grpc.RelayStub(self._relay_channel(route.relay_address))
            if self._raw.usable(route.relay_address):
                self._connect_offered(route, sock, stub)
                return
            first = stage_pb2.RelayFrame(target=route.peer_id)
            metadata = relay_metadata(self.signer, route.relay_id, "Connect", first)
            replies = stub.Connect(_socket_frames(sock, first), metadata=metadata)
        except RelayError as e:
            log.info("tunnel to %s closed: %s", route.peer_id, e)
            sock.close()
            return
        except Exception as e:
            log.warning("cannot open a tunnel to %s: %s", route.peer_id, e)
            sock.close()
            return
        _drain(replies, sock)

    def _connect_offered(self, route: RelayRoute, sock: socket.socket, stub) -> None:
        """A Connect that asks for the relay's data port: spliced to it when offered and reachable, else the
        socket's bytes as frames on the Connect (whose request stream holds back until that is decided)."""
        decided, done = threading.Event(), threading.Event()
        raw: list[socket.socket] = []

        request = stage_pb2.RelayFrame(target=route.peer_id, splice=True)
        metadata = relay_metadata(self.signer, route.relay_id, "Connect", request)

        def requests():
            yield request
            decided.wait()
            if raw:  # the bytes go by the data port; the Connect stays open until they end
                done.wait()
                return
            yield from _socket_frames(sock)

        replies = stub.Connect(requests(), metadata=metadata)
        try:
            try:
                first = next(replies)
            except (grpc.RpcError, StopIteration) as e:
                log.info("tunnel to %s closed: %s", route.peer_id, e)
                shut(sock)
                return
            if first.splice_port:
                secret = bytes(first.splice_secret)
                relay_sock = self._raw.dial(
                    route.relay_address, first.splice_port, first.conn_id, secret, self.signer, route.relay_id
                )
                if relay_sock is not None:
                    raw.append(relay_sock)
                    decided.set()
                    splice(sock, relay_sock)
                    return
            decided.set()
            if first.data:
                sock.sendall(first.data)
            _drain(replies, sock)
        except OSError as e:
            log.info("tunnel to %s closed: %s", route.peer_id, e)
            shut(sock)
        finally:
            decided.set()
            done.set()
            replies.cancel()

    def close(self) -> None:
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for listener, _, _ in listeners:
            shut(listener)
        for channel in channels:
            channel.close()


class Attachment:
    """The unreachable peer's end: keeps an Attach open to its relay and opens an Accept, piped to its own
    gRPC server at `local_address`, for every connection the relay announces. Reattaches after a failure
    (backoff up to 5 s) until `close()`. At most `limits.accepts_per_attach` connections are taken at once (a
    relay that floods AttachDowns cannot grow this peer's threads or descriptors past that: two threads and
    three descriptors each); a relay that asks for that many more is left (RESOURCE_EXHAUSTED to `on_fail`).

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
        raw: bool = True,
    ):
        self.relay, self.signer, self.local_address, self.on_fail = relay, signer, local_address, on_fail
        self.limits = limits or RelayLimits()
        self.attached = threading.Event()
        """set while the relay holds our Attach"""
        self.relay_id: str | None = None
        self._raw = DataPortPaths(raw, self.limits.attach_connect_s)
        """takes connections by the relay's data port when it offers one (`raw` False: always the Accept stream)"""
        self.dropped = 0
        """connection requests dropped over `accepts_per_attach` (a flooding relay), over this object's life"""
        self._taking_lock = threading.Lock()
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
            metadata = relay_metadata(self.signer, relay_id, "Attach")  # no fields: the proof is checked at once

            def upstream():
                while not stop.wait(self.limits.keepalive_s):
                    yield stage_pb2.AttachUp(keepalive=True)

            self._call = stub.Attach(upstream(), metadata=metadata)
            taking: set[int] = set()
            """conn_ids being taken now (the bound: `RelayLimits.accepts_per_attach`)"""
            dropped = 0
            for down in self._call:
                if not self.attached.is_set():
                    self.relay_id = relay_id
                    self.attached.set()
                    log.info("attached to relay %s at %s", relay_id, relay_address)
                if not down.conn_id:
                    continue
                with self._taking_lock:
                    take = down.conn_id not in taking and len(taking) < self.limits.accepts_per_attach
                    if take:
                        taking.add(down.conn_id)
                if not take:  # an honest relay never asks this much: a flooding one costs no thread, no socket
                    dropped += 1
                    self.dropped += 1
                    if dropped == 1:
                        log.warning("relay %s asks more connections than %d at once: dropped", relay_id, len(taking))
                    if dropped > self.limits.accepts_per_attach:
                        self._call.cancel()
                        raise _Flooding(relay_id, dropped)
                    continue
                raw = None
                if down.splice_port and self._raw.usable(relay_address):
                    raw = (relay_address, down.splice_port, bytes(down.splice_secret))
                threading.Thread(
                    target=self._accept, args=(stub, relay_id, down.conn_id, raw, taking), name="swarm-accept",
                    daemon=True,
                ).start()  # fmt: skip

    def _accept(self, stub, relay_id: str, conn_id: int, raw=None, taking: set[int] | None = None) -> None:
        """Takes connection `conn_id` (then frees its place in `taking`): by the relay's data port when `raw`
        (relay address, data port, secret) names one and it answers, else by an Accept stream; either way piped
        to this peer's own server."""
        try:
            self._take(stub, relay_id, conn_id, raw)
        finally:
            if taking is not None:
                with self._taking_lock:
                    taking.discard(conn_id)

    def _take(self, stub, relay_id: str, conn_id: int, raw: tuple[str, int, bytes] | None) -> None:
        host, port = self.local_address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            log.warning("cannot reach this peer's own server at %s: %s", self.local_address, e)
            return
        if raw is not None:  # the relay's data port: plain TCP; else (or when that fails) the Accept stream
            relay_address, port, secret = raw
            relay_sock = self._raw.dial(relay_address, port, conn_id, secret, self.signer, relay_id)
            if relay_sock is not None:
                splice(sock, relay_sock)
                return
        try:
            first = stage_pb2.RelayFrame(conn_id=conn_id)
            metadata = relay_metadata(self.signer, relay_id, "Accept", first)
            replies = stub.Accept(_socket_frames(sock, first), metadata=metadata)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the relay's channel closed meanwhile (we are leaving)
            log.debug("connection %d through relay %s not taken: %s", conn_id, relay_id, e)
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
