"""The run's stop order: a signed DHT record that tells every peer of a run to checkpoint its own layers and exit.

`swarm stop` stores one under `{run}.stop`, in the subkey that carries the stopper's public key (hivemind's
`RSASignatureValidator`), so the record is signed by that key and nobody else can write or refresh it; its
value is `{run, issued_at, reason}` (and a proof of the run secret in a private run that has one). Peers read
the key every few seconds and obey an order only if all of these hold (`StopAuthority.check`):

- its signer may stop the run: in an owned run the owner's key or a trainer the owner delegates now (the
  manifest as the newest delegation changed it; a revoked trainer no longer); in a private run with
  `--trainers`, one of those; in an unowned, open run anyone who can reach its DHT (who can already plan it
  and name its trainers: such a run has no authority to ask; its peers log the signer's id);
- in a run with a `--run-secret`, its proof (HMAC-SHA256 of the order under the secret) is right;
- it names this run, lies at most MAX_CLOCK_SKEW_S in the future, and does not live longer than MAX_STOP_TTL_S;
- it was issued after the peer started (`issued_after`): an order outlives its run by up to its TTL, and a
  run restarted from its checkpoints in that time must not stop again.

A replayed order is the same order (the signature covers its value and expiration), so it stops nothing that
the order itself would not have stopped.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hivemind.dht.crypto import RSASignatureValidator

from swarm.peers.entries import peer_id_of
from swarm.peers.fields import fail, float_field, peer_id_field, set_field
from swarm.peers.manifest import canonical
from swarm.peers.records import MAX_CLOCK_SKEW_S

if TYPE_CHECKING:
    from swarm.peers.dht import SwarmDHT

__all__ = [
    "MAX_STOP_TTL_S",
    "STOP_KIND",
    "StopAuthority",
    "StopOrder",
    "issue_stop",
    "parse_stop_entry",
    "stop_authority",
    "stop_orders",
]

STOP_KIND = "stop"
"""The record kind: the DHT key is `{run}.stop`."""
MAX_STOP_TTL_S = 600.0
"""Longest lifetime a stop order may ask for, in seconds (plus MAX_CLOCK_SKEW_S)."""
_MAX_REASON = 200
_MAX_TIME_S = 1e11
_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
_PROOF_DOMAIN = b"swarm-stop/1\n"
_PROOF_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class StopOrder:
    """One stop order, as read from the DHT (validated) or about to be stored."""

    run: str
    """The run name it stops (an owned run's: its id)."""
    issued_at: float
    """When it was issued, DHT time (seconds since the epoch)."""
    reason: str = ""
    """Why, in at most 200 printable characters (logged by every peer)."""
    signer: str = ""
    """The peer id of the key that signed it: from the record's subkey, never from its value."""
    proof: str = ""
    """A private run's proof that the stopper knows the run secret (`prove`); empty otherwise."""

    def __post_init__(self) -> None:
        r = type(self).__name__
        if type(self.run) is not str or not 0 < len(self.run) <= 64:
            raise fail(r, "run", "a run name of 1-64 characters", self.run)
        set_field(self, "issued_at", float_field(r, "issued_at", self.issued_at, 0.0, _MAX_TIME_S))
        if self.signer:
            peer_id_field(r, "signer", self.signer)
        if type(self.reason) is not str or len(self.reason) > _MAX_REASON or not self.reason.isprintable():
            raise fail(r, "reason", f"at most {_MAX_REASON} printable characters", self.reason)
        if type(self.proof) is not str or (self.proof and _PROOF_RE.fullmatch(self.proof) is None):
            raise fail(r, "proof", "64 hex digits or nothing", self.proof)

    def to_wire(self) -> dict[str, Any]:
        """The record's value (the signer is the subkey's)."""
        wire = {"run": self.run, "issued_at": self.issued_at, "reason": self.reason}
        return {**wire, "proof": self.proof} if self.proof else wire

    def prove(self, secret: str) -> StopOrder:
        """This order with its proof of the run secret (signer set: the proof binds it)."""
        return StopOrder(self.run, self.issued_at, self.reason, self.signer, self._mac(secret))

    def _mac(self, secret: str) -> str:
        body = canonical({"run": self.run, "issued_at": self.issued_at, "reason": self.reason, "signer": self.signer})
        return hmac.new(secret.encode(), _PROOF_DOMAIN + body, hashlib.sha256).hexdigest()

    def proves(self, secret: str) -> bool:
        return bool(self.proof) and hmac.compare_digest(self.proof, self._mac(secret))

    def issued_after(self, started_at: float) -> bool:
        """Whether it was issued after a peer that started at `started_at` did (so it is meant for that peer)."""
        return self.issued_at > started_at


def parse_stop_entry(run: str, subkey: Any, value: Any, expiration: float, now: float) -> StopOrder:
    """The stop order in one DHT entry under `{run}.stop`; ValueError naming what is wrong.

    The subkey must carry the signer's public key (hivemind checked the signature over key, subkey, value and
    expiration before this is called), and nothing after it."""
    if not isinstance(subkey, bytes) or (match := _OWNER_RE.fullmatch(subkey)) is None:
        raise ValueError("StopOrder: its subkey carries no owner public key (an unsigned record)")
    if not isinstance(value, dict) or not set(value) <= {"run", "issued_at", "reason", "proof"}:
        raise ValueError(f"StopOrder: expected an object of run, issued_at, reason (and proof), got {str(value)[:80]}")
    order = StopOrder(
        value.get("run"), value.get("issued_at"), value.get("reason", ""), peer_id_of(match.group(1)),
        value.get("proof", ""),
    )  # fmt: skip
    if order.run != run:
        raise ValueError(f"StopOrder.run: for run {order.run[:64]!r}, not {run!r}")
    if not expiration <= now + MAX_STOP_TTL_S + MAX_CLOCK_SKEW_S:
        raise ValueError(f"StopOrder: expires {expiration - now:.0f} s from now, past the {MAX_STOP_TTL_S:.0f} s bound")
    if order.issued_at > now + MAX_CLOCK_SKEW_S:
        raise ValueError(f"StopOrder.issued_at: lies {order.issued_at - now:.0f} s in the future")
    return order


@dataclass(frozen=True)
class StopAuthority:
    """Who may stop a run: see the module's docstring."""

    signers: frozenset[str] | None
    """Peer ids whose orders count; None: anyone's (an unowned, open run)."""
    secret: str | None = None
    """The private run's secret the order must prove; None: no proof asked."""
    what: str = "any peer (unowned run)"
    """Who `signers` are, in words, for the refusal."""

    def __repr__(self) -> str:  # logged: the secret must never be
        secret = "<hidden>" if self.secret else None
        return f"StopAuthority(signers={self.signers!r}, secret={secret}, what={self.what!r})"

    def check(self, order: StopOrder) -> None:
        """Returns if `order` may stop the run; ValueError naming its signer and why not otherwise."""
        if self.signers is not None and order.signer not in self.signers:
            raise ValueError(f"stop order from {order.signer} refused: only {self.what} may stop this run")
        if self.secret is not None and not order.proves(self.secret):
            raise ValueError(f"stop order from {order.signer} refused: it does not prove the run secret")


def stop_authority(dht: SwarmDHT) -> StopAuthority:
    """Who may stop the run `dht` is joined to, from what it knows of the run (the owner's documents, or the
    private run's flags)."""
    config, manifest = dht.config, dht.manifest
    if manifest is not None:
        authority = dht.authority()
        trainers = authority.trainers if authority is not None else frozenset(manifest.trainers)
        return StopAuthority(frozenset({manifest.owner_id}) | trainers, config.run_secret, "its owner or trainers")
    if config.allowed_trainers:
        return StopAuthority(frozenset(config.allowed_trainers), config.run_secret, "its trainers (--trainers)")
    return StopAuthority(None, config.run_secret, "any peer (unowned run)")


def issue_stop(
    dht: SwarmDHT, reason: str = "", issued_at: float | None = None, ttl_s: float = MAX_STOP_TTL_S
) -> StopOrder:
    """Stores a stop order for `dht`'s run, signed with `dht`'s key (with the proof of the run secret, if the
    run has one); returns it. Raises RuntimeError when no DHT node took it."""
    from hivemind.utils import get_dht_time

    order = StopOrder(dht.config.run_name, get_dht_time() if issued_at is None else issued_at, reason, dht.peer_id)
    if dht.config.run_secret is not None:
        order = order.prove(dht.config.run_secret)
    if not dht.store_signed(STOP_KIND, order.to_wire(), min(ttl_s, MAX_STOP_TTL_S)):
        raise RuntimeError(f"no DHT node stored the stop order of run {order.run}")
    return order


def stop_orders(dht: SwarmDHT, now: float | None = None) -> tuple[list[StopOrder], list[str]]:
    """The run's valid stop orders (any signer: `StopAuthority.check` says which count) and why each other
    entry was skipped."""
    from hivemind.utils import get_dht_time

    now = get_dht_time() if now is None else now
    orders, skipped = [], []
    for subkey, value, expiration in dht.read_signed(STOP_KIND):
        try:
            orders.append(parse_stop_entry(dht.config.run_name, subkey, value, expiration, now))
        except ValueError as e:
            skipped.append(str(e))
    return orders, skipped
