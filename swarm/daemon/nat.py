"""The peer daemon's side of issue 16: reachability, relaying for others, and attaching to a relay.

`NatWiring` serves the `Relay` service beside the stage service, decides the peer's reach (`--reach auto`:
a dial-back by a reachable peer; `direct`/`relay`: as told), and under "relay" keeps an `Attachment` to a
chosen reachable peer and announces it (`PeerAnnouncement.reach/relay`). Its `tunnels.dial` is what the
daemon's channels and connectors dial in place of a relayed peer's address; `swarm train` uses
`announced_dial` for the same.

The relay of an unreachable peer is its pipeline neighbour under the plan it follows when that one is
reachable (the next stage first: it sends this stage the backward's gradients, the larger messages; the
neighbour's own calls then take no extra hop, the reverse connection), else the reachable, not-leaving peer
ranked first by a hash of the two ids (spreads peers over relays). A new plan that makes another reachable
peer the neighbour moves the Attach there (`WATCH_S`); a relay that refuses (--no-relay, full) or dies is
skipped for `SKIP_S`.

The relay's rules against strangers (docs/NAT.md, "Relay rules") need the run's word, which only the daemon has:
`may_attach` answers a peer's `Standing` (announced naming this relay, or named by the followed plan) and
`planned` whether the plan or a private run's lists name a caller; both go to the `RelayServicer` as callables.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING

import grpc

from swarm.metrics import RELAYED_BYTES
from swarm.net.reach import DialBackHelper, NonceBook, check_reachable
from swarm.net.relay import Attachment, RelayLimits, RelayRoute, RelayServicer, Standing, Tunnels

if TYPE_CHECKING:
    from swarm.peers.records import PeerAnnouncement
    from swarm.peers.transport import TransportConfig

__all__ = ["REACH_MODES", "Announced", "NatWiring", "announced_dial"]

log = logging.getLogger("swarm.nat")

REACH_MODES = ("auto", "direct", "relay")
RECHECK_S = 2.0
"""How often a peer that found nobody to check its reach at first asks again (`--reach auto`)."""
SKIP_S = 30.0
"""How long a relay that refused or failed an Attach is passed over."""
WATCH_S = 1.0
"""How often an attached peer checks that its relay is still the one it prefers (a plan moved its neighbours)."""
MOVE_ATTACH_S = 10.0
"""How long a move waits for the new relay to hold the Attach before it gives the move up."""
MOVE_GRACE_S = 6.0
"""How long the old Attach stays open after the new one holds: callers' announcements (`Announced`, at most 5 s
old) still route some connections through the old relay meanwhile."""
NEIGHBOUR = 1
"""`_rank` at or below this: a pipeline neighbour (an Attach there is never moved)."""


class Announced:
    """The DHT's announcements by peer id and by address, re-read at most once per `refresh_s` (on a miss, or
    when older than `max_age_s`), so a stranger's calls cannot turn into a DHT request each.

    A record missing from one read is kept until it has been missing for `keep_s`: a DHT read can come back
    without some records for a moment, and a tunnel that found no route for a NAT'd peer closed its connection
    without a word, which left the caller's channel in gRPC's reconnect backoff for every attempt of a step (the
    nat experiment's relay setting gave up its first step so). A peer that really left is dialed through its
    old relay for those seconds and fails as any dead peer does."""

    def __init__(
        self,
        peers: Callable[[], list[PeerAnnouncement]],
        refresh_s: float = 1.0,
        max_age_s: float = 5.0,
        keep_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.peers, self.refresh_s, self.max_age_s, self.keep_s, self.clock = peers, refresh_s, max_age_s, keep_s, clock
        self._by_id: dict[str, PeerAnnouncement] = {}
        self._by_address: dict[str, PeerAnnouncement] = {}
        self._seen: dict[str, float] = {}
        """peer id -> when a read last returned its record"""
        self._read_at = -1e9
        self._lock = threading.Lock()

    def reread(self) -> None:
        """Reads the DHT again now unless it was read within `refresh_s` (a record may have changed a moment ago)."""
        self._refresh(miss=True)

    def _refresh(self, miss: bool) -> None:
        now = self.clock()
        with self._lock:
            age = now - self._read_at
            if age < self.refresh_s or (not miss and age < self.max_age_s):
                return
            self._read_at = now
        try:
            found = self.peers()
        except TimeoutError:
            return
        with self._lock:
            for a in found:
                self._by_id[a.peer_id], self._seen[a.peer_id] = a, now
            for gone in [p for p, seen in self._seen.items() if now - seen > self.keep_s]:
                del self._by_id[gone], self._seen[gone]
            self._by_address = {a.address: a for a in self._by_id.values()}

    def get(self, peer_id: str) -> PeerAnnouncement | None:
        self._refresh(miss=peer_id not in self._by_id)
        return self._by_id.get(peer_id)

    def at(self, address: str) -> PeerAnnouncement | None:
        self._refresh(miss=address not in self._by_address)
        return self._by_address.get(address)

    def address(self, peer_id: str) -> str | None:
        found = self.get(peer_id)
        return None if found is None else found.address

    def route(self, address: str) -> RelayRoute | None:
        """How to reach the peer announced at `address`: None (dial it) unless it announces reach="relay"."""
        target = self.at(address)
        if target is None or target.reach != "relay" or target.relay is None:
            return None
        relay = self.get(target.relay)
        if relay is None or relay.reach != "direct":
            return None  # its relay is gone: the dial fails as to any unreachable peer, and repair takes over
        return RelayRoute(target.peer_id, relay.peer_id, relay.address)


def announced_dial(peers: Callable[[], list[PeerAnnouncement]], signer) -> Callable[[str], str]:
    """For a trainer: announced address -> the address to dial (a tunnel to a relayed peer, else itself)."""
    return Tunnels(signer, Announced(peers).route).dial


class NatWiring:
    """Reachability, relaying and attaching for one peer daemon (`daemon`: its `dht` and `announcement`)."""

    def __init__(self, daemon, reach: str, serve_relay: bool, signer, verifier, limits: RelayLimits | None = None):
        if reach not in REACH_MODES:
            raise ValueError(f"--reach: expected one of {REACH_MODES}, got {reach!r}")
        self.daemon, self.reach, self.signer = daemon, reach, signer
        self.limits = limits or RelayLimits()
        self.book = Announced(daemon.dht.peers)
        self.me = daemon.dht.peer_id
        self.nonces = NonceBook()
        self.relaying = serve_relay and reach != "relay"
        self.servicer = RelayServicer(
            self.me, verifier, self.may_attach, self.limits, daemon.shaping, self.book.address, daemon.metrics,
            serve_relay=self.relaying, dial_back=DialBackHelper(self.book.address, signer), nonces=self.nonces,
            planned=self.planned,
        )  # fmt: skip
        self.tunnels = Tunnels(signer, self.book.route, local=self.servicer)
        self.attachment: Attachment | None = None
        self.second: Attachment | None = None
        """the Attach to a second reachable pipeline neighbour (`second_neighbour`), not announced"""
        self._second_target: tuple[str, str] | None = None
        self._local_address = ""
        self._skip: dict[str, float] = {}
        self._closed = threading.Event()

    def server_transport(self, transport: TransportConfig) -> TransportConfig:
        """The stage server's transport with room for the relay's threads (streams hold a thread each)."""
        extra = self.limits.threads() if self.relaying else 4
        return dataclasses.replace(transport, max_workers=transport.max_workers + extra)

    def add_to(self, server: grpc.Server, host: str | None = None, data_port: int | None = None) -> None:
        """Serves the Relay service on `server`; a relay also opens its raw data port on `host` (`data_port`:
        0 any free port, None none)."""
        from swarm.proto import stage_pb2_grpc

        stage_pb2_grpc.add_RelayServicer_to_server(self.servicer, server)
        if self.relaying and host is not None and data_port is not None and self.servicer.verifier is not None:
            port = self.servicer.listen_raw(host, data_port)
            log.info("relay data port %s:%d (relayed bytes as plain TCP)", host, port)

    def may_attach(self, peer_id: str) -> Standing:
        """What the run vouches for `peer_id` as, for an Attach here (the relay's rule: `RelayLimits`). It must be
        announced in the run (its PeerAnnouncement, signed by its key) with reach="relay" and either name this peer
        its relay or be this peer's pipeline neighbour under the plan this peer follows (its second Attach: this
        peer's calls to it then take the reverse connection, while others reach it through the relay it names);
        else STRANGER (refused). PLANNED when the plan names it (it may evict a peer the plan does not name),
        else ANNOUNCED."""
        found = self.book.get(peer_id)
        if found is None or found.relay != self.me:  # maybe announced a moment ago: read again (rate-limited)
            self.book.reread()
            found = self.book.get(peer_id)
        if found is None or found.reach != "relay":
            return Standing.STRANGER
        if found.relay != self.me and self._rank()(peer_id) > NEIGHBOUR:
            return Standing.STRANGER
        return Standing.PLANNED if self.planned(peer_id) else Standing.ANNOUNCED

    def planned(self, peer_id: str) -> bool:
        """Whether the run names `peer_id`: the plan this peer follows (a stage peer, one on standby, a trainer),
        or a private run's `allowed_trainers` / `trusted_planners`. Such a caller's relay Connects may use the slots
        the relay keeps from strangers, and such a peer's Attach may evict a stranger's. No DHT read: the plan in
        memory only (a Connect asks it)."""
        record = getattr(self.daemon, "following", None)
        if record is not None:
            document = record.document
            if peer_id in (document.trainer_ids or ()) or peer_id in document.named_peers():
                return True
        config = getattr(self.daemon.dht, "config", None)
        return peer_id in getattr(config, "allowed_trainers", ()) or peer_id in getattr(config, "trusted_planners", ())

    # ---- this peer's reach ------------------------------------------------------------------------------

    def _candidates(self) -> list[PeerAnnouncement]:
        now = time.monotonic()
        peers = [
            p for p in self.daemon.dht.peers()
            if p.peer_id != self.me and p.reach == "direct" and not p.leaving and self._skip.get(p.peer_id, 0) < now
        ]  # fmt: skip
        rank = self._rank()  # neighbours first, then by a hash of the two ids (spreads peers over relays)
        return sorted(
            peers, key=lambda p: (rank(p.peer_id), hashlib.sha256(f"{self.me}/{p.peer_id}".encode()).digest())
        )

    def _rank(self) -> Callable[[str], int]:
        """peer id -> 0: a peer of the next stage under the followed plan, 1: of the previous stage, 2: other."""
        record = getattr(self.daemon, "following", None)
        stages = record.document.stages if record is not None else ()
        place = record.document.place_of(self.me) if record is not None else None
        ranks: dict[str, int] = {}
        for r, k in enumerate((place[0] + 1, place[0] - 1) if place is not None else ()):
            for p in stages[k].peer_ids if 0 <= k < len(stages) else ():
                ranks.setdefault(p, r)
        return lambda peer_id: ranks.get(peer_id, 2)

    def settle(self, listen_host: str, port: int, attempts: int = 5, stop: threading.Event | None = None) -> str:
        """Decides this peer's reach (after its first, direct announcement: a helper dials what it announced)
        and, when unreachable, announces a relay and keeps attaching to it. Returns the reach: "direct", "relay",
        or "unknown" (under auto, nobody could check yet: announced direct, asked again in the background)."""
        from swarm.daemon.addresses import stage_address

        stop = stop or threading.Event()
        host = "127.0.0.1" if ipaddress.ip_address(listen_host).is_unspecified else listen_host
        local_address = stage_address(host, port)  # the Accepts' way into this peer's own server
        reachable: bool | None = self.reach == "direct"
        if self.reach == "auto":
            reachable = self._check(attempts, stop)
            if reachable is None:  # announced direct meanwhile (the first peers have nobody to ask), asking again
                log.info("reachability: no peer could dial back yet; announcing reach=direct, asking again")
                args = (local_address, stop)
                threading.Thread(target=self._recheck, args=args, name="swarm-reach", daemon=True).start()
                return "unknown"
        if reachable:
            log.info("reach: direct (others dial %s)", self.daemon.announcement.address)
            return "direct"
        return self._go_relay(local_address)

    def _check(self, attempts: int, stop: threading.Event) -> bool | None:
        """The dial-back check (`check_reachable`) of up to 3 reachable candidates, asked again a second apart
        (`attempts` in all) while none answers; None: nobody could tell."""
        for _ in range(attempts):
            try:
                helpers = [(p.peer_id, p.address) for p in self._candidates()[:3]]
            except TimeoutError:
                helpers = []
            if helpers and (found := check_reachable(helpers, self.signer, self.nonces)) is not None:
                return found
            if stop.wait(1.0) or self._closed.is_set():
                return None
        return None

    def _recheck(self, local_address: str, stop: threading.Event) -> None:
        """For a peer that found no helper at first: asks again (`RECHECK_S` apart) until one answers. Found
        behind NAT, it moves to a relay (before: it announced reach=direct for good, and a NAT'd peer that
        started first was unreachable to all); found reachable, its DHT node starts serving records."""
        while not (stop.is_set() or self._closed.is_set()):
            found = self._check(1, stop)
            if found is True:
                log.info("reach: direct, confirmed by a dial-back")
                self.serve_dht_records()
                return
            if found is False:
                self._go_relay(local_address)
                return
            if self._closed.wait(RECHECK_S):
                return

    def _go_relay(self, local_address: str) -> str:
        log.info("reach: relay (nobody dials this peer: its calls come through a relay it attaches to)")
        self.tunnels.own_address = local_address  # before announcing: its calls to itself stay local
        self._relay()  # announced now, before anyone makes a channel to the direct address it announced first
        self.attachment = Attachment(self._relay, self.signer, local_address, self.limits, self._failed).start()
        self._local_address = local_address
        threading.Thread(target=self._watch, name="swarm-relay-watch", daemon=True).start()
        return "relay"

    def serve_dht_records(self) -> bool:
        """Under `--reach auto`, once found reachable: the DHT node, which joined in client mode (behind NAT a
        server node stalls others' stores), starts serving records. False when it could not (it stays a client:
        the swarm loses a record holder, nothing else)."""
        from swarm.net.dhtmode import serve_records

        try:
            changed = serve_records(self.daemon.dht)
        except (TimeoutError, RuntimeError) as e:
            log.warning("the DHT node stays in client mode: %s", e)
            return False
        if changed:
            log.info("reachable: the DHT node now serves records (it joined in client mode)")
        return changed

    def _watch(self) -> None:
        """Moves the Attach to a pipeline neighbour when a new plan gave this peer a reachable one and its relay
        is not a neighbour (an Attach on either neighbour stays: a move costs more than one hop saves)."""
        while not self._closed.wait(WATCH_S):
            try:
                self._tick()
            except CancelledError:  # the DHT node shut down under a read: the peer is ending
                log.debug("relay watch: the DHT node is shut down")
                return

    def _tick(self) -> None:
        """One look (one DHT read): move the Attach, else keep the second Attach beside it. After a move the
        second waits for the next tick: it is chosen beside the new relay, never beside the old one (which
        would make the relay moved to the second's target, and the two Attaches there replace each other)."""
        attachment = self.attachment
        if attachment is None or not attachment.attached.is_set():
            return
        try:
            candidates = self._candidates()
        except TimeoutError:
            return
        target = self.move_to(attachment.relay_id, candidates)
        if target is not None:
            log.info("moving the Attach to pipeline neighbour %s", target)
            self._move(attachment)
            return
        self._keep_second(attachment, candidates)

    def second_neighbour(self, relay_id: str | None, candidates=None) -> tuple[str, str] | None:
        """(id, address) of a reachable pipeline neighbour other than the relay this peer announces: it holds a
        second Attach, so its calls into this peer (a boundary's Forward or Backward) take the reverse connection
        instead of two legs through the announced relay. None when there is no such neighbour. `candidates`:
        `_candidates()` as read already (None: read now)."""
        rank = self._rank()
        for p in self._candidates() if candidates is None else candidates:
            if p.peer_id != relay_id and rank(p.peer_id) <= NEIGHBOUR:
                return p.peer_id, p.address
        return None

    def _keep_second(self, primary: Attachment, candidates: list[PeerAnnouncement]) -> None:
        """Keeps the second Attach on `second_neighbour` (made, moved or ended as plans change)."""
        wanted = self.second_neighbour(primary.relay_id, candidates)
        if self.second is not None and self._second_target != wanted:
            self._drop_second()
        if wanted is not None and self.second is None:
            log.info("a second Attach to pipeline neighbour %s (its calls take the reverse connection)", wanted[0])
            self._second_target = wanted
            self.second = Attachment(
                lambda: wanted if self.second_neighbour(self.attachment.relay_id) == wanted else None,
                self.signer,
                self._local_address,
                self.limits,
                self._failed,
            ).start()  # fmt: skip  (a neighbour that fails is skipped: it may announce direct and be NAT'd)

    def _drop_second(self) -> None:
        second, self.second, self._second_target = self.second, None, None
        if second is not None:
            second.close()

    def move_to(self, relay_id: str | None, candidates=None) -> str | None:
        """The pipeline neighbour to move an Attach held by `relay_id` to; None to stay (it is a neighbour, or
        no reachable neighbour exists). `candidates`: `_candidates()` as read already (None: read now)."""
        candidates, rank = self._candidates() if candidates is None else candidates, self._rank()
        if candidates and rank(relay_id or "") > NEIGHBOUR >= rank(candidates[0].peer_id):
            return candidates[0].peer_id
        return None

    def _move(self, old: Attachment) -> None:
        """Make before break: announces the new relay, attaches there, and only then (after `MOVE_GRACE_S`, while
        callers' announcements catch up; the new relay holds their Connects until the Attach arrives) ends the
        old Attach. A new relay that does not take the Attach within `MOVE_ATTACH_S` gives the move up."""
        self._drop_second()  # it may hold the neighbour moved to: two Attaches there would replace each other
        new = Attachment(self._relay, self.signer, old.local_address, self.limits, self._failed).start()
        if new.attached.wait(MOVE_ATTACH_S):
            self.attachment = new
            self._closed.wait(MOVE_GRACE_S)
            old.close()
            return
        log.warning("the move to a neighbour's relay did not attach within %.0f s: staying", MOVE_ATTACH_S)
        new.close()
        old.reattach()  # re-announces whichever relay `_relay` picks now (the failed one is skipped)

    def _relay(self) -> tuple[str, str] | None:
        """The relay to attach to now; announced (reach="relay", relay=it) before the Attach is made."""
        try:
            candidates = self._candidates()
        except TimeoutError:
            return None
        if not candidates:
            log.warning("no reachable peer to relay for this one yet")
            return None
        current = self.daemon.announcement
        rank = self._rank()
        # keep the current relay when it is a neighbour, or unless a better-ranked one (a neighbour) is there
        best = rank(candidates[0].peer_id)
        kept = [p for p in candidates if p.peer_id == current.relay and rank(p.peer_id) <= max(best, NEIGHBOUR)]
        chosen = kept[0] if kept else candidates[0]
        if current.reach != "relay" or current.relay != chosen.peer_id:
            self.daemon.update_announcement(reach="relay", relay=chosen.peer_id)
        return chosen.peer_id, chosen.address

    def _failed(self, relay_id: str, code: grpc.StatusCode | None) -> None:
        if code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED):  # refused for good or gone
            # (a denial may be a slow DHT read; a cancel is ours, moving to a better relay)
            self._skip[relay_id] = time.monotonic() + SKIP_S

    def close(self) -> None:
        relayed = sum(v for k, v in self.daemon.metrics.snapshot().items() if k.startswith(RELAYED_BYTES))
        if relayed:
            log.info("relayed %d bytes in all", relayed)
        self._closed.set()
        for attachment in (self.attachment, self.second):
            if attachment is not None:
                attachment.close()
        self.tunnels.close()
        self.servicer.close()
