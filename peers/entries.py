"""Parsing the run's DHT entries (owned subkey, value, expiration) into records, refusing anything off-bounds.

Used twice: by the validator honest DHT nodes run before they store a record, and by readers, since a
dishonest node may return anything. Each parser raises ValueError naming what is wrong. Besides the record's
own fields, an entry must not outlive its kind's TTL bound (a record that would live for years can't be
replaced or expire) and its own timestamp must not lie in the future beyond MAX_CLOCK_SKEW_S. A peer's
planner lease must not reach further than MAX_PLANNER_LEASE_S (+ the skew) ahead: a lease for an hour would
keep a dead (or hostile) lease holder elected that long.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.peers.manifest import RunDelegation, RunManifest
from swarm.peers.records import (
    MAX_CLOCK_SKEW_S,
    MAX_PLANNER_LEASE_S,
    LinkMeasurement,
    PeerAnnouncement,
    PlanRecord,
    TrainerAnnouncement,
)
from swarm.peers.verdicts import VerdictCache

__all__ = [
    "LINK_SEP",
    "MANIFEST_SUBKEY",
    "MAX_TTL_S",
    "PLAN_SEP",
    "RunKeys",
    "RunRecordValidator",
    "parse_entry",
    "parse_run_entry",
    "peer_id_of",
]

logger = logging.getLogger(__name__)

_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
LINK_SEP, PLAN_SEP = b"->", b"#"

MAX_TTL_S = {
    "peers": 600.0,
    "trainers": 600.0,
    "links": 3600.0,
    "plan": 7200.0,
    "manifest": 3600.0,
    "delegations": 3600.0,
}
"""Longest lifetime a record of each kind may ask for, in seconds (plus MAX_CLOCK_SKEW_S)."""


def peer_id_of(public_key: bytes) -> str:
    """The swarm peer id of an RSA public key (as `RSAPublicKey.to_bytes()` gives it): 24 hex digits."""
    return hashlib.sha256(public_key).hexdigest()[:24]


def _owner_and_suffix(subkey: Any) -> tuple[str, bytes]:
    if not isinstance(subkey, bytes):
        raise ValueError(f"subkey: expected bytes, got {type(subkey).__name__}")
    match = _OWNER_RE.match(subkey)
    if match is None:
        raise ValueError("subkey: carries no owner public key (unsigned record)")
    return peer_id_of(match.group(1)), subkey[match.end() :]


def _announced(cls: type[PeerAnnouncement] | type[TrainerAnnouncement]):
    """The parser of an announcement record of `cls`: one per signer, under the signer's bare subkey."""

    def parse(subkey: Any, value: Any):
        owner, suffix = _owner_and_suffix(subkey)
        if suffix:
            raise ValueError(f"subkey: unexpected suffix {suffix[:32]!r}")
        try:
            ann = cls.from_wire(value)
        except ValueError as e:  # names its sender: a peer whose announcements are refused is findable
            raise ValueError(f"from {owner}: {e}") from None
        if ann.peer_id != owner:
            raise ValueError(f"{cls.__name__}.peer_id: {ann.peer_id} is not the signer's id {owner}")
        return ann, ann.started_at

    return parse


_announcement, _trainer = _announced(PeerAnnouncement), _announced(TrainerAnnouncement)


def _link(subkey: Any, value: Any) -> tuple[LinkMeasurement, float]:
    owner, suffix = _owner_and_suffix(subkey)
    link = LinkMeasurement.from_wire(value)
    if link.src != owner:
        raise ValueError(f"LinkMeasurement.src: {link.src} is not the signer's id {owner}")
    if suffix != LINK_SEP + link.dst.encode():
        raise ValueError(f"LinkMeasurement.dst: {link.dst} does not match the subkey suffix {suffix[:80]!r}")
    return link, link.measured_at


def _plan(subkey: Any, value: Any) -> tuple[tuple[str, PlanRecord], float]:
    owner, suffix = _owner_and_suffix(subkey)
    plan = PlanRecord.from_wire(value)
    if suffix != PLAN_SEP + str(plan.version).encode():
        raise ValueError(f"PlanRecord.version: {plan.version} does not match the subkey suffix {suffix[:32]!r}")
    return (owner, plan), plan.created_at


_PARSERS: dict[str, Callable[[Any, Any], tuple[Any, float]]] = {
    "peers": _announcement,
    "trainers": _trainer,
    "links": _link,
    "plan": _plan,
}


