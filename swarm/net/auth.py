"""Who is calling: signed, expiring call tokens, and a per-call proof that binds each call to its own fields.

A peer's id is the hash of its RSA public key (`swarm.peers.dht.peer_id_of`), the key that already signs
its DHT records. A caller proves that id to a callee with a token it signs once per callee and lifetime, and
the token delegates to a short-lived Ed25519 key of the caller's (one per signer, renewed with its tokens):

    magic "swt2" | u16 body length | body | u8 mac length | mac | signature (base64 RSA-PSS, the rest)
    body = u16 key length | caller public key (OpenSSH) | u8 audience length | audience peer id
           | f64 issued_at | f64 expires_at | 8 random bytes | 32-byte Ed25519 public key (the delegate)

`mac` is HMAC-SHA256 of the body under the run secret (empty without one); the signature covers everything
before it. A token alone is a bearer credential: whoever captures it (an on-path observer, a relay, which
forwards gRPC in plaintext) could send it again. So each stage call also carries a proof (metadata
`swarm-proof-bin`), signed with the delegate key:

    magic "swp1" | 16-byte nonce | f64 timestamp | Ed25519 signature (64 bytes)
    signed: "swarm call proof v1\\0" | audience | method path | SHA-256 of the call's fields | nonce | timestamp

the call's fields being its unary request, or the first item of a client stream (the call info with the
frame header and first chunk, or the token batch). The callee (`CallVerifier`) checks the token once (format,
size, audience, lifetime, secret and RSA signature; verified tokens are remembered, bounded), then each call's
proof: fresh (`FRESH_S` plus `CLOCK_SKEW_S`), signed by the token's delegate over this callee, this method and
these fields, and a nonce it has not seen within that window (`ReplayCache`). A captured token and proof are
then good for that one call, once: not for another method, other fields, another callee, or a second time.
Authorization (who may call what) is the stage service's (`swarm.runtime.policy`), not this module's.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.peers.dht import peer_id_of
from swarm.peers.dht_config import load_or_create_key

__all__ = [
    "CLOCK_SKEW_S",
    "FRESH_S",
    "PROOF_BYTES",
    "PROOF_KEY",
    "TOKEN_KEY",
    "AuthError",
    "CallSigner",
    "CallVerifier",
    "Identity",
    "PendingCall",
    "ReplayCache",
    "call_digest",
]

TOKEN_KEY = "swarm-token-bin"
"""gRPC metadata key of a call token (the -bin suffix: binary value)."""
PROOF_KEY = "swarm-proof-bin"
"""gRPC metadata key of a call's proof (`CallSigner.metadata` with a method)."""

MAGIC = b"swt2"
PROOF_MAGIC = b"swp1"
MAX_TOKEN_BYTES = 4096
"""A token larger than this is refused unparsed (a 2048-bit key and signature take about 800 bytes)."""
MAX_TTL_S = 3600.0
"""Longest lifetime a verifier accepts: a leaked token (with its delegate key) is good for at most this long."""
CLOCK_SKEW_S = 60.0
"""How far peers' clocks may differ: a token's issue time or a proof's timestamp may lie this far ahead."""
FRESH_S = 60.0
"""How long a call's proof is good for after its timestamp (the call's way to the callee and its wait for a
server thread); a proof is accepted from FRESH_S + CLOCK_SKEW_S in the past to CLOCK_SKEW_S in the future."""
CACHE_SIZE = 1024
"""Verified tokens a verifier remembers."""
REPLAY_CACHE_SIZE = 1 << 15
"""Call nonces a verifier remembers (about 6 MB): past it, the oldest are dropped and calls dated at or before
them are refused, so a flood narrows the window a call may take but never lets a replay through."""

_HEAD = struct.Struct("!4sH")
_TIMES = struct.Struct("!dd")
_PROOF = struct.Struct("!4s16sd64s")
PROOF_BYTES = _PROOF.size
"""Length of a call proof (92 bytes): a relay's data port reads one from a hello (`swarm.net.splice`)."""
_PROOF_CONTEXT = b"swarm call proof v1\0"
_DELEGATE_BYTES = 32


