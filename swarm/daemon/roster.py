"""Whom a peer's stage serves: the roster of the plan it follows, from the plan record and the announcements.

The plan names a peer id per stage and (`trainer_ids`) the trainers; the DHT announcements give the
addresses. In an owned run a stage serves only the trainers the owner delegates NOW (`AddressBook`'s
`delegated`): a trainer the owner revoked is refused by the stages at once, not only left out of the next plan.
Without a plan (`--assign even`) the roster is the one the trainers find themselves: the first
peer announcing each stage. `AddressBook` answers the reverse question, whose stage listens at an address,
so the peer's own calls (forward to the next stage, probes, state transfers) carry a token for the callee.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import grpc

from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.peers.records import PeerAnnouncement, PlanRecord
from swarm.runtime.policy import Roster

T = TypeVar("T")

log = logging.getLogger("swarm.daemon.roster")

__all__ = [
    "AddressBook",
    "PeerAuth",
    "delegated_trainers",
    "retry_refused",
    "roster_from_announcements",
    "roster_from_plan",
]


@dataclass(frozen=True)
class PeerAuth:
    """A process's identity in the run: its key (also its DHT key), the run's secret and trainer allowlist."""

    identity: Identity
    run_secret: str | None = None
    allowed_trainers: tuple[str, ...] = ()

    @classmethod
    def load(cls, dht_config) -> PeerAuth:
        """From a DHTConfig: the key at `signing_key_path` (created 0600 if missing; None: a fresh key)."""
        from swarm.peers.dht_config import load_or_create_key

        return cls(
            Identity(load_or_create_key(dht_config.signing_key_path)),
            getattr(dht_config, "run_secret", None),
            tuple(getattr(dht_config, "allowed_trainers", ())),
        )

    @cached_property
    def signer(self) -> CallSigner:
        return CallSigner(self.identity, self.run_secret)

    def verifier(self) -> CallVerifier:
        return CallVerifier(self.identity.peer_id, self.run_secret)


def delegated_trainers(dht) -> frozenset[str] | None:
    """The trainers the owner of `dht`'s owned run delegates now (revoked ones left out; the delegations re-read
    from the DHT at most every 2 s, `SwarmDHT.authority`); None in an unowned or private run."""
    authority = dht.authority()
    return None if authority is None else frozenset(authority.trainers)


def _trainers(
    named: Iterable[str] | None, allowed: Iterable[str], delegated: Iterable[str] | None = None
) -> frozenset[str] | None:
    """The plan's trainers, else the run's allowlist, else None (any authenticated trainer: a public run); in an
    owned run (`delegated` not None) only those of them the owner's current delegation names."""
    allowed = frozenset(allowed)
    if named is not None:
        named = frozenset(named)
        found = named & allowed if allowed else named
    else:
        found = allowed or None
    if delegated is None:
        return found
    return frozenset(delegated) if found is None else found & frozenset(delegated)


def roster_from_plan(
    record: PlanRecord,
    announcements: Iterable[PeerAnnouncement],
    allowed_trainers: Iterable[str] = (),
    known: dict[str, str] | None = None,
    delegated_trainers: Iterable[str] | None = None,
) -> Roster | None:
    """The roster of `record`: every replica of every stage at its announced address (nested `[stage][replica]`
    when the plan has replicas, flat with one), its trainers (`trainer_ids`, filtered by the run's
    allowlist and the owner's current delegation), and every peer it names.

    Args:
        record: the plan this peer follows.
        announcements: the peers announced now (their addresses).
        allowed_trainers: the run's trainer allowlist (private runs); empty: none.
        known: addresses known otherwise (e.g. this peer's own), by peer id.
        delegated_trainers: the trainers the owner of an owned run delegates now (revoked keys left out);
            None: not an owned run.

    Returns:
        None while a stage peer's address is unknown (not announced yet): the caller tries again later.
    """
    addresses = {a.peer_id: a.address for a in announcements}
    addresses.update(known or {})
    plan = record.document
    replicas = tuple(stage.peer_ids for stage in plan.stages)
    named = plan.named_peers()
    if any(p not in addresses for row in replicas for p in row):
        return None
    trainers = _trainers(plan.trainer_ids, allowed_trainers, delegated_trainers)
    if all(len(row) == 1 for row in replicas):  # flat: one route, the form every Roster takes
        return Roster(
            tuple(r[0] for r in replicas), tuple(addresses[r[0]] for r in replicas), trainers, frozenset(named)
        )
    nested_addresses = tuple(tuple(addresses[p] for p in row) for row in replicas)
    return Roster(replicas, nested_addresses, trainers, frozenset(named))


