"""The relay's bounds against strangers (issue 27), over real gRPC on loopback: Connects capped per caller, callers
the plan names keep reserved slots when strangers came first, Attaches only from peers the run vouches for, a
peer the plan names evicting a stranger from a full relay, and the attached peer's side bounded against a relay
that floods it with AttachDowns (threads and descriptors measured with psutil)."""

from __future__ import annotations

import threading
import time

import grpc
import psutil
import pytest

from swarm.net.auth import CallSigner, Identity
from swarm.net.relay import Attachment, RelayLimits, RelayRoute, RelayServicer, Standing, Tunnels, relay_metadata
from swarm.proto import stage_pb2, stage_pb2_grpc
from tests.unit.net.test_relay import IDS, EchoStage, probe, relay_servicer, serve, signer

pytestmark = pytest.mark.timeout(120)

RELAY = IDS["relay"].peer_id
PEER = IDS["peer"].peer_id


class HeldConnect:
    """A raw Connect to `target` through the relay, held open until `release()`: admitted (the target's server
    preface comes back) or refused (its status)."""

    def __init__(self, channel: grpc.Channel, who: CallSigner, target: str):
        self._release = threading.Event()

        first = stage_pb2.RelayFrame(target=target)

        def frames():
            yield first
            self._release.wait(60)

        metadata = relay_metadata(who, RELAY, "Connect", first)
        self.call = stage_pb2_grpc.RelayStub(channel).Connect(frames(), metadata=metadata, timeout=60)

    def outcome(self) -> tuple[str, str]:
        """("admitted", "") or (status code name, details)."""
        try:
            next(self.call)
            return "admitted", ""
        except grpc.RpcError as e:
            return e.code().name, e.details()

    def release(self) -> None:
        self._release.set()
        self.call.cancel()


def _attached_relay(limits: RelayLimits, planned: set[str]):
    relay = RelayServicer(
        RELAY, relay_servicer().verifier, {PEER}.__contains__, limits=limits, planned=planned.__contains__
    )
    return relay


def test_strangers_holding_connects_do_not_shut_out_the_trainer():
    """The attack: 4 keys holding 4 Connects each to a NAT'd peer took its 16 slots, and the trainer was refused.
    Now callers the plan does not name share `open_conns_per_peer` of them; the trainer (named) still connects."""
    limits = RelayLimits()
    strangers = [CallSigner(Identity.generate()) for _ in range(4)]
    trainer = IDS["caller"]
    relay = _attached_relay(limits, planned={trainer.peer_id})
    held: list[HeldConnect] = []
    with serve(relay, workers=limits.threads() + 8) as (_, relay_address), serve(EchoStage(PEER)) as (_, p_address):
        attachment = Attachment(lambda: (RELAY, relay_address), signer("peer"), p_address, limits).start()
        try:
            assert attachment.attached.wait(10)
            with grpc.insecure_channel(relay_address) as channel:
                outcomes = []
                for who in strangers:
                    for _ in range(4):
                        held.append(HeldConnect(channel, who, PEER))
                        outcomes.append(held[-1].outcome())
                admitted = [o for o in outcomes if o[0] == "admitted"]
                refused = [o for o in outcomes if o[0] != "admitted"]
                assert len(admitted) == limits.open_conns_per_peer == 8, outcomes
                assert {o[0] for o in refused} == {"RESOURCE_EXHAUSTED"}
                assert all("plan does not name" in o[1] and RELAY in o[1] for o in refused), refused
                # the trainer, named by the plan, reaches the peer through the same relay
                route = RelayRoute(PEER, RELAY, relay_address)
                tunnels = Tunnels(signer("caller"), lambda a: route)
                try:
                    assert probe(tunnels, b"step", who="caller") == b"step"
                finally:
                    tunnels.close()
        finally:
            for h in held:
                h.release()
            attachment.close()


def test_one_caller_is_capped_in_all_not_only_per_target():
    limits = RelayLimits(conns_per_caller=4, conns_per_caller_total=2)
    relay = _attached_relay(limits, planned=set())
    held: list[HeldConnect] = []
    with serve(relay, workers=limits.threads() + 8) as (_, relay_address), serve(EchoStage(PEER)) as (_, p_address):
        attachment = Attachment(lambda: (RELAY, relay_address), signer("peer"), p_address, limits).start()
        try:
            assert attachment.attached.wait(10)
            with grpc.insecure_channel(relay_address) as channel:
                outcomes = []
                for _ in range(3):  # one at a time: three at once race for the two slots, in any order
                    held.append(HeldConnect(channel, signer("stranger"), PEER))
                    outcomes.append(held[-1].outcome())
                assert [o[0] for o in outcomes] == ["admitted", "admitted", "RESOURCE_EXHAUSTED"], outcomes
                assert f"2 connections of caller {IDS['stranger'].peer_id}" in outcomes[2][1]
                held.append(HeldConnect(channel, signer("caller"), PEER))  # another caller is not affected
                assert held[-1].outcome()[0] == "admitted"
        finally:
            for h in held:
                h.release()
            attachment.close()