class AuthError(Exception):
    """A call's identity could not be established; the message says what is wrong."""


class Identity:
    """A peer's RSA key and the peer id it hashes to.

    Args:
        key: hivemind's RSAPrivateKey, the one that signs the peer's DHT records.
    """

    def __init__(self, key: RSAPrivateKey):
        self.key = key
        self.public_key = key.get_public_key().to_bytes()
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh key (about 50-100 ms of RSA key generation)."""
        return cls(RSAPrivateKey())

    @classmethod
    def load(cls, path: str) -> Identity:
        """The key kept in `path` (DER), created there with mode 0600 if missing, so a peer keeps its id."""
        return cls(load_or_create_key(path))

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


def _mac(secret: str | None, body: bytes) -> bytes:
    if secret is None:
        return b""
    return hmac.new(hashlib.sha256(secret.encode()).digest(), body, hashlib.sha256).digest()


def call_digest(fields: Any) -> bytes:
    """SHA-256 of a call's own fields as they travel: serialized bytes as they are, a protobuf message
    serialized (deterministically: the caller hashes what it sends, the callee what it parsed), None as empty."""
    if fields is None:
        data = b""
    elif isinstance(fields, (bytes, bytearray, memoryview)):
        data = fields
    else:
        data = fields.SerializeToString(deterministic=True)
    return hashlib.sha256(data).digest()


def _proof_message(audience: str, method: str, digest: bytes, nonce: bytes, timestamp: float) -> bytes:
    aud, name = audience.encode()[:255], method.encode()[:255]
    return b"".join(
        (_PROOF_CONTEXT, bytes([len(aud)]), aud, bytes([len(name)]), name, digest, nonce, struct.pack("!d", timestamp))
    )


class _Delegate:
    """A signer's Ed25519 key of the moment, renewed with its tokens: a leaked one dies with them."""

    def __init__(self, renew_at: float):
        self.key = Ed25519PrivateKey.generate()
        self.public = self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.renew_at = renew_at


class CallSigner:
    """Signs the tokens a caller attaches to its calls, one per callee, renewed at half their lifetime, and
    each call's proof.

    Args:
        identity: the caller's key.
        run_secret: the run's shared secret (private runs): tokens then also carry an HMAC under it.
        ttl_s: lifetime of a token and of the delegate key it names.
    """

    def __init__(self, identity: Identity, run_secret: str | None = None, ttl_s: float = 600.0):
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"CallSigner.ttl_s: expected (0, {MAX_TTL_S:g}] s, got {ttl_s}")
        self.identity, self.run_secret, self.ttl_s = identity, run_secret, ttl_s
        self._cache: dict[str, tuple[float, tuple[tuple[str, bytes], ...], _Delegate]] = {}
        self._delegate: _Delegate | None = None
        self._lock = threading.Lock()

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def _current_delegate(self) -> _Delegate:
        now = time.monotonic()
        with self._lock:
            if self._delegate is None or now >= self._delegate.renew_at:
                self._delegate = _Delegate(now + self.ttl_s / 2)
            return self._delegate

    def token(self, audience: str, now: float | None = None, delegate: _Delegate | None = None) -> bytes:
        """A fresh token for calls to the peer `audience` (not cached), delegating to `delegate` (the current
        delegate key if None)."""
        now = time.time() if now is None else now
        delegate = delegate or self._current_delegate()
        aud, key = audience.encode(), self.identity.public_key
        if len(aud) > 255 or len(key) > 65535:
            raise ValueError(f"audience {audience[:40]!r} or key too long for a token")
        body = (
            struct.pack("!H", len(key)) + key + bytes([len(aud)]) + aud
            + _TIMES.pack(now, now + self.ttl_s) + os.urandom(8) + delegate.public
        )  # fmt: skip
        mac = _mac(self.run_secret, body)
        signed = _HEAD.pack(MAGIC, len(body)) + body + bytes([len(mac)]) + mac
        return signed + self.identity.sign(signed)

    def _cached(self, audience: str) -> tuple[tuple[tuple[str, bytes], ...], _Delegate]:
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(audience)
            if cached is not None and now < cached[0]:
                return cached[1], cached[2]
        delegate = self._current_delegate()
        md = ((TOKEN_KEY, self.token(audience, delegate=delegate)),)
        with self._lock:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            self._cache[audience] = (now + self.ttl_s / 2, md, delegate)
        return md, delegate

    def metadata(
        self, audience_peer_id: str, method: str | None = None, fields: Any = None, now: float | None = None
    ) -> tuple[tuple[str, bytes], ...]:
        """The gRPC metadata of a call to `audience_peer_id`: the cached token (re-signed at half its life), and
        with `method` (the call's path, "/swarm.Stage/Step") a fresh proof of this one call over `fields` (its
        request, or its stream's first item; see `call_digest`). A stage and a relay refuse a call without its
        proof."""
        md, delegate = self._cached(audience_peer_id)
        if method is None:
            return md
        return (*md, (PROOF_KEY, self.proof(audience_peer_id, method, fields, delegate, now)))

    def proof(
        self, audience: str, method: str, fields: Any, delegate: _Delegate | None = None, now: float | None = None
    ) -> bytes:
        """One call's proof: the delegate key's signature over callee, method, the fields' digest, a fresh nonce
        and the time (`now`, for tests)."""
        delegate = delegate or self._cached(audience)[1]
        now = time.time() if now is None else now
        nonce = os.urandom(16)
        signature = delegate.key.sign(_proof_message(audience, method, call_digest(fields), nonce, now))
        return _PROOF.pack(PROOF_MAGIC, nonce, now, signature)


