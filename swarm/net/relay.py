"""Serving without an inbound port: relayed byte tunnels for peers behind NAT.

A peer P that nobody can dial keeps an outbound `Attach` stream open to a reachable peer R (`Attachment`).
A caller C that wants P dials a 127.0.0.1 listener of its own (`Tunnels`) in place of P's announced address;
each TCP connection accepted there becomes a `Connect(target=P)` stream on R. R asks P over the Attach to
open a fresh outbound `Accept(conn_id)` stream, and pipes the frames of the two streams into each other
(`RelayServicer`). On P, each Accept is piped to a TCP connection to P's own gRPC server. So gRPC runs end
to end, unchanged, inside the tunnel: C's calls stay signed for P and are checked by P; R forwards bytes it
can neither read as calls nor forge. When C is R itself (P's pipeline neighbour is its relay), the tunnel
opens the pipe inside R's process: the reverse connection, no extra hop.

Every relay call (Attach, Connect, Accept, DialBack, Echo, and the data port's hello) carries a proof of itself
beside its token (`relay_metadata`: method, its request or first frame, a nonce, the time; `swarm.net.auth`),
checked by R's `CallVerifier` before the call changes anything: a captured call is served once, as itself only.
Bounds (`RelayLimits`): attached peers, connections per caller (to one peer and in all), per attached peer and
in all, bytes per frame, how long P may take to accept. Only P can attach as P (the Attach is signed by P's key)
and only while the run vouches for it (`may_attach` answers its `Standing`: P announces R as its relay, or the
plan names P); a connection to a peer that is not attached is refused (NOT_FOUND); a newer Attach of the same
peer replaces the older (a restarted P is not locked out by its own dead stream). Strangers never shut out
the plan: callers the plan names (`planned`: its trainers and stage peers) may use slots that others may not,
and a peer the plan names evicts, when the relay is full, a peer it does not name. A
relay that dies ends every tunnel through it, so the calls inside fail with UNAVAILABLE and the driver's
reroute and repair take over. R paces relayed bytes by its shaper per destination, and counts them as
`swarm_relayed_bytes_total{link="<src>-><dst>"}`.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc

from swarm.net.splice import TAKEN, DataPort, new_secret, shut, splice
from swarm.net.tunnel import (
    Attachment,
    RelayError,
    RelayLimits,
    RelayRoute,
    Standing,
    Tunnels,
    _drain,
    _socket_frames,
    relay_metadata,
    relay_path,
)
from swarm.proto import stage_pb2, stage_pb2_grpc

if TYPE_CHECKING:
    from swarm.metrics import Metrics
    from swarm.net.auth import CallVerifier
    from swarm.net.reach import DialBackHelper, NonceBook
    from swarm.peers.shaper import LinkShaping

__all__ = [
    "Attachment", "RelayError", "RelayLimits", "RelayRoute", "RelayServicer", "Standing", "Tunnels", "relay_metadata",
    "relay_path",
]  # fmt: skip

log = logging.getLogger("swarm.relay")


class _Attached:
    def __init__(self, peer_id: str, standing: Standing = Standing.ANNOUNCED):
        self.peer_id, self.standing = peer_id, standing
        self.requests: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        """(conn_id, its data-port secret) of each connection the peer is asked to accept"""
        self.conns = 0
        self.open_conns = 0
        """of `conns`, those of callers the plan does not name"""
        self.closed = threading.Event()
        self.evicted_for: str | None = None
        """the peer the plan names that took this one's slot (its Attach then ends RESOURCE_EXHAUSTED)"""

    def close(self) -> None:
        self.closed.set()
        self.requests.put(None)