class Attacher:
    """A peer attaching to `relay_address` (its own server need not exist: no connection is asked of it)."""

    def __init__(self, relay_address: str, identity: Identity | None = None):
        self.identity = identity or Identity.generate()
        self.codes: list[grpc.StatusCode | None] = []
        self.failed = threading.Event()

        def on_fail(relay_id, code):
            self.codes.append(code)
            self.failed.set()

        self.attachment = Attachment(
            lambda: (RELAY, relay_address), CallSigner(self.identity), "127.0.0.1:9", on_fail=on_fail
        ).start()

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_strangers_fill_only_the_open_attach_slots_and_a_planned_peer_evicts_one():
    """The attack: 7 stranger Attaches filled a relay. Now only peers the run vouches for attach at all, those the
    plan does not name take at most `open_attached` slots, and a peer the plan names gets in whatever came
    first (a free slot, else the last stranger attached is evicted, told RESOURCE_EXHAUSTED)."""
    limits = RelayLimits(max_attached=4, reserved_attached=2)
    standing: dict[str, Standing] = {}
    relay = RelayServicer(RELAY, relay_servicer().verifier, lambda p: standing.get(p, Standing.STRANGER), limits)
    attachers: list[Attacher] = []
    with serve(relay, workers=limits.threads() + 8) as (_, address):
        try:
            unvouched = Attacher(address)  # announced nothing: refused outright
            attachers.append(unvouched)
            assert unvouched.failed.wait(10) and unvouched.codes[0] == grpc.StatusCode.PERMISSION_DENIED
            strangers = [Attacher.__new__(Attacher) for _ in range(3)]
            for i in range(3):
                ident = Identity.generate()
                standing[ident.peer_id] = Standing.ANNOUNCED
                strangers[i] = Attacher(address, ident)
                attachers.append(strangers[i])
            assert _wait(lambda: sum(s.failed.is_set() for s in strangers) == 1 and len(relay.attached()) == 2)
            late = next(s for s in strangers if s.failed.is_set())
            assert late.codes[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            held = [s for s in strangers if s is not late]
            planned = []
            for _ in range(3):  # two free slots, then a full relay: the third evicts a stranger
                ident = Identity.generate()
                standing[ident.peer_id] = Standing.PLANNED
                planned.append(Attacher(address, ident))
                attachers.append(planned[-1])
                assert planned[-1].attachment.attached.wait(10), "a peer the plan names always attaches"
            assert _wait(lambda: sum(s.failed.is_set() for s in held) == 1)
            evicted = next(s for s in held if s.failed.is_set())
            assert evicted.codes[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            attached = set(relay.attached())
            assert {p.peer_id for p in planned} <= attached and evicted.peer_id not in attached
            assert len(attached) == limits.max_attached
            # a fourth named peer finds only named peers and one stranger: it evicts that stranger too
            ident = Identity.generate()
            standing[ident.peer_id] = Standing.PLANNED
            fourth = Attacher(address, ident)
            attachers.append(fourth)
            assert fourth.attachment.attached.wait(10)
            assert _wait(lambda: set(relay.attached()) == {p.peer_id for p in [*planned, fourth]})
            # and a fifth is refused: named peers never evict each other
            ident = Identity.generate()
            standing[ident.peer_id] = Standing.PLANNED
            fifth = Attacher(address, ident)
            attachers.append(fifth)
            assert fifth.failed.wait(10) and fifth.codes[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for a in attachers:
                a.attachment.close()


class FloodingRelay(stage_pb2_grpc.RelayServicer):
    """A malicious relay: accepts the Attach, then asks for `n` connections at once, and holds every Accept
    the peer opens without a byte."""

    def __init__(self, n: int):
        self.n, self.accepts, self.done = n, 0, threading.Event()
        self._lock = threading.Lock()

    def Attach(self, request_iterator, context):
        yield stage_pb2.AttachDown(conn_id=0)
        for conn_id in range(1, self.n + 1):
            yield stage_pb2.AttachDown(conn_id=conn_id)
        self.done.wait(60)

    def Accept(self, request_iterator, context):
        with self._lock:
            self.accepts += 1
        self.done.wait(60)
        return iter(())


def _threads_fds() -> tuple[int, int]:
    me = psutil.Process()
    return me.num_threads(), me.num_fds()


class Peak:
    """The most threads and descriptors of this process seen while it runs (sampled every few milliseconds)."""

    def __init__(self):
        self.threads, self.fds = _threads_fds()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.002):
            threads, fds = _threads_fds()
            self.threads, self.fds = max(self.threads, threads), max(self.fds, fds)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join(5)


@pytest.mark.parametrize("asked", [6, 2000])
def test_a_relay_flooding_attach_downs_cannot_grow_the_peers_threads_or_fds(asked):
    """The attack: 2,000 AttachDowns pushed the attached peer to 4,106 threads and 2,022 open descriptors. Now
    it takes at most `accepts_per_attach` connections at once (two threads, three descriptors each: its Accept
    thread and the copy thread, its socket to its own server, that server's end, the relay's stream), drops
    the rest, and leaves a relay that asks `accepts_per_attach` more than that. 6 asked: held, not left; 2,000:
    left. Threads and descriptors are the peak sampled while it runs, against the figures before."""
    limits = RelayLimits(accepts_per_attach=4)
    flood = FloodingRelay(asked)
    relay_workers = 16
    with serve(flood, workers=relay_workers) as (_, relay_address), serve(EchoStage(PEER)) as (_, p_address):
        threads_before, fds_before = _threads_fds()
        failed: list = []
        with Peak() as peak:
            attachment = Attachment(  # a relay it left is not asked again (the daemon skips it for SKIP_S)
                lambda: None if failed else (RELAY, relay_address), signer("peer"), p_address, limits,
                on_fail=lambda r, c: failed.append(c),
            ).start()  # fmt: skip
            try:
                # a loaded machine is slow to start; a flood may be left before the peer's own accepts reach it
                assert _wait(lambda: flood.accepts >= limits.accepts_per_attach or bool(failed), 60)
                if asked > 2 * limits.accepts_per_attach:
                    assert _wait(lambda: bool(failed)), "the peer leaves a relay that floods it"
                    assert failed[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert attachment.dropped > limits.accepts_per_attach
                else:
                    assert _wait(lambda: attachment.dropped == asked - limits.accepts_per_attach)
                    assert not failed and attachment.attached.is_set()
                time.sleep(0.2)  # a few more samples of the held state (the figures are peaks; nothing waits on this)
            finally:
                flood.done.set()
                attachment.close()
        print(f"asked {asked}: threads {threads_before} -> peak {peak.threads}, fds {fds_before} -> peak {peak.fds}")
        # the peer's share: 2 threads and 3 descriptors per connection taken, plus the Attach's own thread and
        # channel; the in-process flooding relay's server adds at most its pool and a socket per connection
        assert peak.threads - threads_before <= 2 * limits.accepts_per_attach + relay_workers + 8
        assert peak.fds - fds_before <= 3 * limits.accepts_per_attach + 16
        assert flood.accepts <= limits.accepts_per_attach


def test_one_caller_holds_at_most_waiting_per_caller_connects_waiting_for_an_attach():
    """A target that announces this relay but has not attached yet: Connects wait for it (`attach_wait_s`), but
    one caller's beyond `waiting_per_caller` are answered NOT_FOUND at once, and another caller still waits."""
    limits = RelayLimits(attach_wait_s=30.0, waiting_per_caller=2, max_waiting=8)
    relay = relay_servicer(limits=limits)  # "peer" announces this relay, never attaches
    held: list[HeldConnect] = []
    with serve(relay, workers=limits.threads() + 8) as (_, address), grpc.insecure_channel(address) as channel:
        try:
            for _ in range(2):
                held.append(HeldConnect(channel, signer("stranger"), PEER))
            assert _wait(lambda: relay._waiting == 2)
            third = HeldConnect(channel, signer("stranger"), PEER)
            held.append(third)
            code, details = third.outcome()
            assert code == "NOT_FOUND" and PEER in details  # answered while the first two still wait
            assert relay._waiting == 2
            held.append(HeldConnect(channel, signer("caller"), PEER))
            assert _wait(lambda: relay._waiting == 3), "another caller's Connect still waits"
        finally:
            for h in held:
                h.release()
