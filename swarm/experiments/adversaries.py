"""Stranger attackers of an open run, as an attacker on the internet would write them (`swarm experiment attacks`).

Every attacker here is a small client with no part in the run: keys of its own (ground for low ids, `KeyPool`), a
DHT node of its own that signs records for all of them (`AttackerNode`: one hivemind node, many keys), and plain
gRPC calls. None of them uses a peer's or the trainer's code path beyond the public record types and wire
messages, so what they get is what a stranger gets from the current code.

Each attack (`ATTACKS`) starts with `start(ctx)` and returns an `Attack` whose `stop()` ends it; what it did is
read back from the run (the plans and announcements the experiment observes, the trainer's steps), and judged in
`swarm.experiments.attacks_report`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("swarm.attacker")

__all__ = ["ATTACKS", "Attack", "AttackContext", "AttackerNode", "KeyPool", "multi_key_signer"]

ANNOUNCE_EVERY_S = 5.0
"""How often the attacker re-stores its records (announcements live 30 s)."""
ATTACH_RETRY_S = 20.0
"""How long a relay attacker keeps attaching while refused."""
VICTIM_START_S = 120.0
"""How long the relay attack waits for its NAT'd volunteer to start and announce itself behind a relay."""
HIJACK_LEASE_S = 20.0
"""The planner lease a key-grinding attacker claims (readers accept at most 60 s)."""


class KeyPool:
    """RSA keys made ahead, by peer id: an attacker grinds for ids below the honest ones (ids are key hashes).

    Making keys is the grind (one RSA key is 50-100 ms here): `below(bound, n)` returns the n lowest ids under
    `bound`, making more keys (at most `max_keys` in all) until it has them or gives up with what it has."""

    def __init__(self, max_keys: int = 400):
        self.max_keys = max_keys
        self.keys: dict[str, Any] = {}
        self._lock = threading.Lock()

    def make(self, n: int) -> None:
        from swarm.net.auth import Identity

        for _ in range(n):
            ident = Identity.generate()
            with self._lock:
                self.keys[ident.peer_id] = ident.key

    def below(self, bound: str | None, n: int, used: set[str] = frozenset()) -> list[tuple[str, Any]]:
        """Up to `n` (id, key) pairs with ids below `bound` (None: any), lowest first, none of `used`."""
        while True:
            with self._lock:
                found = sorted(
                    (pid, key) for pid, key in self.keys.items() if pid not in used and (bound is None or pid < bound)
                )
                total = len(self.keys)
            if len(found) >= n or total >= self.max_keys:
                return found[:n]
            self.make(min(16, self.max_keys - total))


def multi_key_signer(keys: list[Any]):
    """A hivemind record validator that signs a record with whichever of `keys` owns it (the key in the record's
    subkey), so one DHT node stores records for many identities: `RSASignatureValidator` with several keys."""
    from hivemind.dht.crypto import RSASignatureValidator

    class MultiKeySigner(RSASignatureValidator):
        def __init__(self) -> None:
            super().__init__(keys[0])
            self.by_owner = {owner_of(k): k for k in keys}

        def sign_value(self, record):
            for owner, key in self.by_owner.items():
                if owner in record.key or owner in (record.subkey or b""):
                    signature = key.sign(self._serialize_record(record))
                    return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)
            return record.value

    return MultiKeySigner()


def owner_of(key: Any) -> bytes:
    """A key's owner marker, as it prefixes a subkey (`[owner:KEY]`)."""
    return b"[owner:" + key.get_public_key().to_bytes() + b"]"