class _Pending:
    def __init__(self, caller: str, target: str, frames: Iterator):
        self.caller, self.target, self.frames = caller, target, frames
        self.accepted = threading.Event()
        self.accept_frames: Iterator | None = None
        """the target's Accept stream, when it took the connection that way"""
        self.sock: socket.socket | None = None
        """the target's raw connection to the data port, when it took the connection that way"""
        self.secret = new_secret()
        self.error: RelayError | None = None
        """why one leg failed: the other leg ends with the same error, not as a clean close"""

    def taken(self) -> bool:
        """Whether the target took the connection already (by Accept or by the data port)."""
        return self.accept_frames is not None or self.sock is not None

    def pipe(self, frames: Iterator) -> Iterator:
        try:
            yield from frames
        except RelayError as e:
            self.error = self.error or e
        if self.error is not None:
            raise self.error


class _Offer:
    """The data port offered to a Connect's caller: taken by its hello (`sock`), or declined by a data frame on
    its stream (`frame`), or neither (it went)."""

    def __init__(self, caller: str):
        self.caller, self.secret = caller, new_secret()
        self.sock: socket.socket | None = None
        self.frame: stage_pb2.RelayFrame | None = None
        self.decided = threading.Event()

    def read_first(self, frames: Iterator) -> None:
        """The caller's next frame (a decline) or the end of its stream, whichever comes; a thread's whole life:
        after a hello took the offer it just waits for the stream's end."""
        try:
            frame = next(frames, None)
        except grpc.RpcError:
            frame = None
        if not self.decided.is_set():
            self.frame = frame
            self.decided.set()


