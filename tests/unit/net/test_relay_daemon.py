"""The daemon's NAT wiring (swarm.daemon.nat) with real gRPC servers and a stand-in DHT: `--reach auto` finds
a dialable peer direct, and one whose announced address nobody answers announces a relay, attaches to it and
is reached through it; `--reach relay` skips the check; announcements decide tunnels."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest

from swarm.daemon.nat import Announced, NatWiring
from swarm.metrics import Metrics
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement
from swarm.peers.shaper import LinkShaping
from swarm.peers.transport import TransportConfig, make_server
from swarm.proto import stage_pb2, stage_pb2_grpc
from tests.unit.net.test_relay import EchoStage

pytestmark = pytest.mark.timeout(60)


class FakeDHT:
    """Announcements shared by every daemon of a test."""

    def __init__(self, board: dict, identity: Identity):
        self.board, self.peer_id = board, identity.peer_id

    def peers(self):
        return list(self.board.values())

    def announce(self, ann):
        self.board[ann.peer_id] = ann
        return True


class Daemon:
    """The part of PeerDaemon NatWiring uses, serving the stage and relay services on loopback."""

    following = None  # the plan it follows (the relay's choice prefers its pipeline neighbours)

    def __init__(self, board: dict, reach: str, announce_port: int | None = None):
        self.identity = Identity.generate()
        self.dht, self.shaping, self.metrics = FakeDHT(board, self.identity), LinkShaping(), Metrics()
        self.signer = CallSigner(self.identity)
        self.nat = NatWiring(self, reach, True, self.signer, CallVerifier(self.identity.peer_id))
        self.server, self.port = make_server(self.nat.server_transport(TransportConfig(max_workers=8)))
        stage_pb2_grpc.add_StageServicer_to_server(EchoStage(self.identity.peer_id), self.server)
        self.nat.add_to(self.server)
        self.server.start()
        # announce_port: where others believe this peer listens (a closed port: "behind NAT")
        self.announcement = PeerAnnouncement(
            peer_id=self.identity.peer_id, address=f"127.0.0.1:{announce_port or self.port}", device="cpu",
            memory_bytes=1, compute_layers_per_s=1.0,
        )  # fmt: skip
        self.dht.announce(self.announcement)

    def update_announcement(self, **changes):
        self.announcement = dataclasses.replace(self.announcement, **changes)
        self.dht.announce(self.announcement)
        return self.announcement

    def close(self):
        self.nat.close()
        self.server.stop(grace=None)


@pytest.fixture
def daemons():
    made = []

    def make(*args, **kw):
        made.append(Daemon(*args, **kw))
        return made[-1]

    yield make
    for d in made:
        d.close()


def following(*stage_peers: str):
    """What a daemon follows: a plan record whose stage s is served by `stage_peers[s]` alone (one layer each)."""
    from types import SimpleNamespace

    stages = [{"layer_start": s, "layer_end": s + 1, "peer_ids": [p]} for s, p in enumerate(stage_peers)]
    return SimpleNamespace(document=PlanDocument.from_wire({"stages": stages}))


def closed_port() -> int:
    server, port = make_server(TransportConfig(max_workers=1))
    server.stop(grace=None)
    return port


def test_auto_finds_a_dialable_peer_direct(daemons):
    board = {}
    daemons(board, "direct")
    peer = daemons(board, "auto")
    assert peer.nat.settle("127.0.0.1", peer.port) == "direct"
    assert board[peer.identity.peer_id].reach == "direct" and peer.nat.attachment is None


def test_a_nat_peer_that_found_no_helper_at_first_moves_to_a_relay_once_one_appears(daemons, monkeypatch):
    import swarm.daemon.nat as nat

    monkeypatch.setattr(nat, "RECHECK_S", 0.2)
    board = {}
    natted = daemons(board, "auto", announce_port=closed_port())
    # the first peer up has nobody to ask: it announces direct for now (before: for good, unreachable to all)
    assert natted.nat.settle("127.0.0.1", natted.port, attempts=1) == "unknown"
    assert board[natted.identity.peer_id].reach == "direct"
    helper = daemons(board, "direct")
    deadline = time.monotonic() + 20
    # the relay is announced first, then attached to (a caller must find the relay before the dead address):
    # wait for both, the attachment object comes a moment after the announcement
    while (board[natted.identity.peer_id].reach != "relay" or natted.nat.attachment is None) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert board[natted.identity.peer_id].relay == helper.identity.peer_id
    assert natted.nat.attachment is not None and natted.nat.attachment.attached.wait(10)


@pytest.mark.parametrize("reach", ["auto", "relay"])
def test_an_unreachable_peer_announces_a_relay_attaches_and_is_reached_through_it(daemons, reach):
    board = {}
    relay = daemons(board, "direct")
    natted = daemons(board, reach, announce_port=closed_port())
    assert natted.nat.settle("0.0.0.0", natted.port) == "relay"
    announced = board[natted.identity.peer_id]
    assert announced.reach == "relay" and announced.relay == relay.identity.peer_id
    assert natted.nat.attachment.attached.wait(10)
    # a third peer reaches it by its announced (dead) address: its channel dials the tunnel through the relay
    caller = daemons(board, "direct")
    with grpc.insecure_channel(caller.nat.tunnels.dial(announced.address)) as channel:
        reply = stage_pb2_grpc.StageStub(channel).Probe(
            stage_pb2.ProbeRequest(payload=b"hello"), timeout=10, metadata=caller.signer.metadata(announced.peer_id)
        )
    assert reply.payload == b"hello"
    link = f'swarm_relayed_bytes_total{{link="{caller.identity.peer_id}->{natted.identity.peer_id}"}}'
    assert relay.metrics.snapshot()[link] > 0
    # the relay's own calls take the reverse connection: no Connect, the same tunnel in its process
    with grpc.insecure_channel(relay.nat.tunnels.dial(announced.address)) as channel:
        reply = stage_pb2_grpc.StageStub(channel).Probe(
            stage_pb2.ProbeRequest(payload=b"hi"), timeout=10, metadata=relay.signer.metadata(announced.peer_id)
        )
    assert reply.payload == b"hi"


def test_a_peer_that_does_not_relay_is_passed_over(daemons):
    board = {}
    first, second = daemons(board, "direct"), daemons(board, "direct")
    natted = daemons(board, "relay", announce_port=closed_port())
    ranked = [p.peer_id for p in natted.nat._candidates()]
    refusing, willing = sorted((first, second), key=lambda d: ranked.index(d.identity.peer_id))
    refusing.nat.servicer.serve_relay = False  # --no-relay, on the peer it would try first
    assert natted.nat.settle("127.0.0.1", natted.port) == "relay"
    deadline = time.monotonic() + 20
    while natted.nat.attachment.relay_id != willing.identity.peer_id and time.monotonic() < deadline:
        natted.nat.attachment.attached.wait(0.1)
    assert natted.nat.attachment.attached.is_set() and natted.nat.attachment.relay_id == willing.identity.peer_id
    assert board[natted.identity.peer_id].relay == willing.identity.peer_id
    assert refusing.nat.servicer.attached() == []


def test_routes_follow_announcements_only():
    me, relay = Identity.generate().peer_id, Identity.generate().peer_id
    base = PeerAnnouncement(peer_id=me, address="10.0.0.1:5", device="cpu", memory_bytes=1, compute_layers_per_s=1.0)
    board = {relay: dataclasses.replace(base, peer_id=relay, address="10.0.0.2:5")}
    now = [0.0]
    book = Announced(lambda: list(board.values()), refresh_s=0.0, clock=lambda: now[0])
    board[me] = base
    assert book.route("10.0.0.1:5") is None  # direct
    board[me] = dataclasses.replace(base, reach="relay", relay=relay)
    book._read_at = -1e9
    route = book.route("10.0.0.1:5")
    assert (route.peer_id, route.relay_id, route.relay_address) == (me, relay, "10.0.0.2:5")
    del board[relay]  # its relay's record is missing from a read: kept a while (a DHT read can miss records)
    book._read_at = -1e9
    assert book.route("10.0.0.1:5") == route
    now[0] += book.keep_s + 1  # missing for longer: its relay left, no tunnel through a relay nobody announces
    book._read_at = -1e9
    assert book.route("10.0.0.1:5") is None
    assert book.route("10.9.9.9:1") is None  # an address nobody announces: dialed as it is


def test_a_read_that_misses_a_record_keeps_its_route_until_keep_s():
    """A DHT read without the NAT'd peer's or its relay's record must not drop the route at once: the tunnel
    closed the caller's connection without a word, and gRPC's reconnect backoff failed every attempt of a step."""
    me, relay = Identity.generate().peer_id, Identity.generate().peer_id
    base = PeerAnnouncement(peer_id=me, address="10.0.0.1:5", device="cpu", memory_bytes=1, compute_layers_per_s=1.0)
    full = [
        dataclasses.replace(base, reach="relay", relay=relay),
        dataclasses.replace(base, peer_id=relay, address="10.0.0.2:5"),
    ]
    read = [full]
    now = [0.0]
    book = Announced(lambda: read[0], refresh_s=0.0, max_age_s=0.0, clock=lambda: now[0])
    expected = book.route("10.0.0.1:5")
    assert expected is not None and expected.relay_id == relay
    for partial in ([], full[1:], full[:1]):  # reads without either record, without the peer's, without the relay's
        read[0] = partial
        now[0] += 1.0
        assert book.route("10.0.0.1:5") == expected
    assert book.address(me) == "10.0.0.1:5"


def test_may_attach_only_peers_that_announce_this_relay():
    board = {}
    relay = Daemon(board, "direct")
    try:
        other = Identity.generate().peer_id
        stranger = dataclasses.replace(relay.announcement, peer_id=Identity.generate().peer_id, address="1.2.3.4:5")
        board[stranger.peer_id] = dataclasses.replace(stranger, reach="relay", relay=other)
        assert not relay.nat.may_attach(stranger.peer_id)
        board[stranger.peer_id] = dataclasses.replace(stranger, reach="relay", relay=relay.identity.peer_id)
        relay.nat.book._read_at = -1e9
        assert relay.nat.may_attach(stranger.peer_id)
        assert not relay.nat.may_attach("nobody")
    finally:
        relay.close()


def test_the_plan_vouches_for_attaches_and_callers_the_relay_must_not_shut_out():
    """Issue 27: an announced peer naming this relay attaches as ANNOUNCED, one the followed plan names as PLANNED
    (it may evict a stranger); callers the plan names (its stage peers, its trainers) use the reserved slots."""
    from types import SimpleNamespace

    from swarm.net.relay import Standing

    board = {}
    relay = Daemon(board, "direct")
    try:
        me = relay.identity.peer_id
        volunteer, trainer, other = (Identity.generate().peer_id for _ in range(3))
        announced = dict(peer_id=volunteer, address="1.2.3.4:5", reach="relay", relay=me)
        board[volunteer] = dataclasses.replace(relay.announcement, **announced)
        assert relay.nat.may_attach(volunteer) == Standing.ANNOUNCED
        assert relay.nat.may_attach(other) == Standing.STRANGER  # not announced: refused
        assert not relay.nat.planned(volunteer) and not relay.nat.planned(trainer)
        plan = {"stages": [{"layer_start": 0, "layer_end": 1, "peer_ids": [volunteer]}], "trainer_ids": [trainer]}
        relay.following = SimpleNamespace(document=PlanDocument.from_wire(plan))
        assert relay.nat.may_attach(volunteer) == Standing.PLANNED
        assert relay.nat.planned(volunteer) and relay.nat.planned(trainer) and not relay.nat.planned(other)
        assert relay.nat.servicer.planned is not None and relay.nat.servicer.planned(trainer)
        # named by the plan but announcing another relay, and no neighbour of this one: not attached here
        board[volunteer] = dataclasses.replace(relay.announcement, **(announced | {"relay": other}))
        relay.nat.book._read_at = -1e9
        assert relay.nat.may_attach(volunteer) == Standing.STRANGER
    finally:
        relay.close()


def test_a_plan_moves_the_attach_to_the_reachable_pipeline_neighbour(daemons):

    board = {}
    first, second = daemons(board, "direct"), daemons(board, "direct")
    natted = daemons(board, "relay", announce_port=closed_port())
    natted.following = None
    assert natted.nat.settle("127.0.0.1", natted.port) == "relay"
    assert natted.nat.attachment.attached.wait(10)
    before = natted.nat.attachment.relay_id
    neighbour = second if before == first.identity.peer_id else first
    # the new plan: stage 0 is the other peer, stage 1 this one (its previous stage: the only neighbour)
    natted.following = following(neighbour.identity.peer_id, natted.identity.peer_id)
    deadline = time.monotonic() + 20
    while natted.nat.attachment.relay_id != neighbour.identity.peer_id and time.monotonic() < deadline:
        natted.nat.attachment.attached.wait(0.1)
    assert natted.nat.attachment.relay_id == neighbour.identity.peer_id
    assert board[natted.identity.peer_id].relay == neighbour.identity.peer_id
    assert natted.nat.attachment.attached.wait(10)
    # the neighbour reaches it in process (reverse connection), the old relay no longer holds it
    address = board[natted.identity.peer_id].address
    deadline = time.monotonic() + 10
    while neighbour.nat.servicer.attached() != [natted.identity.peer_id] and time.monotonic() < deadline:
        natted.nat.attachment.attached.wait(0.1)
    md = neighbour.signer.metadata(natted.identity.peer_id)
    with grpc.insecure_channel(neighbour.nat.tunnels.dial(address)) as channel:
        reply = stage_pb2_grpc.StageStub(channel).Probe(stage_pb2.ProbeRequest(payload=b"n"), timeout=10, metadata=md)
    assert reply.payload == b"n"
    assert natted.nat._skip == {}  # moving is not a failure: the old relay is not passed over


@pytest.mark.parametrize(
    "argv,reach,relay,client_mode",
    # auto joins the DHT as a client too, until the dial-back finds it reachable (swarm.net.dhtmode)
    [([], "auto", True, True), (["--reach", "relay"], "relay", True, True), (["--no-relay"], "auto", False, True)],
)
def test_swarm_peer_reach_flags(argv, reach, relay, client_mode):
    from swarm.daemon.peer_config import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.reach, cfg.relay, cfg.dht.client_mode) == (reach, relay, client_mode)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reach", "nat"])


@pytest.mark.parametrize(
    "argv,port", [([], 0), (["--relay-data-port", "7000"], 7000), (["--relay-data-port", "-1"], None)]
)
def test_swarm_peer_relay_data_port_flag(argv, port):
    from swarm.daemon.peer_config import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(argv)).relay_data_port == port


def test_an_attach_on_either_pipeline_neighbour_stays(daemons):

    board = {}
    first, second = daemons(board, "direct"), daemons(board, "direct")
    natted = daemons(board, "relay", announce_port=closed_port())
    ids = first.identity.peer_id, natted.identity.peer_id, second.identity.peer_id
    natted.following = following(*ids)
    # held by the previous stage: the next stage ranks first for a fresh choice, but a move would cut the
    # callers' tunnels for a hop the previous neighbour already saves
    assert natted.nat.move_to(ids[0]) is None and natted.nat.move_to(ids[2]) is None
    assert natted.nat.move_to("someone-else") == ids[2]  # not a neighbour: move to the next stage
    natted.following = following(ids[1])
    assert natted.nat.move_to(ids[0]) is None  # no reachable neighbour: stay wherever it is


def test_a_second_attach_to_the_other_neighbour_makes_its_calls_reverse_connections(daemons):

    board = {}
    first, second = daemons(board, "direct"), daemons(board, "direct")
    natted = daemons(board, "relay", announce_port=closed_port())
    ids = first.identity.peer_id, natted.identity.peer_id, second.identity.peer_id
    plan = following(*ids)
    for d in (first, second, natted):
        d.following = plan  # natted serves the middle stage between the two reachable peers
    stranger = daemons(board, "direct")
    assert natted.nat.settle("127.0.0.1", natted.port) == "relay"
    assert natted.nat.attachment.attached.wait(10)
    relay_id = board[ids[1]].relay
    other = first if relay_id == ids[2] else second  # the neighbour natted does not announce
    deadline = time.monotonic() + 20
    while not other.nat.servicer.holds(ids[1]) and time.monotonic() < deadline:
        natted.nat.attachment.attached.wait(0.1)
    assert other.nat.servicer.holds(ids[1]), "the unannounced neighbour holds a second Attach"
    assert board[ids[1]].relay == relay_id, "the announcement still names one relay"
    md = other.signer.metadata(ids[1])
    with grpc.insecure_channel(other.nat.tunnels.dial(board[ids[1]].address)) as channel:
        reply = stage_pb2_grpc.StageStub(channel).Probe(stage_pb2.ProbeRequest(payload=b"r"), timeout=10, metadata=md)
    assert reply.payload == b"r"
    relay = first if relay_id == ids[0] else second
    link = f'swarm_relayed_bytes_total{{link="{other.identity.peer_id}->{ids[1]}"}}'
    assert relay.metrics.snapshot().get(link, 0) == 0, "not two legs through the announced relay"
    assert other.metrics.snapshot()[link] > 0  # piped in the neighbour's own process
    # a peer that is not its neighbour may not take a second Attach of it
    stranger.following = plan
    assert not stranger.nat.may_attach(ids[1]) and other.nat.may_attach(ids[1])
    # a plan that no longer makes `other` a neighbour ends the second Attach there
    two = following(ids[1], relay_id)
    for d in (first, second, natted):
        d.following = two
    deadline = time.monotonic() + 20
    while other.nat.servicer.holds(ids[1]) and time.monotonic() < deadline:
        natted.nat.attachment.attached.wait(0.1)
    assert not other.nat.servicer.holds(ids[1]) and natted.nat.second is None
    assert natted.nat.attachment.relay_id == relay_id  # the announced Attach is untouched


class CountingDHT(FakeDHT):
    reads = 0

    def peers(self):
        self.reads += 1
        return super().peers()


class FakeAttachment:
    made: list = []

    def __init__(self, relay, *args, **kw):
        self.relay, self.attached, self.local_address = relay, threading.Event(), "127.0.0.1:1"
        self.relay_id = None
        FakeAttachment.made.append(self)

    def start(self):
        target = self.relay()
        self.relay_id = None if target is None else target[0]
        self.attached.set()
        return self

    def close(self):
        self.attached.clear()


def test_a_watch_tick_reads_once_and_keeps_the_second_beside_the_new_relay(monkeypatch):
    from types import SimpleNamespace

    import swarm.daemon.nat as nat

    monkeypatch.setattr(nat, "Attachment", FakeAttachment)
    monkeypatch.setattr(nat, "MOVE_GRACE_S", 0.0)
    FakeAttachment.made = []
    board = {}
    ids = [Identity.generate() for _ in range(4)]  # prev neighbour, this NAT'd peer, next neighbour, a far relay
    for i, ident in enumerate(ids):
        reach = "relay" if i == 1 else "direct"
        board[ident.peer_id] = PeerAnnouncement(
            peer_id=ident.peer_id, address=f"127.0.0.1:{5000 + i}", device="cpu", memory_bytes=1,
            compute_layers_per_s=1.0, reach=reach, relay=ids[3].peer_id if i == 1 else None,
        )  # fmt: skip
    daemon = SimpleNamespace(
        dht=CountingDHT(board, ids[1]), shaping=LinkShaping(), metrics=Metrics(), announcement=board[ids[1].peer_id],
        following=following(*(i.peer_id for i in ids[:3])),
    )  # fmt: skip
    daemon.update_announcement = lambda **c: board.__setitem__(
        ids[1].peer_id, dataclasses.replace(board[ids[1].peer_id], **c)
    )
    daemon.announcement = board[ids[1].peer_id]
    wiring = NatWiring(daemon, "relay", True, CallSigner(ids[1]), None)
    far = FakeAttachment(lambda: (ids[3].peer_id, "127.0.0.1:5003")).start()
    wiring.attachment = far
    daemon.dht.reads = 0
    wiring._tick()  # the far relay is no neighbour: move to the next stage's peer
    assert wiring.attachment is not far and wiring.attachment.relay_id == ids[2].peer_id
    assert wiring.second is None, "no second Attach chosen beside the old relay (it would be the new relay)"
    wiring._tick()
    assert wiring.second is not None and wiring.second.relay_id == ids[0].peer_id  # the other neighbour
    reads = daemon.dht.reads
    wiring._tick()  # nothing to change: one look
    assert daemon.dht.reads - reads == 1, "one DHT read per tick (it was two)"
    assert {a.relay_id for a in (wiring.attachment, wiring.second)} == {ids[0].peer_id, ids[2].peer_id}
    wiring.close()


def test_the_relay_watch_ends_quietly_when_the_dht_node_shuts_down_under_a_read(monkeypatch):
    """Seen at a NAT'd peer's exit: the watch thread died with a CancelledError traceback (hivemind cancels the
    reads pending when its node shuts down)."""
    from concurrent.futures import CancelledError
    from types import SimpleNamespace

    import swarm.daemon.nat as nat

    monkeypatch.setattr(nat, "WATCH_S", 0.0)
    ticks: list = []

    def tick():
        ticks.append(1)
        raise CancelledError()

    wiring = SimpleNamespace(_closed=threading.Event(), _tick=tick)
    nat.NatWiring._watch(wiring)  # returns instead of raising
    assert ticks == [1]
