"""Who is calling: signed, expiring call tokens in gRPC metadata, bound to the peers' DHT keys.

A peer's id is the hash of its RSA public key (`swarm.peers.dht.peer_id_of`), the key that already signs
its DHT records. A caller proves that id to a callee with a token it signs once per callee and lifetime:

    magic "swt1" | u16 body length | body | u8 mac length | mac | signature (base64 RSA-PSS, the rest)
    body = u16 key length | caller public key (OpenSSH) | u8 audience length | audience peer id
           | f64 issued_at | f64 expires_at | 8 random bytes

`mac` is HMAC-SHA256 of the body under the run secret (empty without one); the signature covers everything
before it. The callee (`CallVerifier`) checks format, size, audience, lifetime, secret and signature, and
remembers verified tokens (bounded), so a token costs one RSA verification per callee, not one per call.
Authorization (who may call what) is the stage service's (`swarm.runtime.policy`), not this module's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.peers.dht import load_or_create_key, peer_id_of

__all__ = ["TOKEN_KEY", "AuthError", "CallSigner", "CallVerifier", "Identity"]

TOKEN_KEY = "swarm-token-bin"
"""gRPC metadata key of a call token (the -bin suffix: binary value)."""

MAGIC = b"swt1"
MAX_TOKEN_BYTES = 4096
"""A token larger than this is refused unparsed (a 2048-bit key and signature take about 800 bytes)."""
MAX_TTL_S = 3600.0
"""Longest lifetime a verifier accepts: a leaked token is useful to an attacker for at most this long."""
CLOCK_SKEW_S = 60.0
"""How far in the future a token's issue time may lie (peers' clocks differ)."""
CACHE_SIZE = 1024
"""Verified tokens a verifier remembers."""

_HEAD = struct.Struct("!4sH")
_TIMES = struct.Struct("!dd")


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


class CallSigner:
    """Signs the tokens a caller attaches to its calls, one per callee, renewed at half their lifetime.

    Args:
        identity: the caller's key.
        run_secret: the run's shared secret (private runs): tokens then also carry an HMAC under it.
        ttl_s: lifetime of a token; a stolen token can be replayed to its callee until it expires.
    """

    def __init__(self, identity: Identity, run_secret: str | None = None, ttl_s: float = 600.0):
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"CallSigner.ttl_s: expected (0, {MAX_TTL_S:g}] s, got {ttl_s}")
        self.identity, self.run_secret, self.ttl_s = identity, run_secret, ttl_s
        self._cache: dict[str, tuple[float, tuple[tuple[str, bytes], ...]]] = {}
        self._lock = threading.Lock()

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def token(self, audience: str, now: float | None = None) -> bytes:
        """A fresh token for calls to the peer `audience` (not cached)."""
        now = time.time() if now is None else now
        aud, key = audience.encode(), self.identity.public_key
        if len(aud) > 255 or len(key) > 65535:
            raise ValueError(f"audience {audience[:40]!r} or key too long for a token")
        body = (
            struct.pack("!H", len(key)) + key + bytes([len(aud)]) + aud
            + _TIMES.pack(now, now + self.ttl_s) + os.urandom(8)
        )  # fmt: skip
        mac = _mac(self.run_secret, body)
        signed = _HEAD.pack(MAGIC, len(body)) + body + bytes([len(mac)]) + mac
        return signed + self.identity.sign(signed)

    def metadata(self, audience_peer_id: str) -> tuple[tuple[str, bytes], ...]:
        """The gRPC metadata of a call to `audience_peer_id`: the cached token, re-signed at half its life."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(audience_peer_id)
            if cached is not None and now < cached[0]:
                return cached[1]
        md = ((TOKEN_KEY, self.token(audience_peer_id)),)
        with self._lock:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            self._cache[audience_peer_id] = (now + self.ttl_s / 2, md)
        return md


@dataclass(frozen=True)
class _Token:
    signed: bytes
    """everything the signature covers"""
    signature: bytes
    key: bytes
    audience: str
    issued_at: float
    expires_at: float
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
        issued, expires = _TIMES.unpack_from(body, 3 + key_len + aud_len)
    except (struct.error, IndexError):
        raise AuthError("malformed token: bad body") from None
    if len(key) != key_len or len(aud) != aud_len:
        raise AuthError("malformed token: bad body")
    return _Token(
        signed=token[:signed_end], signature=token[signed_end:], key=key, audience=aud.decode(errors="replace"),
        issued_at=issued, expires_at=expires, body=body, mac=token[end + 1 : signed_end],
    )  # fmt: skip


class CallVerifier:
    """Establishes who made a call from its token; the callee's side of `CallSigner`.

    Args:
        peer_id: this peer's id: only tokens naming it as audience are accepted.
        run_secret: the run's shared secret; with one, tokens without a valid HMAC under it are refused.
        cache_size: verified tokens remembered (each then costs a dictionary lookup instead of an RSA check).
    """

    def __init__(self, peer_id: str, run_secret: str | None = None, cache_size: int = CACHE_SIZE):
        self.peer_id, self.run_secret, self.cache_size = peer_id, run_secret, cache_size
        self._cache: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None, now: float | None = None) -> str:
        """The caller's peer id, from a call's invocation metadata; raises AuthError naming what is wrong."""
        now = time.time() if now is None else now
        token = self._token(metadata)
        with self._lock:
            hit = self._cache.get(token)
            if hit is not None:
                self._cache.move_to_end(token)
        if hit is not None:
            caller, expires = hit
            if now > expires:
                raise AuthError(f"token expired {now - expires:.0f} s ago")
            return caller
        caller, expires = self._verify(token, now)
        with self._lock:
            self._cache[token] = (caller, expires)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return caller

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

    def _verify(self, token: bytes, now: float) -> tuple[str, float]:
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
        return peer_id_of(t.key), t.expires_at
