"""Reachability: can the others dial this peer? Asked of a reachable peer, as libp2p's AutoNAT does.

The asking peer A sends a reachable helper H a fresh random nonce (`Relay.DialBack`). H looks A's address up
in A's own announcement (never an address the call names: H would otherwise be a port scanner anyone can
aim) and calls `Relay.Echo(nonce)` there, signed for A's peer id. A's Echo answers whether it knows the nonce,
and A marks it seen. A decides from what its own server saw (`NonceBook.seen_since`), not from H's word: a
lying helper can make A use a relay it did not need, never make A announce an address nobody can dial.

The announced address is still the caller's choice (it signs its own announcement), so the helper bounds
what aiming it elsewhere buys: one dial at a time and one per `interval_s` per caller, `max_dials` in all,
`timeout_s` each, a gRPC call only (nothing but an Echo is sent), and a reply without how the dial failed
(refused or timed out would say whether a port is open).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING

import grpc

from swarm.net.relay import RelayError
from swarm.proto import stage_pb2, stage_pb2_grpc

if TYPE_CHECKING:
    from swarm.net.auth import CallSigner

__all__ = ["MAX_NONCE_BYTES", "MIN_NONCE_BYTES", "DialBackHelper", "NonceBook", "check_reachable"]

MIN_NONCE_BYTES, MAX_NONCE_BYTES = 16, 64


class NonceBook:
    """The nonces this peer asked dial-backs for, and which of them its Echo saw (bounded, oldest dropped)."""

    def __init__(self, size: int = 64):
        self.size = size
        self._nonces: OrderedDict[bytes, threading.Event] = OrderedDict()
        self._lock = threading.Lock()

    def issue(self) -> bytes:
        nonce = os.urandom(32)
        with self._lock:
            self._nonces[nonce] = threading.Event()
            while len(self._nonces) > self.size:
                self._nonces.popitem(last=False)
        return nonce

    def seen(self, nonce: bytes) -> bool:
        """Echo's side: True (and marked) if `nonce` is one of ours."""
        with self._lock:
            event = self._nonces.get(nonce)
        if event is None:
            return False
        event.set()
        return True

    def wait(self, nonce: bytes, timeout_s: float) -> bool:
        with self._lock:
            event = self._nonces.get(nonce)
        return event is not None and event.wait(timeout_s)


class DialBackHelper:
    """The helper's side of a dial-back.

    Args:
        announced: peer id -> the address it announces (None: not announced; refused).
        signer: signs the Echo for the asker's peer id.
        timeout_s: one dial's limit (connect and Echo).
        max_dials: dials at once, over all callers.
        interval_s: least time between two dials for one caller.
    """

    def __init__(
        self,
        announced: Callable[[str], str | None],
        signer: CallSigner | None,
        timeout_s: float = 3.0,
        max_dials: int = 4,
        interval_s: float = 1.0,
        channel: Callable[[str], grpc.Channel] = grpc.insecure_channel,
    ):
        self.announced, self.signer, self.timeout_s, self.interval_s = announced, signer, timeout_s, interval_s
        self.channel = channel
        self._slots = threading.BoundedSemaphore(max_dials)
        self._busy: set[str] = set()
        self._next: dict[str, float] = {}
        self._lock = threading.Lock()

    def dial_back(self, caller: str, nonce: bytes) -> tuple[bool, str]:
        """Dials `caller`'s announced address and calls Echo(nonce); (reached, what happened)."""
        if not MIN_NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES:
            raise RelayError(grpc.StatusCode.INVALID_ARGUMENT, f"nonce of {len(nonce)} bytes")
        address = self.announced(caller)
        if address is None:
            raise RelayError(grpc.StatusCode.FAILED_PRECONDITION, f"peer {caller} announces no address to dial")
        with self._lock:
            if caller in self._busy:
                raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a dial-back to {caller} is under way")
            if time.monotonic() < self._next.get(caller, 0.0):
                raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"one dial-back per {self.interval_s:g} s")
            if len(self._next) > 4096:
                self._next.clear()
            self._next[caller] = time.monotonic() + self.interval_s
            if not self._slots.acquire(blocking=False):
                raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many dial-backs at once")
            self._busy.add(caller)
        try:
            channel = self.channel(address)
            try:
                metadata = self.signer.metadata(caller) if self.signer is not None else ()
                reply = stage_pb2_grpc.RelayStub(channel).Echo(
                    stage_pb2.EchoRequest(nonce=nonce), timeout=self.timeout_s, metadata=metadata
                )
                return reply.known, "answered" if reply.known else "answered without knowing the nonce"
            except grpc.RpcError:  # no detail: how a dial failed would tell the caller whether a port is open
                return False, "not reached"
            finally:
                channel.close()
        finally:
            with self._lock:
                self._busy.discard(caller)
            self._slots.release()


def check_reachable(
    helpers: list[tuple[str, str]],
    signer: CallSigner | None,
    nonces: NonceBook,
    timeout_s: float = 5.0,
    channel: Callable[[str], grpc.Channel] = grpc.insecure_channel,
) -> bool | None:
    """Whether others can dial this peer's announced address: asks every (peer id, address) helper at once and
    takes the first that answers (one at a time, a helper that announced reach=direct before its own check
    found it behind NAT cost `timeout_s` each: its SYNs are dropped). True/False: this peer's Echo saw that
    helper's nonce or not; None: no helper answered (unknown)."""

    def ask(helper_id: str, address: str) -> bool | None:
        nonce = nonces.issue()
        ch = channel(address)
        try:
            metadata = signer.metadata(helper_id) if signer is not None else ()
            started = time.monotonic()
            stage_pb2_grpc.RelayStub(ch).DialBack(
                stage_pb2.DialBackRequest(nonce=nonce), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError:
            return None  # that helper cannot tell
        finally:
            ch.close()
        return nonces.wait(nonce, max(0.0, 0.5 - (time.monotonic() - started)))

    if not helpers:
        return None
    pool = ThreadPoolExecutor(len(helpers), thread_name_prefix="swarm-dialback")
    try:
        for done in as_completed([pool.submit(ask, *helper) for helper in helpers]):
            if (answer := done.result()) is not None:
                return answer
        return None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # the slower asks end within timeout_s on their own