def parse_entry(kind: str, subkey: Any, value: Any, expiration: float, now: float | None = None) -> Any:
    """The record of one DHT entry of `kind` ('peers', 'trainers', 'links' or 'plan'); ValueError if invalid.

    For 'plan' the record is (owner peer id, PlanRecord).
    """
    now = get_dht_time() if now is None else now
    record, stamped = _PARSERS[kind](subkey, value)
    name = type(record[1] if kind == "plan" else record).__name__
    if not expiration <= now + MAX_TTL_S[kind] + MAX_CLOCK_SKEW_S:
        raise ValueError(f"{name}: expires {expiration - now:.0f} s from now, past the {MAX_TTL_S[kind]:.0f} s bound")
    if stamped > now + MAX_CLOCK_SKEW_S:
        raise ValueError(f"{name}: its timestamp lies {stamped - now:.0f} s in the future")
    lease = getattr(record, "planner_until", 0.0)
    if lease > now + MAX_PLANNER_LEASE_S + MAX_CLOCK_SKEW_S:
        raise ValueError(f"{name}.planner_until: {lease - now:.0f} s ahead, past the {MAX_PLANNER_LEASE_S:.0f} s bound")
    return record


MANIFEST_SUBKEY = "manifest"
"""The one subkey of `{run}.manifest`: the run's manifest (JSON text), unowned (anyone may store it: it verifies)."""


def parse_run_entry(kind: str, run: str, subkey: Any, value: Any, expiration: float, now: float | None = None) -> Any:
    """The verified `RunManifest` ('manifest') or `RunDelegation` ('delegations', under its sequence number) of
    run `run` in one DHT entry; ValueError naming what is wrong (another run's, forged, oversized...).

    Neither is signed by the storing peer (hivemind's owner subkeys): both are signed by the run's owner and
    hash to the run id, so any peer may store and refresh them and nobody can store another."""
    now = get_dht_time() if now is None else now
    if not expiration <= now + MAX_TTL_S[kind] + MAX_CLOCK_SKEW_S:
        raise ValueError(f"{kind}: expires {expiration - now:.0f} s from now, past the {MAX_TTL_S[kind]:.0f} s bound")
    if kind == "manifest":
        if subkey != MANIFEST_SUBKEY:
            raise ValueError(f"RunManifest: stored under subkey {str(subkey)[:32]!r}, not {MANIFEST_SUBKEY!r}")
        return RunManifest.from_json(value, run)
    delegation = RunDelegation.from_json(value)
    if delegation.run_id != run:
        raise ValueError(f"RunDelegation: for run {delegation.run_id}, not {run}")
    if subkey != delegation.sequence:
        raise ValueError(f"RunDelegation.sequence: {delegation.sequence} is not its subkey {str(subkey)[:32]!r}")
    return delegation


@dataclass(frozen=True)
class RunKeys:
    """The run's DHT keys, one per record kind."""

    peers: str
    trainers: str
    links: str
    plan: str
    manifest: str = ""
    """The owned run's manifest (`parse_run_entry`)."""
    delegations: str = ""
    """The owner's delegations, one per sequence number."""
    run: str = ""
    """The run name the keys are under (an owned run's: its id)."""

    @classmethod
    def of_run(cls, run_name: str) -> RunKeys:
        kinds = ("peers", "trainers", "links", "plan", "manifest", "delegations")
        return cls(*(f"{run_name}.{kind}" for kind in kinds), run=run_name)


class RunRecordValidator(RecordValidatorBase):
    """Lets honest DHT nodes refuse to store (or accept from others) malformed records under the run's keys.

    Runs after the signature validator (lower priority), on the value with the signature already stripped.
    Keys of other runs and applications pass untouched.
    """

    def __init__(self, keys: RunKeys):
        kinds = {keys.peers: "peers", keys.trainers: "trainers", keys.links: "links", keys.plan: "plan"}
        if keys.manifest:
            kinds.update({keys.manifest: "manifest", keys.delegations: "delegations"})
        self._kinds = {DHTID.generate(source=key).to_bytes(): kind for key, kind in kinds.items()}
        self._run = keys.run
        self.verdicts = VerdictCache()
        """Records of the run's keys found valid: not parsed again (`swarm.peers.verdicts`)."""

    def validate(self, record: DHTRecord) -> bool:
        kind = self._kinds.get(record.key)
        if kind is None:
            return True
        return self.verdicts.check(record, lambda r: self._validate(kind, r))

    def _validate(self, kind: str, record: DHTRecord) -> bool:
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return False  # the run's keys hold only dictionaries of owned subkeys, never a plain value
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
            if kind in ("manifest", "delegations"):
                parse_run_entry(kind, self._run, subkey, value, record.expiration_time)
            else:
                parse_entry(kind, subkey, value, record.expiration_time)
        except Exception as e:  # any failure to decode or validate means the record is refused
            logger.debug("refusing a record: %s", e)
            return False
        return True
