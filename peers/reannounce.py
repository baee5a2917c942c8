"""A peer's announcement kept alive: stored again every ttl/3 from a thread of its own, so a missed beat or two is
harmless, with an owned run's manifest and newest delegation re-published beside it."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.records import PeerAnnouncement

__all__ = ["RUN_REPUBLISH_S", "Reannouncer"]

logger = logging.getLogger("swarm.peers.dht")

RUN_REPUBLISH_S = 120.0
"""How often a member re-stores the owned run's manifest and newest delegation (they live MAX_TTL_S / 2)."""


class Reannouncer:
    """Re-announces a peer every ttl/3 seconds from a background thread, so a missed beat or two is harmless.

    The announcement is rebuilt on every beat by calling `make_announcement` (from the heartbeat thread), so
    changes in load or stage reach the DHT within one period.
    """

    def __init__(
        self,
        dht: SwarmDHT,
        make_announcement: Callable[[], PeerAnnouncement],
        period_s: float | None = None,
        lock: threading.Lock | None = None,
    ):
        self._dht = dht
        self._make = make_announcement
        self._lock = lock
        """held while a beat reads and stores the announcement (the owner's lock for changing it), so a beat
        never stores a record older than one the owner stored meanwhile"""
        self.period_s = period_s if period_s is not None else dht.config.announce_ttl_s / 3
        self.beats = 0
        """Announcements a DHT node accepted so far."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-reannounce", daemon=True)

    def start(self) -> Reannouncer:
        """Announces once right away (in the caller's thread), then keeps announcing in the background."""
        self._beat()
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stops announcing; the announcement then expires within the ttl."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("heartbeat thread still busy after %.1f s; leaving it (daemon thread)", timeout_s)

    def __enter__(self) -> Reannouncer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._beat()

    def _beat(self) -> None:
        try:
            with self._lock or contextlib.nullcontext():
                accepted = self._dht.announce(self._make())
            if accepted:
                self.beats += 1
            else:
                logger.warning("announcement refused by every DHT node reached; retrying in %.1f s", self.period_s)
            # an owned run's manifest and newest delegation, refreshed by every member: the run outlives its owner
            publish_run = getattr(self._dht, "publish_run", None)
            if publish_run is not None:
                publish_run(every_s=RUN_REPUBLISH_S)
        except Exception as e:  # a heartbeat must survive DHT hiccups: the next beat retries
            logger.warning("announcement failed (%s); retrying in %.1f s", e, self.period_s)