@dataclass(frozen=True)
class _Token:
    signed: bytes
    """everything the signature covers"""
    signature: bytes
    key: bytes
    audience: str
    issued_at: float
    expires_at: float
    delegate: bytes
    body: bytes
    mac: bytes


def _parse(token: bytes) -> _Token:
    if len(token) < _HEAD.size or token[:4] != MAGIC:
        raise AuthError(f"unknown token format (expected magic {MAGIC!r})")
    _, body_len = _HEAD.unpack_from(token)
    end = _HEAD.size + body_len
    if end + 1 > len(token):
        raise AuthError("malformed token: truncated body")
    body, mac_len = token[_HEAD.size : end], token[end]
    signed_end = end + 1 + mac_len
    if signed_end >= len(token):
        raise AuthError("malformed token: truncated mac or no signature")
    try:
        (key_len,) = struct.unpack_from("!H", body)
        key = body[2 : 2 + key_len]
        aud_len = body[2 + key_len]
        aud = body[3 + key_len : 3 + key_len + aud_len]
        at = 3 + key_len + aud_len
        issued, expires = _TIMES.unpack_from(body, at)
        delegate = body[at + _TIMES.size + 8 :]
    except (struct.error, IndexError):
        raise AuthError("malformed token: bad body") from None
    if len(key) != key_len or len(aud) != aud_len or len(delegate) != _DELEGATE_BYTES:
        raise AuthError("malformed token: bad body")
    return _Token(
        signed=token[:signed_end], signature=token[signed_end:], key=key, audience=aud.decode(errors="replace"),
        issued_at=issued, expires_at=expires, delegate=delegate, body=body, mac=token[end + 1 : signed_end],
    )  # fmt: skip


@dataclass(frozen=True)
class _Verified:
    """A verified token: whose, until when, and the key its calls' proofs must verify under."""

    caller: str
    expires_at: float
    delegate: Ed25519PublicKey


