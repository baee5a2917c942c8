"""Reachability: can the others dial this peer? Asked of a reachable peer, as libp2p's AutoNAT does.

The asking peer A sends a reachable helper H a fresh random nonce (`Relay.DialBack`). H looks A's address up
in A's own announcement (never an address the call names: H would otherwise be a port scanner anyone can
aim) and calls `Relay.Echo(nonce)` there, signed for A's peer id. A's Echo answers whether it knows the nonce,
and A marks it seen. A decides from what its own server saw (`NonceBook.seen_since`), not from H's word: a
lying helper can make A use a relay it did not need, never make A announce an address nobody can dial.

The announced address is still the caller's choice (it signs its own announcement), so the helper bounds
what aiming it elsewhere buys: one dial at a time and one per `interval_s` per caller, `max_dials` in all,
`timeout_s` each, a gRPC call only (nothing but an Echo is sent), and a reply that says nothing of the dial.

Nor does its timing (issue 27: a closed port answered in 0.01 s, an open one that never speaks gRPC in 3.01 s):
the helper answers as soon as it has taken the dial on, before dialing, and the outcome reaches the asker only
as its own Echo (the nonce proof). A dial holds its caller's turn and its slot for the whole `timeout_s`
whatever happened, so a refusal ("under way", "too many at once") does not tell the port's state either.
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

from swarm.net.relay import RelayError, relay_metadata
from swarm.proto import stage_pb2, stage_pb2_grpc

if TYPE_CHECKING:
    from swarm.net.auth import CallSigner

__all__ = ["DIAL_TIMEOUT_S", "MAX_NONCE_BYTES", "MIN_NONCE_BYTES", "DialBackHelper", "NonceBook", "check_reachable"]

MIN_NONCE_BYTES, MAX_NONCE_BYTES = 16, 64
DIAL_TIMEOUT_S = 3.0
"""A helper's limit on one dial (connect and Echo), and how long it holds the caller's turn and a slot for it."""
DIALING = "dialing: the Echo is the answer"
"""A helper's reply to a dial-back it took on (the same whatever the dial finds)."""


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
        timeout_s: one dial's limit (connect and Echo); each dial holds its caller's turn and its slot this long,
            whatever it found.
        max_dials: dials at once, over all callers.
        interval_s: least time between two dials for one caller.
    """

    def __init__(
        self,
        announced: Callable[[str], str | None],
        signer: CallSigner | None,
        timeout_s: float = DIAL_TIMEOUT_S,
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
        self._closed = threading.Event()

    def busy(self, caller: str) -> bool:
        """Whether a dial-back for `caller` holds its turn now."""
        with self._lock:
            return caller in self._busy

    def close(self) -> None:
        """Ends the holds early (the dials themselves end within `timeout_s`)."""
        self._closed.set()

    def dial_back(self, caller: str, nonce: bytes) -> tuple[bool, str]:
        """Takes on a dial of `caller`'s announced address with Echo(nonce), and answers at once: (False,
        `DIALING`), the same whatever the dial will find; the asker learns the outcome from its own Echo. Raises
        RelayError when refused (a malformed nonce, no announced address, the caller's turn or every slot
        taken)."""
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
        started = time.monotonic()
        try:
            threading.Thread(
                target=self._dial, args=(caller, address, nonce, started), name="swarm-dialback", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: the turn and the slot go back
            self._release(caller)
            raise RelayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many dial-backs at once") from None
        return False, DIALING

    def _dial(self, caller: str, address: str, nonce: bytes, started: float) -> None:
        """The dial itself, then the hold: the caller's turn and the slot come back `timeout_s` after `started`,
        however soon the dial ended."""
        try:
            channel = self.channel(address)
            try:
                request = stage_pb2.EchoRequest(nonce=nonce)
                metadata = relay_metadata(self.signer, caller, "Echo", request)
                stage_pb2_grpc.RelayStub(channel).Echo(request, timeout=self.timeout_s, metadata=metadata)
            except grpc.RpcError:
                pass  # the asker's Echo saw nothing: that is its answer
            finally:
                channel.close()
            self._closed.wait(max(0.0, started + self.timeout_s - time.monotonic()))
        finally:
            self._release(caller)

    def _release(self, caller: str) -> None:
        with self._lock:
            self._busy.discard(caller)
        self._slots.release()


def check_reachable(
    helpers: list[tuple[str, str]],
    signer: CallSigner | None,
    nonces: NonceBook,
    timeout_s: float = 5.0,
    channel: Callable[[str], grpc.Channel] = grpc.insecure_channel,
    echo_wait_s: float = DIAL_TIMEOUT_S + 0.5,
) -> bool | None:
    """Whether others can dial this peer's announced address: asks every (peer id, address) helper at once and
    takes the first that answers (one at a time, a helper that announced reach=direct before its own check
    found it behind NAT cost `timeout_s` each: its SYNs are dropped). True/False: this peer's Echo saw that
    helper's nonce within `echo_wait_s` of its answer (a helper answers before it dials) or not; None: no helper
    answered (unknown). A reachable peer knows as soon as the first Echo comes; an unreachable one after
    `echo_wait_s`."""

    def ask(helper_id: str, address: str) -> bool | None:
        nonce = nonces.issue()
        ch = channel(address)
        try:
            request = stage_pb2.DialBackRequest(nonce=nonce)
            metadata = relay_metadata(signer, helper_id, "DialBack", request)
            stage_pb2_grpc.RelayStub(ch).DialBack(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError:
            return None  # that helper cannot tell
        finally:
            ch.close()
        # the helper dials once it has answered: the Echo's window opens at the answer, not at the question (on a
        # loaded machine the call itself took much of it, and a reachable peer was sent to a relay)
        return nonces.wait(nonce, echo_wait_s)

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
