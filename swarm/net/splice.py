"""Raw TCP data paths for relayed connections: the bytes of a tunnel as plain TCP, not as gRPC frames.

The frame path (swarm/net/relay.py) carries each socket read as a `RelayFrame` through gRPC streams: behind
the testbed's router a relayed call cost about 0.6 ms more than a direct one, almost all of it the frames'
Python and gRPC handling, not the wire (`swarm experiment nat --netns --ping`). Here the attached peer P
dials the relay R's *data port* for each connection R asks it to accept and sends a hello; R checks it and
the connection's bytes are then copied between plain sockets (`splice`), paced and counted by R as before.
The Attach stream stays the control path: it names the data port and a fresh secret per connection, and P
falls back to the Accept stream when the data port cannot be reached (a volunteer who forwarded only the
gRPC port) or refuses it.

The hello, P's first bytes on a fresh connection to R's data port:

    magic b"swsp" | u8 version (2) | u64 conn_id | 16-byte secret | u16 token length | token | proof

`token` is P's call token for R (swarm.net.auth, the one its Attach carries) and `proof` (`PROOF_BYTES`) a call
proof of this hello: signed over the pseudo-method `HELLO_PATH` and the hello's head (magic to secret), so a
captured hello cannot be sent again (its nonce) nor its proof serve any call. R answers one byte (`TAKEN`)
when the hello names a connection R asked P, and only P, to accept and that no Accept or earlier hello took;
anything else closes the socket without a word. A stranger needs P's delegate key (a captured token is not
enough) and a secret R sent only over P's Attach. Hellos are read under a deadline and a bound on how many are
read at once. A caller C taking the data port R offered on its Connect sends the same hello.
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from swarm.net.auth import MAX_TOKEN_BYTES, PROOF_BYTES, PROOF_KEY, TOKEN_KEY, AuthError

__all__ = [
    "HELLO", "HELLO_PATH", "RAW_RETRY_S", "SECRET_BYTES", "TAKEN", "DataPort", "DataPortPaths", "dial_data_port",
    "hello", "hello_head", "new_secret", "shut", "splice",
]  # fmt: skip

log = logging.getLogger("swarm.relay")

MAGIC, VERSION = b"swsp", 2
HELLO = struct.Struct("!4sBQ16sH")
"""magic, version, conn_id, secret, token length (the token, then the proof, follow)"""
_HEAD = struct.Struct("!4sBQ16s")
HELLO_PATH = "/swarm.Relay/hello"
"""what a hello's proof signs as its method: no gRPC method has this path"""
SECRET_BYTES = 16
TAKEN = b"\x01"
RAW_RETRY_S = 60.0
"""After a relay's data port failed, connections through that relay take the frame path this long."""
ACCEPT_RETRY_S = 0.1
"""After a failed accept() (no descriptors left), the data port accepts again this much later."""
COPY_BYTES = 256 << 10
"""bytes read from a socket at once"""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def hello_head(conn_id: int, secret: bytes) -> bytes:
    """The hello's fields its proof signs (magic, version, conn_id, secret)."""
    return _HEAD.pack(MAGIC, VERSION, conn_id, secret)


def hello(conn_id: int, secret: bytes, signer, audience: str) -> bytes:
    """The hello of connection `conn_id` to the relay `audience`, signed by `signer` (a `CallSigner`)."""
    if len(secret) != SECRET_BYTES:
        raise ValueError("a hello takes a 16-byte secret")
    md = dict(signer.metadata(audience, HELLO_PATH, hello_head(conn_id, secret)))
    token, proof = md[TOKEN_KEY], md[PROOF_KEY]
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError("a hello takes a token of at most MAX_TOKEN_BYTES")
    return HELLO.pack(MAGIC, VERSION, conn_id, secret, len(token)) + token + proof


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # NAT mappings forget idle flows
    return sock


def shut(sock: socket.socket) -> None:
    """Shuts `sock` down, then closes it: the other end sees the end at once, and a thread blocked reading it
    returns."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _copy(src: socket.socket, dst: socket.socket, meter: Callable[[int], None] | None, failed: threading.Event):
    buf = bytearray(COPY_BYTES)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            if meter is not None:
                meter(n)
            dst.sendall(view[:n])
        dst.shutdown(socket.SHUT_WR)  # the end of this direction reaches the other side; the other goes on
    except OSError:
        failed.set()
        shut(src)
        shut(dst)


def splice(a: socket.socket, b: socket.socket, a_to_b=None, b_to_a=None) -> None:
    """Copies bytes between `a` and `b` both ways until both directions end (or either fails), then closes both.
    `a_to_b(n)` / `b_to_a(n)` meter each direction (pace and count) before its bytes are sent on. Blocks the
    calling thread for the connection's lifetime (one more thread carries the other direction)."""
    failed = threading.Event()
    other = threading.Thread(target=_copy, args=(b, a, b_to_a, failed), name="swarm-splice", daemon=True)
    other.start()
    _copy(a, b, a_to_b, failed)
    other.join()
    shut(a)
    shut(b)