class ReplayCache:
    """Nonces of verified calls, each remembered until its proof's timestamp leaves the accepted window.

    Bounded: when full, the entry with the oldest timestamp goes and `floor` rises to that timestamp; a proof
    dated at or before the floor is refused. So no nonce is ever accepted twice (one still within the window is
    either remembered or at or before the floor), and a flood of fresh nonces only narrows how late an honest
    call may arrive, to the time the last `capacity` calls took.

    Args:
        capacity: nonces remembered at most.
        retain_s: how long after its timestamp a proof is still accepted (FRESH_S + CLOCK_SKEW_S).
    """

    def __init__(self, capacity: int = REPLAY_CACHE_SIZE, retain_s: float = FRESH_S + CLOCK_SKEW_S):
        if capacity < 1:
            raise ValueError(f"ReplayCache.capacity: expected >= 1, got {capacity}")
        self.capacity, self.retain_s = capacity, retain_s
        self.floor = -math.inf
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: bytes, timestamp: float, now: float) -> None:
        """Remembers `nonce`, or raises AuthError if it was seen or the cache no longer covers `timestamp`."""
        with self._lock:
            while self._by_time and self._by_time[0][0] + self.retain_s < now:
                self._seen.discard(heapq.heappop(self._by_time)[1])
            if nonce in self._seen:
                raise AuthError("replayed call: its proof's nonce was used already")
            if timestamp <= self.floor:
                raise AuthError(
                    f"call proof dated {now - timestamp:.1f} s ago is older than the {self.capacity} calls "
                    f"this peer remembers (a flood of calls): send it again"
                )
            if len(self._seen) >= self.capacity and timestamp <= self._by_time[0][0]:
                raise AuthError(
                    f"call proof dated {now - timestamp:.1f} s ago is older than every call this peer remembers "
                    f"(a flood of calls): send it again"
                )
            while len(self._seen) >= self.capacity:
                oldest, gone = heapq.heappop(self._by_time)
                self._seen.discard(gone)
                self.floor = max(self.floor, oldest)
            self._seen.add(nonce)
            heapq.heappush(self._by_time, (timestamp, nonce))


class PendingCall:
    """A call whose token verified and whose proof is well-formed and fresh, waiting for its fields (a stream's
    first item) to check the proof against (`check`)."""

    def __init__(
        self, verifier: CallVerifier, caller: _Verified, method: str, nonce: bytes, timestamp: float, signature: bytes
    ):
        self.verifier, self.verified, self.method = verifier, caller, method
        self.nonce, self.timestamp, self.signature = nonce, timestamp, signature

    @property
    def caller(self) -> str:
        return self.verified.caller

    def check(self, fields: Any, now: float | None = None) -> str:
        """The caller's peer id once the proof signs `fields` and its nonce is new; raises AuthError otherwise."""
        now = time.time() if now is None else now
        message = _proof_message(self.verifier.peer_id, self.method, call_digest(fields), self.nonce, self.timestamp)
        try:
            self.verified.delegate.verify(self.signature, message)
        except InvalidSignature:
            raise AuthError(
                f"bad call proof: it does not sign this call ({self.method} to {self.verifier.peer_id} with these "
                f"fields)"
            ) from None
        self.verifier.replays.admit(self.nonce, self.timestamp, now)
        return self.caller