def roster_from_announcements(
    announcements: Iterable[PeerAnnouncement], n_stages: int, allowed_trainers: Iterable[str] = ()
) -> Roster | None:
    """The roster of an even split (no plan): the first peer announcing each stage, as `discover_route`
    picks them; None while a stage is not announced yet."""
    by_stage: dict[int, PeerAnnouncement] = {}
    for ann in sorted(announcements, key=lambda a: a.started_at):
        if ann.stage is not None and ann.stage < n_stages and ann.plan_version == 0:
            by_stage.setdefault(ann.stage, ann)
    if len(by_stage) < n_stages:
        return None
    peers = tuple(by_stage[s].peer_id for s in range(n_stages))
    return Roster(
        peers, tuple(by_stage[s].address for s in range(n_stages)), _trainers(None, allowed_trainers), frozenset(peers)
    )


class AddressBook:
    """address -> peer id of the stage service there, from the DHT's announcements.

    A miss re-reads the announcements, at most once per `refresh_s`, so an unknown address costs no more than
    one DHT request a second; callers then send no token and the callee refuses them by name.

    `delegated`: the trainers an owned run's owner delegates now (None: not an owned run), read each time a
    roster is made; `delegation_changed` tells the daemon to make the roster again when it moved.
    """

    def __init__(
        self,
        dht,
        allowed_trainers: Iterable[str] = (),
        refresh_s: float = 1.0,
        delegated: Callable[[], frozenset[str] | None] | None = None,
    ):
        self.dht, self.allowed_trainers, self.refresh_s = dht, tuple(allowed_trainers), refresh_s
        self.delegated = delegated or (lambda: None)
        self._peers: dict[str, str] = {}
        self._next = 0.0
        self._lock = threading.Lock()
        self._built_with: frozenset[str] | None = None
        """the delegation the last plan roster was made with"""

    def update(self, announcements: Iterable[PeerAnnouncement]) -> None:
        with self._lock:
            self._peers.update({a.address: a.peer_id for a in announcements})

    def _announced(self) -> list[PeerAnnouncement]:
        try:
            peers = self.dht.peers()
        except TimeoutError:
            return []
        self.update(peers)
        return peers

    def plan_roster(self, record: PlanRecord, mine: PeerAnnouncement) -> Roster | None:
        """The roster of `record` from the current announcements (and this peer's own, `mine`), its trainers
        those the owner delegates now."""
        self._built_with = delegated = self.delegated()
        return roster_from_plan(
            record, self._announced(), self.allowed_trainers, {mine.peer_id: mine.address}, delegated
        )

    def delegation_changed(self) -> bool:
        """Whether the owner's delegation of trainers moved since the last plan roster was made (a trainer revoked
        or delegated): the roster must be made again, so that the stage refuses a revoked trainer's calls now."""
        now = self.delegated()
        if now == self._built_with:
            return False
        log.info("the owner's trainers are now %s (were %s): the stage serves only them", sorted(now or ()),
                 sorted(self._built_with or ()))  # fmt: skip
        return True

    def even_roster(self, n_stages: int) -> Roster | None:
        """The roster of an even split from the current announcements."""
        return roster_from_announcements(self._announced(), n_stages, self.allowed_trainers)

    def __call__(self, address: str) -> str | None:
        with self._lock:
            found = self._peers.get(address)
            if found is not None or time.monotonic() < self._next:
                return found
            self._next = time.monotonic() + self.refresh_s
        try:
            self.update(self.dht.peers())
        except TimeoutError:
            return None
        with self._lock:
            return self._peers.get(address)


def retry_refused(stop: threading.Event, call: Callable[..., T], *args, timeout_s: float = 15.0, poll_s: float = 0.5):
    """`call(*args)`, again while it is refused as unauthorized, for up to `timeout_s` (or until `stop`).

    A peer taking over a stage under a new plan fetches its state from the holder under the old one; the
    holder serves state only to the peers of the plan it follows, and may see the new plan a moment later.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call(*args)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.PERMISSION_DENIED or time.monotonic() > deadline or stop.wait(poll_s):
                raise
