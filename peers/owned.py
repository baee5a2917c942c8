"""An owned run as one member holds it: the verified manifest, the owner's delegations read from the DHT, and
the re-publishing of both that keeps the run alive as long as any member is.

`SwarmDHT` composes one per owned run (`DHTConfig.run`) and answers `authority()`, `planners()` and
`publish_run()` through it. The records themselves (`swarm.peers.manifest`) are self-verifying, so whoever
stored them does not matter: any member may (re)store them, and nobody can store another run's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from swarm.peers.entries import MANIFEST_SUBKEY, MAX_TTL_S
from swarm.peers.manifest import AuthorityTracker, RunAuthority, RunDelegation, RunManifest

__all__ = ["OwnedRun"]

logger = logging.getLogger("swarm.peers.dht")


class OwnedRun:
    """The owned run's manifest and current authority, refreshed from the DHT as it is read.

    Args:
        manifest: the run's verified manifest.
        read: the run's verified records of a kind ("delegations"), as the DHT holds them now (may raise
            TimeoutError: the last authority is kept).
        store: stores (kind, subkey, JSON text, ttl_s) under the run's key of that kind; whether a node took it.
        warn: logs a message once (the DHT's de-duplicated warnings).
    """

    def __init__(
        self,
        manifest: RunManifest,
        read: Callable[[str], list[Any]],
        store: Callable[[str, Any, str, float], bool],
        warn: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.tracker = AuthorityTracker(manifest)
        self._read, self._store, self._warn, self._clock = read, store, warn, clock
        self._read_at = self._published_at = -math.inf

    @property
    def manifest(self) -> RunManifest:
        return self.tracker.manifest

    @property
    def newest(self) -> RunDelegation | None:
        """The newest valid delegation seen so far."""
        return self.tracker.newest

    def authority(self, max_age_s: float = 2.0) -> RunAuthority:
        """The manifest's delegates as the newest valid delegation changed them, re-reading the delegations at
        most every `max_age_s`; a foreign or forged one is refused by name (once)."""
        if self._clock() - self._read_at >= max_age_s:
            self._read_at = self._clock()
            run, found = self.manifest.run_id, []
            try:
                for d in self._read("delegations"):
                    try:
                        found.append(d.check_for(self.manifest))
                    except ValueError as e:
                        self._warn(f"run {run}: refusing a delegation: {e}")
            except TimeoutError as e:
                logger.debug("run %s: delegations not read (%s): keeping the last ones", run, e)
            if self.tracker.update(found):
                now = self.tracker.authority
                logger.info(
                    "run %s: delegation %d: planners %s, trainers %s, revoked %s",
                    run, now.sequence, sorted(now.planners), sorted(now.trainers), sorted(now.revoked),
                )  # fmt: skip
        return self.tracker.authority

    def publish(self, every_s: float = 0.0) -> bool:
        """(Re)stores the manifest and the newest delegation known, at most every `every_s`; whether a node took
        the manifest."""
        if self._clock() - self._published_at < every_s:
            return False
        ttl = MAX_TTL_S["manifest"] / 2
        stored = self._store("manifest", MANIFEST_SUBKEY, self.manifest.to_json(), ttl)
        if self.newest is not None:
            self.publish_delegation(self.newest, ttl)
        self._published_at = self._clock()  # not before: a store that timed out is retried on the next beat
        return stored

    def publish_delegation(self, delegation: RunDelegation, ttl_s: float | None = None) -> bool:
        """Stores the owner's `delegation` and follows it at once. Raises ValueError for a foreign one."""
        self.tracker.update([delegation.check_for(self.manifest)])
        ttl = ttl_s or MAX_TTL_S["delegations"] / 2
        return self._store("delegations", delegation.sequence, delegation.to_json(), ttl)