class RelayServicer(stage_pb2_grpc.RelayServicer):
    """The relay side (any reachable peer, unless --no-relay), plus the dial-back helper and the Echo of its
    own reachability check (`swarm.net.reach`), all on the `Relay` service beside the stage service.

    Args:
        peer_id: this peer's id (the relay's half of every link label).
        verifier: establishes each caller's peer id; without one every call is refused (a relay serves only
            peers it can name).
        may_attach: peer id -> its `Standing` for an Attach here (daemon: announced with reach="relay" and
            relay=this peer, or named by the plan); a bool reads as STRANGER/ANNOUNCED.
        limits: bounds.
        shaping: paces forwarded bytes per destination (keyed by `address_of(peer)`, else the peer id).
        metrics: counts `relayed_bytes`.
        serve_relay: False (--no-relay): Attach and Connect are refused; DialBack and Echo still served.
        dial_back: the dial-back helper (None: DialBack refused).
        nonces: this peer's pending reachability nonces, answered by Echo.
        planned: caller id -> whether the plan this relay follows names it (its trainers and stage peers): such
            callers' Connects may use the slots the limits reserve (`RelayLimits`), strangers' may not.
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
        planned: Callable[[str], bool] = lambda peer: False,
    ):
        self.peer_id, self.verifier, self.may_attach, self.planned = peer_id, verifier, may_attach, planned
        self.limits = limits or RelayLimits()
        self.shaping, self.address_of, self.metrics = shaping, address_of, metrics
        self.serve_relay, self.dial_back, self.nonces = serve_relay, dial_back, nonces
        self._attached: dict[str, _Attached] = {}
        self._pending: dict[int, _Pending] = {}
        self._conns = 0
        self._pairs: dict[tuple[str, str], int] = {}
        self._by_caller: dict[str, int] = {}
        """open connections per caller, to all targets (`conns_per_caller_total`)"""
        self._open_conns = 0
        """open connections of callers the plan does not name (`open_conns`)"""
        self._waiting_by: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        """notified when a peer attaches (Connects waiting for it)"""
        self._waiting = 0
        self._offers: dict[int, _Offer] = {}
        self.data_port: DataPort | None = None
        """the raw data port (`listen_raw`); None: every connection's bytes go as frames"""

    # ---- who calls --------------------------------------------------------------------------------------

    def _caller(self, context, method: str, fields=None) -> str:
        """The caller of this call of `method` once its token verifies and its proof signs this relay, the method
        and `fields` (a unary call's request; None for an Attach, whose stream carries nothing to sign) with a
        nonce this relay has not seen: else the call ends UNAUTHENTICATED before it changes anything."""
        from swarm.net.auth import AuthError

        if self.verifier is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this relay serves authenticated peers only")
        try:
            return self.verifier.call(context.invocation_metadata(), relay_path(method), fields)
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {e}")

    def _first(self, request_iterator, context, method: str):
        """(caller, first frame) of a Connect or an Accept: the token and the proof's form and age are checked
        from the metadata before the stream is read (a stranger's stream costs no read), the proof against the
        first frame once it came; refused: UNAUTHENTICATED. The first frame is None when the stream had none."""
        from swarm.net.auth import AuthError

        if self.verifier is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this relay serves authenticated peers only")
        try:
            pending = self.verifier.pending(context.invocation_metadata(), relay_path(method))
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {e}")
        first = next(request_iterator, None)
        if first is None:
            return pending.caller, None
        try:
            return pending.check(first), first
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {e}")

    def attached(self) -> list[str]:
        with self._lock:
            return sorted(self._attached)

    def holds(self, peer_id: str) -> bool:
        """Whether `peer_id` is attached here now."""
        with self._lock:
            return peer_id in self._attached

    # ---- reachability (swarm.net.reach) -----------------------------------------------------------------

    def DialBack(self, request, context):
        caller = self._caller(context, "DialBack", request)
        if self.dial_back is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer does not dial back")
        try:
            reached, detail = self.dial_back.dial_back(caller, bytes(request.nonce))
        except RelayError as e:
            context.abort(e.code, e.details)
        return stage_pb2.DialBackReply(reached=reached, detail=detail)

    def Echo(self, request, context):
        self._caller(context, "Echo", request)
        known = self.nonces is not None and self.nonces.seen(bytes(request.nonce))
        return stage_pb2.EchoReply(known=known)

    # ---- relaying ---------------------------------------------------------------------------------------

    def _admit(self, caller: str, standing: Standing) -> tuple[_Attached, _Attached | None, _Attached | None]:
        """The slot of `caller`'s Attach: (its entry, the older Attach of the same peer it replaces, the peer
        the plan does not name it evicts). Raises RelayError when full. Under the lock."""
        entry = _Attached(caller, standing)
        old = self._attached.get(caller)
        others = [e for e in self._attached.values() if e is not old]
        victim = None
        if standing < Standing.PLANNED and sum(e.standing < Standing.PLANNED for e in others) >= (
            self.limits.open_attached
        ):
            raise RelayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"relay {self.peer_id}: {self.limits.open_attached} peers the plan does not name attached already",
            )
        if len(others) >= self.limits.max_attached:
            unnamed = [e for e in others if e.standing < Standing.PLANNED]
            if standing < Standing.PLANNED or not unnamed:
                full = f"relay {self.peer_id}: {self.limits.max_attached} peers attached"
                raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, full)
            victim = unnamed[-1]  # the last attached (dicts keep order): the longest-held stay
            del self._attached[victim.peer_id]
            victim.evicted_for = caller
        self._attached[caller] = entry
        self._arrived.notify_all()
        return entry, old, victim

    def Attach(self, request_iterator, context):
        caller = self._caller(context, "Attach")
        if not self.serve_relay:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer does not relay (--no-relay)")
        standing = Standing(int(self.may_attach(caller)))
        if standing == Standing.STRANGER:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {caller} does not announce relay={self.peer_id} and the plan does not name it",
            )
        with self._lock:
            try:
                entry, old, victim = self._admit(caller, standing)
            except RelayError as e:
                context.abort(e.code, e.details)
        if old is not None:
            log.info("peer %s attached again: the newer Attach replaces the older", caller)
            old.close()
        if victim is not None:
            log.warning("peer %s evicted: peer %s, named by the plan, takes its slot", victim.peer_id, caller)
            victim.close()
        context.add_callback(entry.close)
        log.info("peer %s attached (%s)", caller, standing.name.lower())
        try:
            yield stage_pb2.AttachDown(conn_id=0)  # accepted: the peer may announce this relay now
            port = 0 if self.data_port is None else self.data_port.port
            while not entry.closed.is_set():
                try:
                    asked = entry.requests.get(timeout=self.limits.keepalive_s)
                except queue.Empty:
                    asked = (0, b"")
                if asked is None:
                    if entry.evicted_for is not None:
                        context.abort(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"relay {self.peer_id} full: peer {entry.evicted_for}, named by the plan, took the slot",
                        )
                    break
                conn_id, secret = asked
                if conn_id and port:
                    yield stage_pb2.AttachDown(conn_id=conn_id, splice_port=port, splice_secret=secret)
                else:
                    yield stage_pb2.AttachDown(conn_id=conn_id)
        finally:
            with self._lock:
                if self._attached.get(caller) is entry:
                    del self._attached[caller]
            entry.close()
            log.info("peer %s detached", caller)

    @contextmanager
    def _open(self, caller: str, target: str, frames: Iterator):
        """A connection from `caller` to the attached `target`, within the bounds, once the target took it (by
        its data port or an Accept stream): yields the `_Pending`. Raises RelayError when refused."""
        if not self.serve_relay:
            raise RelayError(grpc.StatusCode.UNAVAILABLE, "this peer does not relay (--no-relay)")
        pending = _Pending(caller, target, frames)
        # this relay's own calls and the plan's callers may use the reserved slots (read outside the lock)
        named = caller == self.peer_id or bool(self.planned(caller))
        self._await_attach(caller, target)
        with self._lock:
            entry = self._attached.get(target)
            if entry is None:
                raise RelayError(grpc.StatusCode.NOT_FOUND, f"peer {target} is not attached to relay {self.peer_id}")
            pair = (caller, target)
            self._check_slots(entry, caller, pair, named)
            entry.conns += 1
            self._conns += 1
            self._pairs[pair] = self._pairs.get(pair, 0) + 1
            self._by_caller[caller] = self._by_caller.get(caller, 0) + 1
            if not named:
                entry.open_conns += 1
                self._open_conns += 1
            conn_id = next(self._ids)
            self._pending[conn_id] = pending
        try:
            entry.requests.put((conn_id, pending.secret))
            if entry.closed.is_set() or not pending.accepted.wait(self.limits.accept_timeout_s):
                raise RelayError(grpc.StatusCode.UNAVAILABLE, f"peer {target} did not accept through relay")
            if self.metrics is not None:
                self.metrics.relayed_connections.labels("frames" if pending.sock is None else "data-port").inc()
            yield pending
        finally:
            with self._lock:
                self._pending.pop(conn_id, None)
                entry.conns -= 1
                self._conns -= 1
                self._pairs[pair] -= 1
                if not self._pairs[pair]:
                    del self._pairs[pair]
                self._by_caller[caller] -= 1
                if not self._by_caller[caller]:
                    del self._by_caller[caller]
                if not named:
                    entry.open_conns -= 1
                    self._open_conns -= 1
            if pending.sock is not None:  # taken just as the wait gave up, or done: closed either way
                shut(pending.sock)

    def connect(self, caller: str, target: str, frames: Iterator) -> Iterator:
        """A connection from `caller` to the attached `target`: yields the target's `RelayFrame`s while `frames`
        (the caller's, the first already read) are piped to it. Raises RelayError when refused."""
        with self._open(caller, target, frames) as pending:
            if pending.sock is None:
                yield from pending.pipe(self._pipe(pending.accept_frames, src=target, dst=caller))
            else:
                yield from self._frames_to_raw(pending)

    def carry_local(self, caller: str, target: str, sock: socket.socket) -> None:
        """The reverse connection: `sock` (a connection of this process, the caller) carried to the attached
        `target` until either ends; closes `sock`. Raises RelayError when refused."""
        with self._open(caller, target, _socket_frames(sock)) as pending:
            if pending.sock is not None:
                splice(sock, pending.sock, self._meter(caller, target), self._meter(target, caller))
                return
            _drain(pending.pipe(self._pipe(pending.accept_frames, src=target, dst=caller)), sock)

    def _frames_to_raw(self, pending: _Pending) -> Iterator:
        """The caller's frames written to the target's raw connection, and what it reads back as frames."""
        sock, caller, target = pending.sock, pending.caller, pending.target

        def upstream():
            try:
                for frame in pending.pipe(self._pipe(pending.frames, src=caller, dst=target)):
                    sock.sendall(frame.data)
                sock.shutdown(socket.SHUT_WR)
            except (RelayError, OSError):
                shut(sock)  # ends the read below too

        threading.Thread(target=upstream, name="swarm-relay-up", daemon=True).start()
        meter = self._meter(target, caller)
        for frame in _socket_frames(sock):
            meter(len(frame.data))
            yield frame
        if pending.error is not None:
            raise pending.error

    def take_raw(self, conn_id: int, secret: bytes, peer: str, sock: socket.socket) -> bool:
        """The data port's hand-over: `sock` takes connection `conn_id` when `peer` is the one asked to accept it,
        `secret` is its secret, and nothing took it yet. Answers `TAKEN` on `sock` before the connection's bytes
        may flow (a caller whose stream already ended shuts the socket's sending side at once)."""
        with self._lock:
            offer = self._offers.get(conn_id)
            if offer is not None:  # a Connect's caller taking the data port offered to it
                slot, asked, taken, ready = offer, offer.caller, offer.decided.is_set(), offer.decided
            elif (pending := self._pending.get(conn_id)) is not None:  # the target taking its connection
                slot, asked, taken, ready = pending, pending.target, pending.taken(), pending.accepted
            else:
                return False
            if asked != peer or taken or not hmac.compare_digest(slot.secret, secret):
                return False
            try:
                sock.sendall(TAKEN)
            except OSError:
                return False
            slot.sock = sock
            ready.set()
        return True

    def listen_raw(self, host: str, port: int = 0) -> int:
        """Opens the raw data port (`swarm.net.splice`) on `host`; returns its port. Needs a verifier."""
        if self.verifier is None:
            raise ValueError("a data port needs a verifier: it serves authenticated peers only")
        self.data_port = DataPort(host, self.verifier, self.take_raw, port)
        return self.data_port.port

    def close(self) -> None:
        if self.data_port is not None:
            self.data_port.close()
        if self.dial_back is not None:
            self.dial_back.close()

    def _check_slots(self, entry: _Attached, caller: str, pair: tuple[str, str], named: bool) -> None:
        """Raises RelayError (RESOURCE_EXHAUSTED, naming the bound) when a new connection of `caller` to `entry`
        would pass a bound: per caller and target, per caller, per target, in all; a caller the plan does not
        name also within the open (unreserved) slots. Under the lock."""
        limits, why = self.limits, None
        if self._pairs.get(pair, 0) >= limits.conns_per_caller:
            why = f"{limits.conns_per_caller} connections of caller {caller} to peer {entry.peer_id}"
        elif self._by_caller.get(caller, 0) >= limits.conns_per_caller_total:
            why = f"{limits.conns_per_caller_total} connections of caller {caller}"
        elif entry.conns >= limits.conns_per_peer:
            why = f"{limits.conns_per_peer} connections to peer {entry.peer_id}"
        elif self._conns >= limits.max_conns:
            why = f"{limits.max_conns} connections in all"
        elif not named and entry.open_conns >= limits.open_conns_per_peer:
            why = f"{limits.open_conns_per_peer} connections to peer {entry.peer_id} of callers the plan does not name"
        elif not named and self._open_conns >= limits.open_conns:
            why = f"{limits.open_conns} connections of callers the plan does not name"
        if why is not None:
            raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"relay {self.peer_id}: {why}")

    def _await_attach(self, caller: str, target: str) -> None:
        """Waits (at most `attach_wait_s`, at most `max_waiting` Connects at once and `waiting_per_caller` of one
        caller) for the Attach of a target that is not attached but announces this relay: a peer moving its
        Attach here announces first and attaches a moment later, and a caller that read the new announcement
        must not find it missing meanwhile."""
        with self._lock:
            if (
                target in self._attached
                or self._waiting >= self.limits.max_waiting
                or self._waiting_by.get(caller, 0) >= self.limits.waiting_per_caller
            ):
                return
        if not self.may_attach(target):  # a DHT read (rate-limited): outside the lock
            return
        deadline = time.monotonic() + self.limits.attach_wait_s
        with self._lock:
            self._waiting += 1
            self._waiting_by[caller] = self._waiting_by.get(caller, 0) + 1
            try:
                while target not in self._attached and (left := deadline - time.monotonic()) > 0:
                    self._arrived.wait(left)
            finally:
                self._waiting -= 1
                self._waiting_by[caller] -= 1
                if not self._waiting_by[caller]:
                    del self._waiting_by[caller]

    def Connect(self, request_iterator, context):
        caller, first = self._first(request_iterator, context, "Connect")
        if first is None or not first.target or len(first.target) > 64 or first.data:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Connect's first frame names its target, nothing else")
        try:
            if first.splice:
                yield from self._connect_offer(caller, first.target, request_iterator)
            else:
                yield from self.connect(caller, first.target, request_iterator)  # frames as they came
        except RelayError as e:
            context.abort(e.code, e.details)

    def _connect_offer(self, caller: str, target: str, frames: Iterator) -> Iterator:
        """A Connect whose caller can take the data port: once the target took the connection by the data port,
        the first reply offers it to the caller too, and the two sockets are spliced here; else (the target took
        an Accept, no data port, or the caller declines) frames. The first reply is the offer or empty."""
        with self._open(caller, target, frames) as pending:
            if pending.sock is None or self.data_port is None:
                yield stage_pb2.RelayFrame()
                yield from pending.pipe(self._pipe(pending.accept_frames, src=target, dst=caller))
                return
            offer = _Offer(caller)
            with self._lock:
                offer_id = next(self._ids)
                self._offers[offer_id] = offer
            try:
                port = self.data_port.port
                yield stage_pb2.RelayFrame(conn_id=offer_id, splice_port=port, splice_secret=offer.secret)
                threading.Thread(target=offer.read_first, args=(frames,), name="swarm-relay-offer", daemon=True).start()
                if not offer.decided.wait(self.limits.accept_timeout_s):
                    raise RelayError(grpc.StatusCode.UNAVAILABLE, f"caller {caller} neither took nor declined")
                if offer.sock is not None:
                    splice(offer.sock, pending.sock, self._meter(caller, target), self._meter(target, caller))
                elif offer.frame is not None:  # declined: its frames, this one first, to the target's socket
                    pending.frames = itertools.chain([offer.frame], frames)
                    yield from self._frames_to_raw(pending)
            finally:
                with self._lock:
                    self._offers.pop(offer_id, None)
                if offer.sock is not None:
                    shut(offer.sock)

    def Accept(self, request_iterator, context):
        caller, first = self._first(request_iterator, context, "Accept")
        conn_id = 0 if first is None else first.conn_id
        with self._lock:
            pending = self._pending.get(conn_id)
            if pending is None or pending.target != caller or pending.taken():
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
        meter = self._meter(src, dst)
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
                meter(n)
                yield frame
        except grpc.RpcError as e:  # the other leg's stream ended under us
            raise RelayError(grpc.StatusCode.UNAVAILABLE, f"relayed stream from {src} ended: {e}") from None

    def _meter(self, src: str, dst: str) -> Callable[[int], None]:
        """Paces `n` bytes toward `dst` (its shaper, keyed by its address, else its id) and counts them on the
        `src->dst` link."""
        shaper = None
        if self.shaping is not None:
            shaper = self.shaping.for_destination(self.address_of(dst) or dst)
        counter = None if self.metrics is None else self.metrics.relayed_bytes.labels(f"{src}->{dst}")

        def meter(n: int) -> None:
            if shaper is not None:
                shaper.consume(n)
            if counter is not None:
                counter.inc(n)

        return meter