class CallVerifier:
    """Establishes who made a call from its token and proof; the callee's side of `CallSigner`.

    Args:
        peer_id: this peer's id: only tokens and proofs naming it as audience are accepted.
        run_secret: the run's shared secret; with one, tokens without a valid HMAC under it are refused.
        cache_size: verified tokens remembered (each then costs a dictionary lookup instead of an RSA check).
        replay_cache_size: call nonces remembered (`ReplayCache`).
    """

    def __init__(
        self,
        peer_id: str,
        run_secret: str | None = None,
        cache_size: int = CACHE_SIZE,
        replay_cache_size: int = REPLAY_CACHE_SIZE,
    ):
        self.peer_id, self.run_secret, self.cache_size = peer_id, run_secret, cache_size
        self.replays = ReplayCache(replay_cache_size)
        self._cache: OrderedDict[bytes, _Verified] = OrderedDict()
        self._lock = threading.Lock()

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None, now: float | None = None) -> str:
        """The caller's peer id from a call's token alone (a call served by token alone could be replayed: stage
        and relay calls use `call`); raises AuthError naming what is wrong."""
        return self._verified(self._token(metadata), time.time() if now is None else now).caller

    def call(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, method: str, fields: Any, now: float | None = None
    ) -> str:
        """The caller's peer id once the token verifies and the call's proof signs this callee, `method` and
        `fields` with a new nonce; raises AuthError naming what is wrong."""
        return self.pending(metadata, method, now).check(fields, now)

    def pending(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, method: str, now: float | None = None
    ) -> PendingCall:
        """What a call's metadata alone establishes: the token's caller, and a well-formed, fresh proof, to be
        checked against the call's fields when they arrive (`PendingCall.check`)."""
        now = time.time() if now is None else now
        metadata = tuple(metadata or ())
        verified = self._verified(self._token(metadata), now)
        proofs = [value for key, value in metadata if key == PROOF_KEY]
        if not proofs:
            raise AuthError(f"missing call proof (metadata {PROOF_KEY}): the token alone is not enough")
        if len(proofs) > 1:
            raise AuthError(f"{len(proofs)} call proofs in one call")
        proof = proofs[0].encode() if isinstance(proofs[0], str) else proofs[0]
        if len(proof) != _PROOF.size or proof[:4] != PROOF_MAGIC:
            raise AuthError(f"malformed call proof ({len(proof)} bytes; expected {_PROOF.size} with {PROOF_MAGIC!r})")
        _, nonce, timestamp, signature = _PROOF.unpack(proof)
        if not math.isfinite(timestamp):
            raise AuthError(f"call proof dated {timestamp}: not a time")
        if timestamp > now + CLOCK_SKEW_S:
            raise AuthError(
                f"call proof dated {timestamp - now:.0f} s in the future (clock skew up to {CLOCK_SKEW_S:g} s)"
            )
        if timestamp < now - FRESH_S - CLOCK_SKEW_S:
            raise AuthError(
                f"stale call proof: dated {now - timestamp:.0f} s ago (good for {FRESH_S:g} s, clock skew up to "
                f"{CLOCK_SKEW_S:g} s)"
            )
        return PendingCall(self, verified, method, nonce, timestamp, signature)

    def _verified(self, token: bytes, now: float) -> _Verified:
        with self._lock:
            hit = self._cache.get(token)
            if hit is not None:
                self._cache.move_to_end(token)
        if hit is not None:
            if now > hit.expires_at:
                raise AuthError(f"token expired {now - hit.expires_at:.0f} s ago")
            return hit
        verified = self._verify(token, now)
        with self._lock:
            self._cache[token] = verified
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return verified

    def _token(self, metadata) -> bytes:
        found = [value for key, value in (metadata or ()) if key == TOKEN_KEY]
        if not found:
            raise AuthError(f"missing call token (metadata {TOKEN_KEY})")
        if len(found) > 1:
            raise AuthError(f"{len(found)} call tokens in one call")
        token = found[0]
        if isinstance(token, str):
            token = token.encode()
        if len(token) > MAX_TOKEN_BYTES:
            raise AuthError(f"token of {len(token)} bytes exceeds {MAX_TOKEN_BYTES}")
        return token

    def _verify(self, token: bytes, now: float) -> _Verified:
        t = _parse(token)
        if t.audience != self.peer_id:
            raise AuthError(f"wrong audience: the token is for peer {t.audience[:40]!r}, not {self.peer_id}")
        if not (t.issued_at <= t.expires_at and t.expires_at - t.issued_at <= MAX_TTL_S):
            raise AuthError(f"token lifetime {t.expires_at - t.issued_at:.0f} s is not within [0, {MAX_TTL_S:g}] s")
        if now > t.expires_at:
            raise AuthError(f"token expired {now - t.expires_at:.0f} s ago")
        if t.issued_at > now + CLOCK_SKEW_S:
            raise AuthError(f"token issued {t.issued_at - now:.0f} s in the future")
        if self.run_secret is not None and not hmac.compare_digest(t.mac, _mac(self.run_secret, t.body)):
            raise AuthError("wrong or missing run secret")
        try:
            public = RSAPublicKey.from_bytes(t.key)
        except Exception:
            raise AuthError("the token carries no valid RSA public key") from None
        if not public.verify(t.signed, t.signature):
            raise AuthError("bad signature")
        try:
            delegate = Ed25519PublicKey.from_public_bytes(t.delegate)
        except ValueError:
            raise AuthError("the token's delegate key is not an Ed25519 public key") from None
        return _Verified(peer_id_of(t.key), t.expires_at, delegate)