class AttackerNode:
    """A DHT client node storing the run's records for every key in `keys`, re-storing them every few seconds
    (`keep`) until `close()`."""

    def __init__(self, initial_peers: list[str], keys: list[Any], run_name: str = "swarm"):
        from hivemind.dht import DHT

        from swarm.peers.dht_config import DHTConfig
        from swarm.peers.entries import RunKeys, RunRecordValidator

        self.run_keys = RunKeys.of_run(run_name)
        config = DHTConfig(initial_peers=tuple(initial_peers), client_mode=True)
        self.dht = DHT(
            initial_peers=list(initial_peers), start=True, client_mode=True, host_maddrs=config.host_maddrs,
            record_validators=[multi_key_signer(keys), RunRecordValidator(self.run_keys)],
        )  # fmt: skip
        self._records: list[Callable[[], tuple[str, bytes, dict, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attacker-records", daemon=True)
        self._thread.start()

    def keep(self, record: Callable[[], tuple[str, bytes, dict, float]]) -> None:
        """Stores `record()` -> (key, subkey, value, ttl_s) now and every ANNOUNCE_EVERY_S until close."""
        self._store(record)
        self._records.append(record)

    def announce_peer(self, key: Any, ann) -> None:
        self.keep(
            lambda: (self.run_keys.peers, owner_of(key), ann().to_wire() if callable(ann) else ann.to_wire(), 30.0)
        )

    def announce_trainer(self, key: Any, ann) -> None:
        self.keep(lambda: (self.run_keys.trainers, owner_of(key), ann.to_wire(), 30.0))

    def publish_plan(self, key: Any, record) -> None:
        from swarm.peers.entries import PLAN_SEP

        subkey = owner_of(key) + PLAN_SEP + str(record.version).encode()
        self.keep(lambda: (self.run_keys.plan, subkey, record.to_wire(), 600.0))

    def _store(self, record) -> None:
        from hivemind.utils import get_dht_time

        key, subkey, value, ttl_s = record()
        try:
            self.dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey)
        except Exception as e:  # a slow DHT: the next round stores it again
            log.warning("attacker store failed: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(ANNOUNCE_EVERY_S):
            for record in list(self._records):
                self._store(record)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.dht.shutdown()


@dataclass
class AttackContext:
    """What an attacker knows of the run (all of it public): where to join the DHT, the announced peers and
    the plan, the honest ids (to grind below), and a key pool."""

    initial_peers: list[str]
    observer: Any
    """a SwarmDHT client of the experiment: the announcements and the plan, as anyone reads them"""
    pool: KeyPool
    n_layers: int
    trainer_id: str
    trainer_key_path: str | None = None
    """the honest trainer's key file: used only by the token capture (what an on-path relay sees)"""
    kill_planner: Callable[[], str | None] = lambda: None
    """SIGKILLs the peer that holds the planner lease (the experiment's processes); returns its id"""
    start_peer: Callable[[list[str]], str] | None = None
    """starts one more honest volunteer with these extra swarm-peer flags; returns its peer id"""
    options: dict = field(default_factory=dict)
    run_name: str = "swarm"
    """the run's DHT namespace (an owned run's id), where the attacker stores its records"""

    def honest_ids(self) -> list[str]:
        return [p.peer_id for p in self.observer.peers()]

    def plan(self):
        try:
            return self.observer.get_plan(self.n_layers, check_trainers=False)
        except TimeoutError:
            return None


@dataclass
class Attack:
    """A started attack: its attacker ids, what it set out to check, and how to stop it."""

    name: str
    attacker_ids: list[str]
    facts: dict = field(default_factory=dict)
    """what the attacker saw itself (e.g. the hijack's plan version, a replayed call's status)"""
    stop: Callable[[], None] = lambda: None


def _fake_address(i: int) -> str:
    return f"127.0.0.1:{1 + i}"  # announced, never served: port 1+ on loopback refuses at once


def _announcement(pid: str, i: int, **changes):
    from hivemind.utils import get_dht_time

    from swarm.peers.records import PeerAnnouncement

    return PeerAnnouncement(
        peer_id=pid, address=_fake_address(i), device="cpu", memory_bytes=1 << 30, compute_layers_per_s=100.0,
        started_at=get_dht_time(), **changes,
    )  # fmt: skip


# ---- the attacks -----------------------------------------------------------------------------------------------


def ground_key_planner(ctx: AttackContext) -> Attack:
    """A key ground below every honest id claims the planner lease and publishes a plan that names itself at
    stage 0 and as the only trainer. It worked if honest peers follow that plan (`facts["hijack_version"]`)."""
    from hivemind.utils import get_dht_time

    from swarm.peers.records import PlanRecord, TrainerAnnouncement

    honest = ctx.honest_ids()
    ((pid, key),) = ctx.pool.below(min(honest), 1) or ctx.pool.below(None, 1)
    record = ctx.plan()
    node = AttackerNode(ctx.initial_peers, [key], ctx.run_name)
    node.announce_peer(key, lambda: _announcement(pid, 0, planner_until=get_dht_time() + HIJACK_LEASE_S))
    node.announce_trainer(key, TrainerAnnouncement(pid, started_at=get_dht_time()))
    facts = {"ground_below_honest": pid < min(honest), "attacker_id": pid}
    if record is not None:
        doc = record.document
        first = doc.stages[0]
        stages = (dataclasses.replace(first, peer_ids=(pid, *first.peer_ids[1:])), *doc.stages[1:])
        version = record.version + 1
        changes = {"stages": stages, "trainer_ids": (pid,)}
        if doc.version is not None:
            changes["version"] = version
        hijack = PlanRecord(version, dataclasses.replace(doc, **changes), created_at=get_dht_time())
        node.publish_plan(key, hijack)  # after its lease is stored: readers check the publisher's authority
        facts["hijack_version"] = version
    return Attack("ground-key-planner", [pid], facts, node.close)


def sybils_then_planner_kill(ctx: AttackContext) -> Attack:
    """`options["sybils"]` throwaway announcements (no lease, one ground below every honest id), then the
    planner is killed. It worked if nobody re-plans (`facts["killed"]`: the planner's id, and when)."""
    honest = ctx.honest_ids()
    n = int(ctx.options.get("sybils", 20))
    low = ctx.pool.below(min(honest), 1)
    rest = ctx.pool.below(None, n - len(low), used={p for p, _ in low})
    sybils = low + rest
    node = AttackerNode(ctx.initial_peers, [k for _, k in sybils], ctx.run_name)
    ids = {pid for pid, _ in sybils}
    for i, (pid, key) in enumerate(sybils):
        node.announce_peer(key, _announcement(pid, i))
    _wait(lambda: sum(p.peer_id in ids for p in ctx.observer.peers()) == len(ids), 10.0)  # stored before the kill
    killed = ctx.kill_planner()
    facts = {"killed": killed, "killed_at": time.time(), "lowest_sybil_below_honest": bool(low)}
    return Attack("sybils-planner-kill", [p for p, _ in sybils], facts, node.close)


def stranger_trainers(ctx: AttackContext) -> Attack:
    """`options["trainers"]` trainer announcements from fresh keys with ids below the real trainer's. It
    worked if a stranger is named in a plan's trainer_ids."""
    from hivemind.utils import get_dht_time

    from swarm.peers.records import TrainerAnnouncement

    n = int(ctx.options.get("trainers", 16))
    found = ctx.pool.below(ctx.trainer_id, n)
    node = AttackerNode(ctx.initial_peers, [k for _, k in found], ctx.run_name)
    for pid, key in found:
        node.announce_trainer(key, TrainerAnnouncement(pid, started_at=get_dht_time()))
    return Attack("stranger-trainers", [p for p, _ in found], {"below_trainer": len(found)}, node.close)


def held_data_streams(ctx: AttackContext) -> Attack:
    """A stranger announces itself as a trainer, then opens `options["streams"]` Forward streams into every
    stage-0 peer and sends nothing on them, holding their data slots. It worked if the honest run stops.
    `facts["refused"]`: how many streams a stage refused at once (their codes)."""
    import grpc
    from hivemind.utils import get_dht_time

    from swarm.net.auth import CallSigner, Identity
    from swarm.net.stream import METHODS, bind_method
    from swarm.peers.records import TrainerAnnouncement

    ((pid, key),) = ctx.pool.below(None, 1, used=set())
    node = AttackerNode(ctx.initial_peers, [key], ctx.run_name)
    node.announce_trainer(key, TrainerAnnouncement(pid, started_at=get_dht_time()))
    named = _wait(lambda: (r := ctx.plan()) is not None and pid in (r.document.trainer_ids or ()), 15.0)
    signer = CallSigner(Identity(key))
    record = ctx.plan()
    addresses = {p.peer_id: p.address for p in ctx.observer.peers()}
    stage0 = [] if record is None else [p for p in record.document.stages[0].peer_ids if p in addresses]
    if named and record is not None:  # the stages serve the plan that names it (their rosters follow their plan)
        _wait(lambda: all(a.plan_version >= record.version for a in ctx.observer.peers() if a.peer_id in stage0), 15.0)
    hold = threading.Event()
    calls: list = []
    channels = {peer: grpc.insecure_channel(addresses[peer]) for peer in stage0}

    def nothing():
        hold.wait()
        return
        yield  # a generator that sends no item until the attack ends

    def open_streams(peer: str, n: int) -> list:
        forward = bind_method(channels[peer], METHODS["Forward"])
        return [(peer, forward.future(nothing(), metadata=signer.metadata(peer), timeout=3600)) for _ in range(n)]

    n = int(ctx.options.get("streams", 24))
    for peer in stage0:
        calls += open_streams(peer, n)
    refused: list[str] = []
    deadline = time.monotonic() + 10.0
    while True:  # a stream refused at once (a roster a moment behind) is opened again, for up to 10 s
        time.sleep(1.0)
        done = [(peer, c) for peer, c in calls if c.done()]
        refused = [c.exception().code().name for _, c in done if c.exception() is not None]
        if not done or time.monotonic() > deadline:
            break
        calls = [(peer, c) for peer, c in calls if not c.done()]
        for peer, _ in done:
            calls += open_streams(peer, 1)
    held = sum(1 for _, c in calls if not c.done())

    def stop() -> None:
        hold.set()
        for _, c in calls:
            c.cancel()
        for ch in channels.values():
            ch.close()
        node.close()

    facts = {"named_trainer": named, "streams": len(calls), "held": held, "refused": len(refused),
             "codes": sorted(set(refused))}  # fmt: skip
    return Attack("held-data-streams", [pid], facts, stop)


def relay_slot_fill(ctx: AttackContext) -> Attack:
    """Strangers announce themselves behind each reachable peer's relay and Attach to it until it is full;
    then one more honest volunteer behind NAT (swarm-peer --reach relay) joins. It worked if that volunteer,
    once it announces itself behind a relay, cannot be reached through it while the strangers hold the relays
    (`facts["probes"]`, `facts["reachable"]`: Status calls through its relay, as the trainer would dial it, and
    how many it answered; its announcement names a relay before the Attach is accepted, so it cannot tell)."""
    import grpc

    from swarm.net.auth import CallSigner, Identity
    from swarm.net.tunnel import RelayLimits
    from swarm.proto import stage_pb2, stage_pb2_grpc

    relays = [p for p in ctx.observer.peers() if p.reach == "direct"]
    per = int(ctx.options.get("attach_per_relay", RelayLimits().max_attached))
    found = ctx.pool.below(None, per * len(relays))
    node = AttackerNode(ctx.initial_peers, [k for _, k in found], ctx.run_name)
    hold = threading.Event()
    channels, pairs = [], []
    for i, (pid, key) in enumerate(found):
        relay = relays[i // per]
        pairs.append((pid, key, relay))
        # announced with memory 0: a planner has no layers to give it, it only holds the relay's slot
        node.announce_peer(
            key, dataclasses.replace(_announcement(pid, i, reach="relay", relay=relay.peer_id), memory_bytes=0)
        )
    ids = {pid for pid, _, _ in pairs}  # the relays read the announcements that vouch for the attaches
    _wait(lambda: sum(p.peer_id in ids for p in ctx.observer.peers()) == len(ids), 10.0)

    def up():
        hold.wait()
        return
        yield

    calls: list = []
    lock = threading.Lock()
    deadline = time.monotonic() + ATTACH_RETRY_S

    def attach(key, relay) -> None:
        """Attaches as `key` to `relay`, again while refused (its view of the announcements may lag) until the
        deadline; an accepted Attach first answers AttachDown(conn_id=0) and is held."""
        channel = grpc.insecure_channel(relay.address)
        with lock:
            channels.append(channel)
        stub = stage_pb2_grpc.RelayStub(channel)
        while time.monotonic() < deadline and not hold.is_set():
            call = stub.Attach(up(), metadata=CallSigner(Identity(key)).metadata(relay.peer_id), timeout=3600)
            try:
                if isinstance(next(call), stage_pb2.AttachDown):
                    with lock:
                        calls.append(call)
                    return
            except (grpc.RpcError, StopIteration):
                pass
            hold.wait(1.0)  # refused: once a second until the deadline

    threads = [threading.Thread(target=attach, args=(key, relay), daemon=True) for _, key, relay in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.1, deadline + 10.0 - time.monotonic()))
    accepted = len(calls)
    victim = ctx.start_peer(["--reach", "relay"]) if ctx.start_peer is not None else None
    facts = {"relays": len(relays), "attaches": len(pairs), "accepted": accepted, "victim": victim, "probes": 0,
             "reachable": 0}  # fmt: skip
    if victim is not None:  # judged now, while the strangers hold the relays, whatever the trainer does meanwhile
        behind = lambda: any(p.peer_id == victim and p.reach == "relay" for p in ctx.observer.peers())  # noqa: E731
        if _wait(behind, VICTIM_START_S):
            _probe_victim(ctx, victim, facts)

    def stop() -> None:
        hold.set()
        for c in calls:
            c.cancel()
        for ch in channels:
            ch.close()
        node.close()

    return Attack("relay-slot-fill", [p for p, _, _ in pairs], facts, stop)


def _probe_victim(ctx: AttackContext, victim: str, facts: dict, probes: int = 8, every_s: float = 2.0) -> None:
    """Calls the victim's Status through its announced relay `probes` times, `every_s` apart, as the trainer would
    dial it; counts the calls (`facts["probes"]`) and the answers (`facts["reachable"]`)."""
    from swarm.daemon.nat import announced_dial
    from swarm.net.auth import CallSigner, Identity
    from swarm.net.connect import GrpcConnector
    from swarm.proto import stage_pb2

    # as the trainer calls it (a relay may serve only the run's callers)
    key = Identity.load(ctx.trainer_key_path) if ctx.trainer_key_path else Identity.generate()
    signer = CallSigner(key)
    connector = GrpcConnector(signer=signer, dial=announced_dial(ctx.observer.peers, signer))
    try:
        for i in range(probes):
            if i:
                time.sleep(every_s)  # spaced calls: an Attach that comes a moment late still counts
            try:
                ann = next((p for p in ctx.observer.peers() if p.peer_id == victim), None)
            except TimeoutError:  # a slow DHT read: this call is not made
                continue
            facts["probes"] += 1
            if ann is not None and _status(lambda ann=ann: connector.stage(ann.address, victim).Status(
                stage_pb2.Empty(), timeout=5)) == "OK":  # fmt: skip
                facts["reachable"] += 1
    finally:
        connector.close()


def token_replay(ctx: AttackContext) -> Attack:
    """A token captured from one of the trainer's calls (as a relay sees it: the call's metadata) is replayed on
    a new connection in the same call. It worked if the stage serves the replay (`facts["replay"]`: the status)."""
    import grpc

    from swarm.net.auth import Identity
    from swarm.net.connect import GrpcConnector
    from swarm.proto import stage_pb2

    record = ctx.plan()
    addresses = {p.peer_id: p.address for p in ctx.observer.peers()}
    target = record.document.stages[0].peer_ids[0] if record is not None else None
    facts: dict = {"target": target}
    if target is None or target not in addresses or ctx.trainer_key_path is None:
        facts["replay"] = "no target"
        return Attack("token-replay", [], facts)
    from swarm.net.auth import CallSigner

    seen: list = []

    class Recorder(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            seen.append(tuple(details.metadata or ()))
            return continuation(details, request)

    connector = GrpcConnector(signer=CallSigner(Identity.load(ctx.trainer_key_path)))
    get = connector.channels.get
    connector.channels.get = lambda address: grpc.intercept_channel(get(address), Recorder())
    request = stage_pb2.StepRequest(step=0)
    facts["capture"] = _status(lambda: connector.stage(addresses[target], target).Grads(request, timeout=10))
    connector.close()
    if not seen:
        facts["replay"] = "nothing captured"
        return Attack("token-replay", [], facts)
    with grpc.insecure_channel(addresses[target]) as channel:  # another connection, another client
        from swarm.net.stream import METHODS, bind_method

        grads = bind_method(channel, METHODS["Grads"])
        facts["replay"] = _status(lambda: grads(request, timeout=10, metadata=seen[-1]))
    return Attack("token-replay", [], facts)


def _status(call: Callable[[], Any]) -> str:
    import grpc

    try:
        call()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except TimeoutError:
            pass
        time.sleep(0.5)  # polling the DHT, bounded by the deadline
    return False


ATTACKS: dict[str, Callable[[AttackContext], Attack]] = {
    "ground-key-planner": ground_key_planner,
    "sybils-planner-kill": sybils_then_planner_kill,
    "stranger-trainers": stranger_trainers,
    "held-data-streams": held_data_streams,
    "relay-slot-fill": relay_slot_fill,
    "token-replay": token_replay,
}
"""The stranger attacks by setting name; each starts once the run has trained a few steps."""
