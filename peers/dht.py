"""The swarm's view of the hivemind DHT: signed, expiring peer announcements, link measurements and plans.

Every record lives under a key namespaced by the run name, in a subkey that carries its owner's RSA public
key (hivemind's `RSASignatureValidator`), so only the owner can write or refresh it:

    {run}.peers     subkey [owner:KEY]            -> PeerAnnouncement of the peer with that key
    {run}.trainers  subkey [owner:KEY]            -> TrainerAnnouncement of the trainer with that key
    {run}.links     subkey [owner:KEY]->DST       -> LinkMeasurement from that peer to DST
    {run}.plan      subkey [owner:KEY]#VERSION    -> PlanRecord published by that peer

A peer's id is derived from its public key (`peer_id_of`), so a record naming a peer id that its signing key
does not hash to is rejected: nobody can speak for another peer. Honest DHT nodes refuse to store records
that fail these checks, and readers check again, since a dishonest node may return anything.

An owned run (`DHTConfig.run`: its id, or its manifest file) also keeps its owner's signed documents, which
any peer may store and refresh since they verify by themselves (`swarm.peers.manifest`):

    {run}.manifest     subkey "manifest"          -> the run's RunManifest (JSON text), whose id is {run}
    {run}.delegations  subkey SEQUENCE            -> the owner's RunDelegation number SEQUENCE

Anyone may store a plan under their own subkey, so readers take a plan only from its authority and only once
it validates against the model and the announced peers (`validate_plan`). The authority: in an owned run, the
planners the owner delegated (the manifest, as the newest delegation changed it: `authority`); in a private
run the `trusted_planners`; in an unowned run the elected planner (`elected_planner` over the current
announcements and their planner leases, at the reader's DHT time), which a ground low id can take over. A
reader accepts a new planner's plans as soon as it sees that planner's lease (or the old planner's lapse).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hivemind.dht import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import use_hivemind_log_handler

from swarm.peers.dht_config import DHTConfig, load_or_create_key
from swarm.peers.dht_node import DHTThread
from swarm.peers.entries import (
    LINK_SEP,
    PLAN_SEP,
    RunKeys,
    RunRecordValidator,
    parse_entry,
    parse_run_entry,
    peer_id_of,
)
from swarm.peers.expiry import bound_expiration_heaps
from swarm.peers.lifeline import P2PD_GOGC, die_with_parent, p2pd_dies_with_this_process
from swarm.peers.manifest import RunAuthority, RunDelegation, RunManifest
from swarm.peers.owned import OwnedRun
from swarm.peers.plan import PlanDocument
from swarm.peers.records import (
    LinkMeasurement,
    PeerAnnouncement,
    PlanRecord,
    TrainerAnnouncement,
    elected_planner,
    followed_plan,
    validate_plan,
)
from swarm.peers.verdicts import CachedSignatureValidator

__all__ = [
    "SwarmDHT",
    "peer_id_of",
    "quiet_hivemind",
    "wait_for",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_MAX_DISTINCT_WARNINGS = 256
MAX_RUN_TRIES = 64
"""Most manifest or delegation entries verified per read of the DHT (each costs one RSA verification)."""
_FUTURE_TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError)  # distinct types before Python 3.11


class _DHTProcess(DHT):
    """hivemind's DHT process, made to die on SIGTERM whatever handlers the parent had when it forked.

    A command that installs a SIGTERM handler before starting the DHT (to shut down cleanly) would otherwise
    pass it on to the forked child, and `terminate()` (hivemind's last resort on shutdown) would hang.

    Its p2p daemon (Go) runs with GOGC=25 unless the environment says otherwise (`lifeline.P2PD_GOGC`).

    Both die with the process that started the DHT, even by SIGKILL (`swarm.peers.lifeline`).
    """

    def start(self) -> None:
        self._lifeline = (os.getpid(), threading.current_thread() is threading.main_thread())
        super().start()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if (lifeline := getattr(self, "_lifeline", None)) is not None:  # forked by start(), not run in place
            die_with_parent(*lifeline)
        p2pd_dies_with_this_process()
        os.environ.setdefault("GOGC", P2PD_GOGC)  # this process starts p2pd, which inherits its environment
        super().run()


class SwarmDHT:
    """One process's DHT node (hivemind's DHTNode in a thread of this process, or in a child process with
    `DHTConfig.separate_process`) and the run's records in it.

    Thread-safe: the heartbeat thread and the caller may use it at once. Usable as a context manager.
    """

    published_plan = 0
    """The newest plan version this node stored (0: none): what the planner's heartbeats say
    (`PingRequest.newest_plan`); set by `publish_plan`."""

    _run: OwnedRun | None = None
    """An owned run's manifest and authority, as read so far; None: unowned (or private) run."""

    def __init__(self, config: DHTConfig, *, private_key: RSAPrivateKey | None = None):
        """Starts the DHT node and joins the swarm through `config.initial_peers`.

        Args:
            config: how to join and how long records live.
            private_key: the key that signs this peer's records (defaults to `config.signing_key_path`'s).

        Raises:
            TimeoutError: the node did not start within `config.start_timeout_s`.
            RuntimeError: the node could not start or reach any of the initial peers.
        """
        self.config = config
        key = private_key if private_key is not None else load_or_create_key(config.signing_key_path)
        self._signer = CachedSignatureValidator(key)  # checks each record's signature once (peers/verdicts.py)
        self._owner = self._signer.local_public_key
        self.peer_id = peer_id_of(key.get_public_key().to_bytes())
        self._keys = RunKeys.of_run(config.run_name)
        self._lock = threading.Lock()  # hivemind.DHT's request pipe is not safe for concurrent senders (a thread's is)
        self._warned: set[str] = set()
        self._closed = False
        self.planner_until = 0.0
        """This peer's planner lease (DHT time), stamped on every announcement it makes (`Planner` renews it)."""
        started = time.monotonic()
        node = dict(
            record_validators=[self._signer, RunRecordValidator(self._keys)],
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs,
            client_mode=config.client_mode,
            identity_path=config.identity_path,
            startup_timeout=config.start_timeout_s,
        )
        initial = list(config.initial_peers) or None
        bound_expiration_heaps()  # before the node (or its fork) stores anything: swarm.peers.expiry
        if config.separate_process:
            self._dht: DHTThread | _DHTProcess = _DHTProcess(initial, start=True, await_ready=False, **node)
        else:
            self._dht = DHTThread(initial, **node)
        try:
            self._dht.wait_until_ready(timeout=config.start_timeout_s)
        except _FUTURE_TIMEOUTS:
            self._dht.shutdown()
            raise TimeoutError(f"the DHT node did not start within {config.start_timeout_s} s") from None
        except Exception as e:
            self._dht.shutdown()
            joining = f" and join {list(config.initial_peers)}" if config.initial_peers else ""
            raise RuntimeError(f"could not start a DHT node{joining}: {e}") from e
        logger.info(
            "DHT node up in %.2f s, peer id %s, run %r", time.monotonic() - started, self.peer_id, config.run_name
        )
        if config.run is not None:
            try:
                self._join_run(config.run_manifest())
            except Exception:
                self._dht.shutdown()
                raise

    # -- the owned run (swarm.peers.owned) ----------------------------------------------------------------

    def _join_run(self, manifest: RunManifest | None) -> None:
        """Verifies the run's manifest (the file's, or the DHT's by id, waiting up to start_timeout_s)."""
        if manifest is None:
            try:
                manifest = wait_for(self._fetch_quietly, self.config.start_timeout_s, 0.5, "manifest")
            except TimeoutError:
                raise RuntimeError(
                    f"run {self.config.run_name}: no valid manifest in the DHT within {self.config.start_timeout_s} s "
                    "(join through a peer of that run, or give the manifest file to --run)"
                ) from None
        store = lambda kind, subkey, text, ttl: self._store(getattr(self._keys, kind), subkey, text, ttl)
        self._run = OwnedRun(manifest, self._parse_run, store, self._warn)
        logger.info("owned run %s (%r), owner %s", manifest.run_id, manifest.name, manifest.owner_id)
        self._run.authority()
        try:
            self._run.publish()
        except TimeoutError as e:  # the heartbeat publishes again (Reannouncer); joining need not wait for it
            logger.warning("run %s: could not publish the manifest yet: %s", manifest.run_id, e)

    def _fetch_quietly(self) -> RunManifest | None:
        try:
            return self.fetch_manifest()
        except TimeoutError:
            return None

    @property
    def manifest(self) -> RunManifest | None:
        """The owned run's verified manifest; None in an unowned or private run."""
        return None if self._run is None else self._run.manifest

    @property
    def delegation(self) -> RunDelegation | None:
        """The owned run's newest valid delegation seen so far (None: none, or not an owned run)."""
        return None if self._run is None else self._run.newest

    def fetch_manifest(self) -> RunManifest | None:
        """The run's manifest from the DHT, verified against the run id (invalid ones are warned about, once)."""
        return next(iter(self._parse_run("manifest")), None)

    def authority(self, max_age_s: float = 2.0) -> RunAuthority | None:
        """Who may plan and train in this owned run: the manifest's delegates as the newest valid delegation
        changed them, re-read from the DHT at most every `max_age_s`; None in an unowned or private run."""
        return None if self._run is None else self._run.authority(max_age_s)

    def planners(self) -> tuple[str, ...]:
        """Whose plans count and who may plan, when the run restricts it: the owner's delegated planners, else
        the trusted planners (a private run); empty in an unowned run (the elected planner)."""
        authority = self.authority()
        return tuple(sorted(authority.planners)) if authority is not None else self.config.trusted_planners

    @property
    def restricted(self) -> bool:
        """Whether plan authority is named (owned or private run), rather than elected by lowest id."""
        return self._run is not None or bool(self.config.trusted_planners)

    def publish_run(self, every_s: float = 0.0) -> bool:
        """(Re)stores the owned run's manifest and the newest delegation known, at most every `every_s`: every
        peer of the run does (with its announcements), so the run's documents live as long as any peer does."""
        return self._run is not None and self._run.publish(every_s)

    def publish_delegation(self, delegation: RunDelegation) -> bool:
        """Stores the owner's `delegation` (checked against the run: a foreign one raises ValueError)."""
        if self._run is None:
            raise ValueError(f"RunDelegation: run {self.config.run_name} is not an owned run (give --run)")
        return self._run.publish_delegation(delegation)

    def _parse_run(self, kind: str) -> list[Any]:
        """The run's verified manifest, or its newest valid delegation, from the DHT (as a list: empty if none).

        Only the newest delegation is needed (each carries every earlier revocation: `swarm run revoke` writes
        it so), so entries are tried highest sequence first and the first valid one ends the search; at most
        MAX_RUN_TRIES entries are verified per read, whatever a dishonest DHT node returns.
        """
        key = getattr(self._keys, kind)
        found = self._request(f"get {key}", lambda: self._dht.get(key, latest=True, return_future=True))
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        entries = [(k, e) for k, e in found.value.items() if e.expiration_time >= now and type(k) in (int, str)]
        entries.sort(key=lambda item: (type(item[0]) is int, item[0] if type(item[0]) is int else 0), reverse=True)
        for subkey, entry in entries[:MAX_RUN_TRIES]:
            try:
                return [parse_run_entry(kind, self.config.run_name, subkey, entry.value, entry.expiration_time)]
            except ValueError as e:
                self._warn(f"skipping an invalid record under {key}: {e}")
        return []

    # -- records ---------------------------------------------------------------------------------------------

    def announce(self, ann: PeerAnnouncement | TrainerAnnouncement, ttl_s: float | None = None) -> bool:
        """Stores (or refreshes) this peer's (or trainer's) announcement for `ttl_s` (default announce_ttl_s).

        DHT nodes keep the record that expires last, so an announcement that would expire before the one
        already stored is refused: keep the ttl constant (as Reannouncer does) rather than shortening it.

        Returns:
            Whether a DHT node accepted it.
        """
        if ann.peer_id != self.peer_id:
            raise ValueError(f"{type(ann).__name__}.peer_id: {ann.peer_id} is not this node's id {self.peer_id}")
        key = self._keys.trainers if isinstance(ann, TrainerAnnouncement) else self._keys.peers
        if isinstance(ann, PeerAnnouncement) and ann.planner_until != self.planner_until:
            ann = dataclasses.replace(ann, planner_until=self.planner_until)  # whichever thread announces
        return self._store(key, self._owner, ann.to_wire(), ttl_s or self.config.announce_ttl_s)

    def peers(self) -> list[PeerAnnouncement]:
        """The unexpired, valid announcements of the run, by stage then peer id (unassigned peers last)."""
        found = self._parse_all(self._keys.peers, "peers")
        return sorted(found, key=lambda a: (a.stage is None, a.stage or 0, a.peer_id))

    def trainers(self) -> list[TrainerAnnouncement]:
        """The unexpired, valid trainer announcements, by peer id: in an owned run only the owner's delegated
        trainers', in a private run only the `allowed_trainers`', else all."""
        authority = self.authority()
        allowed = authority.trainers if authority is not None else frozenset(self.config.allowed_trainers)
        restricted = authority is not None or bool(allowed)
        found = self._parse_all(self._keys.trainers, "trainers")
        return sorted((t for t in found if not restricted or t.peer_id in allowed), key=lambda t: t.peer_id)

    def store_link(self, m: LinkMeasurement, ttl_s: float | None = None) -> bool:
        """Stores this peer's measurement of its link to `m.dst`, replacing its previous one."""
        if m.src != self.peer_id:
            raise ValueError(f"LinkMeasurement.src: {m.src} is not this node's id {self.peer_id}")
        subkey = self._owner + LINK_SEP + m.dst.encode()
        return self._store(self._keys.links, subkey, m.to_wire(), ttl_s or self.config.link_ttl_s)

    def links(self) -> list[LinkMeasurement]:
        """The unexpired, valid link measurements of the run, by (src, dst)."""
        return sorted(self._parse_all(self._keys.links, "links"), key=lambda m: (m.src, m.dst))

    def publish_plan(self, version: int, document: PlanDocument | dict[str, Any], ttl_s: float | None = None) -> bool:
        """Publishes a plan (a document, or its wire dict: checked here); peers follow the highest version they see.
        Raises ValueError for an invalid plan."""
        record = PlanRecord(version=version, document=document, created_at=get_dht_time())
        subkey = self._owner + PLAN_SEP + str(version).encode()
        stored = self._store(self._keys.plan, subkey, record.to_wire(), ttl_s or self.config.plan_ttl_s)
        if stored:
            self.published_plan = max(self.published_plan, version)
        return stored

    def plan_authority(self, peers: list[PeerAnnouncement]) -> frozenset[str]:
        """Whose plans count: the owner's delegated planners in an owned run, the trusted planners in a private
        one, else (unowned) the elected planner among `peers`."""
        if self.restricted:
            return frozenset(self.planners())
        elected = elected_planner(peers, now=get_dht_time())
        return frozenset() if elected is None else frozenset({elected})

    def get_plan(
        self,
        n_layers: int | None = None,
        *,
        peers: list[PeerAnnouncement] | None = None,
        check_trainers: bool = True,
        newer_than: int = 0,
    ) -> PlanRecord | None:
        """The newest plan from the plan authority that validates (`validate_plan`), if any.

        Plans from anyone else are skipped, and so is an invalid plan (with one warning, not one per poll): the
        next older plan of the authority is tried, so readers keep following the last good one.

        Args:
            n_layers: the model's layer count the stages must cover; None checks contiguity only.
            peers: the run's announcements, if the caller has just read them (else they are read here).
            check_trainers: whether the plan's trainer_ids must be announced trainers.
            newer_than: only plans of a higher version count (a follower's own plan's): with none, None, and the
                trainers' announcements are not read (a peer's poll, twice a second, seldom finds a new plan).
        """
        peers = self.peers() if peers is None else peers
        candidates = [(o, r) for o, r in self._authority_plans(peers) if r.version > newer_than]
        if not candidates:
            return None
        trainers = [t.peer_id for t in self.trainers()] if check_trainers else None
        for owner, record in candidates:
            try:
                validate_plan(record, n_layers, peers, trainers)
            except ValueError as e:
                self._warn(f"skipping plan {record.version} from {owner}: {e}")
                continue
            return record
        return None

    def newest_plan_version(self, peers: list[PeerAnnouncement]) -> int:
        """The highest version the plan authority published, valid or not (0: none): a planner's floor."""
        return max((record.version for _, record in self._authority_plans(peers)), default=0)

    def followed_plan(self, n_layers: int | None, peers: list[PeerAnnouncement]) -> PlanRecord | None:
        """The plan the most announced peers follow, whoever published it (`followed_plan`): what a new planner
        inherits. With trusted planners only theirs count (as in `get_plan`)."""
        plans = self._parse_all(self._keys.plan, "plan")
        planners = self.planners()
        if self.restricted and not planners:
            return None  # the owner delegated no planner (yet): nobody's plans count
        return followed_plan(plans, peers, n_layers, planners)

    def _authority_plans(self, peers: list[PeerAnnouncement]) -> list[tuple[str, PlanRecord]]:
        authority = self.plan_authority(peers)
        plans = []
        for owner, record in self._parse_all(self._keys.plan, "plan"):
            if owner in authority:
                plans.append((owner, record))
            elif self._run is not None:
                # a stranger's plan in an owned run: refused by name, once (not once per poll)
                self._warn(
                    f"refusing plan {record.version} from {owner}: not a planner the owner of run "
                    f"{self.config.run_name} delegated ({sorted(authority)})"
                )
            else:
                # once each at info level: an earlier planner's plans are normal after a hand-over
                self._warn(
                    f"ignoring plan {record.version} from {owner}: not the plan authority {sorted(authority)}",
                    logging.INFO,
                )
        return sorted(plans, key=lambda p: (p[1].version, p[1].created_at), reverse=True)

    def wait_for_stages(
        self,
        num_stages: int,
        timeout_s: float,
        *,
        min_plan_version: int = 0,
        on_progress: Callable[[dict[int, list[PeerAnnouncement]]], None] | None = None,
        poll_s: float = 0.5,
    ) -> dict[int, list[PeerAnnouncement]]:
        """Waits until every stage in [0, num_stages) is served by at least one announced peer.

        Args:
            num_stages: stages that must all be served.
            timeout_s: give up after this long.
            min_plan_version: count only peers that follow at least this plan version.
            on_progress: called with the stages served so far whenever that set changes.
            poll_s: seconds between polls of the DHT.

        Returns:
            For each stage, the peers serving it, least loaded first.

        Raises:
            TimeoutError: naming the stages still missing.
        """
        served: dict[int, list[PeerAnnouncement]] = {}
        reported: set[int] | None = None

        def all_served() -> bool:
            nonlocal served, reported
            try:
                announcements = self.peers()
            except TimeoutError as e:
                logger.warning("%s; polling again", e)
                return False
            served = {}
            for ann in announcements:
                if ann.stage is not None and ann.stage < num_stages and ann.plan_version >= min_plan_version:
                    served.setdefault(ann.stage, []).append(ann)
            for peers in served.values():
                peers.sort(key=lambda a: a.load)
            if on_progress is not None and set(served) != reported:
                reported = set(served)
                on_progress(served)
            return len(served) == num_stages

        try:
            wait_for(all_served, timeout_s, poll_s, f"{num_stages} stages served")
        except TimeoutError:
            missing = sorted(set(range(num_stages)) - set(served))
            raise TimeoutError(
                f"after {timeout_s} s, stages {missing} of {num_stages} have no peer"
                + (f" following plan version >= {min_plan_version}" if min_plan_version else "")
            ) from None
        return served

    # -- node ------------------------------------------------------------------------------------------------

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs other processes can join this node through."""
        submit = lambda: self._dht.run_coroutine(_visible_maddrs, return_future=True)
        return [str(m) for m in self._request("visible_maddrs", submit)]

    def is_alive(self) -> bool:
        """Whether the DHT node (its thread, or its process) is running."""
        return self._dht.is_alive()

    def shutdown(self) -> None:
        """Stops the DHT node; safe to call twice. Records stay in the DHT until they expire."""
        if not self._closed:
            self._closed = True
            self._dht.shutdown()

    def __enter__(self) -> SwarmDHT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def store_signed(self, kind: str, value: dict[str, Any], ttl_s: float) -> bool:
        """Stores `value` under `{run}.{kind}` in this node's own subkey: signed with its key, so no other key can
        write or refresh it (the stop order, `swarm.peers.stop`)."""
        return self._store(f"{self.config.run_name}.{kind}", self._owner, value, ttl_s)

    def read_signed(self, kind: str) -> list[tuple[Any, Any, float]]:
        """(subkey, value, expiration) of each unexpired entry under `{run}.{kind}`, for its kind's parser."""
        key = f"{self.config.run_name}.{kind}"
        found = self._request(f"get {key}", lambda: self._dht.get(key, latest=True, return_future=True))
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        return [(k, e.value, e.expiration_time) for k, e in found.value.items() if e.expiration_time >= now]

    # -- internals -------------------------------------------------------------------------------------------

    def _store(self, key: str, subkey: bytes, value: dict[str, Any], ttl_s: float) -> bool:
        expiration = get_dht_time() + ttl_s
        submit = lambda: self._dht.store(key, value, expiration, subkey=subkey, return_future=True)
        return bool(self._request(f"store {key}", submit))

    def _parse_all(self, key: str, kind: str) -> list[Any]:
        found = self._request(f"get {key}", lambda: self._dht.get(key, latest=True, return_future=True))
        if found is None:
            return []
        if not isinstance(found.value, dict):
            self._warn(f"{key} holds a {type(found.value).__name__}, not a dictionary of records; ignoring it")
            return []
        now, records = get_dht_time(), []
        for subkey, entry in found.value.items():
            if entry.expiration_time < now:
                continue
            try:
                records.append(parse_entry(kind, subkey, entry.value, entry.expiration_time, now))
            except ValueError as e:
                self._warn(f"skipping an invalid record under {key}: {e}")
        return records

    def _request(self, what: str, submit: Callable[[], Any]) -> Any:
        if self._closed:
            raise RuntimeError("the DHT node is shut down")
        with self._lock:
            future = submit()
        try:
            return future.result(timeout=self.config.request_timeout_s)
        except _FUTURE_TIMEOUTS:
            future.cancel()
            raise TimeoutError(f"DHT {what} did not finish within {self.config.request_timeout_s} s") from None

    def _warn(self, message: str, level: int = logging.WARNING) -> None:
        # Polling loops would repeat the same warning every poll: say each thing once, then only at debug level.
        if message in self._warned:
            logger.debug(message)
            return
        if len(self._warned) < _MAX_DISTINCT_WARNINGS:
            self._warned.add(message)
        logger.log(level, message)


async def _visible_maddrs(_dht: DHT, node: Any) -> list[Any]:
    return await node.get_visible_maddrs()  # runs on the DHT node's loop (its thread's, or its process's)


def wait_for(predicate: Callable[[], T], timeout_s: float, poll_s: float = 0.25, what: str = "condition") -> T:
    """Polls `predicate` until it returns something truthy, and returns that.

    Raises:
        TimeoutError: `predicate` stayed falsy for `timeout_s` seconds (the message names `what`).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{what} not met within {timeout_s} s")
        time.sleep(min(poll_s, remaining))


def quiet_hivemind(level: int = logging.WARNING) -> None:
    """Routes hivemind's logs through the root logger (our plain format) and keeps only `level` and above."""
    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(level)