def _read_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("hello too slow")
        sock.settimeout(left)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed during the hello")
        out += chunk
    return bytes(out)


class DataPort:
    """The relay's raw data port: reads hellos and hands each checked connection to `take`.

    Args:
        host: the address to listen on (the gRPC server's bind host).
        verifier: establishes the hello's peer id from its token (`CallVerifier.caller`).
        take: (conn_id, secret, peer id, socket) -> whether the connection was the relay's to take (it then
            owns the socket and has answered `TAKEN` on it); False closes it.
        port: 0 picks a free one.
        max_hellos: hellos read at once (beyond: closed at once).
        hello_timeout_s: how long one hello may take.
    """

    def __init__(self, host: str, verifier, take, port: int = 0, max_hellos: int = 16, hello_timeout_s: float = 5.0):
        self.verifier, self.take = verifier, take
        self.hello_timeout_s = hello_timeout_s
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.create_server((host.strip("[]"), port), family=family)
        self.port: int = self._sock.getsockname()[1]
        self._hellos = threading.BoundedSemaphore(max_hellos)
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="swarm-data-port", daemon=True).start()

    def _accept(self) -> socket.socket:
        return self._sock.accept()[0]

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                sock = self._accept()
            except OSError as e:
                if self._closed.is_set():
                    return
                # out of descriptors or buffers for a moment (a flood of connections): the port keeps serving
                log.warning("data port: accept failed (%s); accepting again", e)
                self._closed.wait(ACCEPT_RETRY_S)
                continue
            if not self._hellos.acquire(blocking=False):
                sock.close()
                continue
            threading.Thread(target=self._hello, args=(sock,), name="swarm-data-hello", daemon=True).start()

    def _hello(self, sock: socket.socket) -> None:
        taken = False
        try:
            deadline = time.monotonic() + self.hello_timeout_s
            magic, version, conn_id, secret, n = HELLO.unpack(_read_exact(sock, HELLO.size, deadline))
            if magic != MAGIC or version != VERSION or n > MAX_TOKEN_BYTES:
                raise ValueError("not a hello")
            token = _read_exact(sock, n, deadline)
            proof = _read_exact(sock, PROOF_BYTES, deadline)
            md = [(TOKEN_KEY, token), (PROOF_KEY, proof)]
            peer = self.verifier.call(md, HELLO_PATH, hello_head(conn_id, secret))
            sock.settimeout(None)
            taken = self.take(conn_id, secret, peer, _tune(sock))
        except (OSError, ValueError, struct.error, AuthError) as e:
            log.debug("data port: a hello refused: %s", e)
        finally:
            self._hellos.release()
            if not taken:
                shut(sock)

    def close(self) -> None:
        self._closed.set()
        shut(self._sock)


def dial_data_port(host: str, port: int, conn_id: int, secret: bytes, signer, audience: str, timeout_s: float):
    """A tunnel end's side: a connection to the data port of the relay `audience` that the relay took for
    `conn_id`, the hello signed by `signer`; or None (unreachable, refused, or no answer within `timeout_s`)."""
    try:
        sock = socket.create_connection((host.strip("[]"), port), timeout=timeout_s)
    except OSError as e:
        log.info("relay data port %s:%d unreachable: %s", host, port, e)
        return None
    try:
        sock.sendall(hello(conn_id, secret, signer, audience))
        if sock.recv(1) != TAKEN:
            raise ConnectionError("refused")
        sock.settimeout(None)
        return _tune(sock)
    except OSError as e:
        log.info("relay data port %s:%d did not take connection %d: %s", host, port, conn_id, e)
        shut(sock)
        return None


class DataPortPaths:
    """A tunnel end's use of relays' data ports (the attached peer's and the caller's alike): which relays' ports
    to try, and the dial; a relay whose port failed is not tried again for `RAW_RETRY_S` (a volunteer who
    forwarded only the gRPC port).

    Args:
        enabled: False: never (every connection's bytes go as frames).
        timeout_s: how long one dial and hello may take.
    """

    def __init__(self, enabled: bool, timeout_s: float):
        self.enabled, self.timeout_s = enabled, timeout_s
        self.failed: dict[str, float] = {}
        """relay address -> until when its data port is not tried"""

    def usable(self, relay_address: str) -> bool:
        return self.enabled and self.failed.get(relay_address, 0) < time.monotonic()

    def dial(
        self, relay_address: str, port: int, conn_id: int, secret: bytes, signer, relay_id: str
    ) -> socket.socket | None:
        """A connection the relay `relay_id` at `relay_address` took for `conn_id` on its data `port`, the hello
        signed by `signer` (a `CallSigner`; None: no hello can be made, so None); None when it failed."""
        if signer is None:
            return None
        host = relay_address.rsplit(":", 1)[0]
        sock = dial_data_port(host, port, conn_id, secret, signer, relay_id, self.timeout_s)
        if sock is None:
            self.failed[relay_address] = time.monotonic() + RAW_RETRY_S
        return sock
