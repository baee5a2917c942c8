"""The relay (swarm.net.relay) and the dial-back (swarm.net.reach) over real gRPC on loopback: a caller reaches
an attached peer only through its relay, and strangers, unattached targets, oversized frames, duplicate
attaches, dead relays and dial-backs to unannounced addresses are refused or fail fast, by name."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import grpc
import pytest

from swarm.metrics import Metrics
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.net.reach import DialBackHelper, NonceBook, check_reachable
from swarm.net.relay import Attachment, RelayLimits, RelayRoute, RelayServicer, Tunnels, relay_metadata
from swarm.peers.transport import TransportConfig, make_server
from swarm.proto import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.timeout(60)

IDS = {name: Identity.generate() for name in ("relay", "peer", "caller", "stranger")}


class EchoStage(stage_pb2_grpc.StageServicer):
    """A stand-in for P's stage service: Probe echoes its payload; records who called (the token's peer id)."""

    def __init__(self, peer_id: str):
        self.verifier, self.callers = CallVerifier(peer_id), []

    def Probe(self, request, context):
        self.callers.append(self.verifier.caller(context.invocation_metadata()))
        return stage_pb2.ProbeReply(payload=bytes(request.payload))


@contextmanager
def serve(*servicers, workers: int = 16):
    server, port = make_server(TransportConfig(max_workers=workers))
    for servicer in servicers:
        if isinstance(servicer, stage_pb2_grpc.RelayServicer):
            stage_pb2_grpc.add_RelayServicer_to_server(servicer, server)
        else:
            stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
    server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def relay_servicer(allowed=("peer",), **kw) -> RelayServicer:
    ids = {IDS[n].peer_id for n in allowed}
    return RelayServicer(IDS["relay"].peer_id, CallVerifier(IDS["relay"].peer_id), ids.__contains__, **kw)


def signer(name: str) -> CallSigner:
    return CallSigner(IDS[name])


def relay_md(who: str, method: str, fields=None) -> tuple:
    """`who`'s metadata for one call of the relay's `method` over `fields` (its request or first frame): token and
    proof, good once."""
    return relay_metadata(signer(who), IDS["relay"].peer_id, method, fields)


@contextmanager
def relayed(limits: RelayLimits | None = None, metrics: Metrics | None = None):
    """P's stage service, a relay R with P attached, and a caller's tunnels to P through R."""
    relay = relay_servicer(limits=limits, metrics=metrics)
    with serve(relay) as (relay_server, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        stage = None
        attachment = Attachment(lambda: (IDS["relay"].peer_id, relay_address), signer("peer"), p_address).start()
        assert attachment.attached.wait(10)
        route = RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, relay_address)
        tunnels = Tunnels(signer("caller"), lambda a: route if a == "p.example:1" else None)
        try:
            yield relay, relay_server, relay_address, tunnels, attachment, stage
        finally:
            tunnels.close()
            attachment.close()


def probe(tunnels: Tunnels, payload: bytes, timeout: float = 10.0, who: str = "caller") -> bytes:
    with grpc.insecure_channel(tunnels.dial("p.example:1")) as channel:
        reply = stage_pb2_grpc.StageStub(channel).Probe(
            stage_pb2.ProbeRequest(payload=payload), timeout=timeout, metadata=signer(who).metadata(IDS["peer"].peer_id)
        )
    return reply.payload


def test_a_caller_reaches_an_attached_peer_through_the_relay_with_its_own_signature():
    metrics = Metrics()
    with relayed(metrics=metrics) as (relay, _, _, tunnels, _, _):
        payload = bytes(range(256)) * 4096  # 1 MiB: many frames each way
        assert probe(tunnels, payload) == payload
        assert relay.attached() == [IDS["peer"].peer_id]
        snap = metrics.snapshot()
        c, p = IDS["caller"].peer_id, IDS["peer"].peer_id
        assert snap[f'swarm_relayed_bytes_total{{link="{c}->{p}"}}'] > len(payload)
        assert snap[f'swarm_relayed_bytes_total{{link="{p}->{c}"}}'] > len(payload)


def test_relayed_bytes_are_paced_by_the_relays_shaper_per_destination():
    from swarm.peers.shaper import LinkShape, LinkShaping

    shaping = LinkShaping(LinkShape(rate_bytes_per_s=2e6, burst_bytes=64 << 10))
    relay = relay_servicer(shaping=shaping, address_of={IDS["peer"].peer_id: "p.example:1"}.get)
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = Attachment(lambda: (IDS["relay"].peer_id, relay_address), signer("peer"), p_address).start()
        route = RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, relay_address)
        tunnels = Tunnels(signer("caller"), lambda a: route)
        try:
            assert attachment.attached.wait(10)
            probe(tunnels, b"warm")
            payload = b"z" * (1 << 20)
            started = time.monotonic()
            assert probe(tunnels, payload) == payload
            elapsed = time.monotonic() - started
        finally:
            tunnels.close()
            attachment.close()
    # 1 MiB each way at 2 MB/s per destination (both directions pace at once, each on its own shaper)
    assert elapsed >= 0.45, elapsed
    assert set(shaping._shapers) == {"p.example:1", IDS["caller"].peer_id}  # P by its address, C unannounced


def test_the_relay_cannot_forge_calls_the_peer_checks_the_callers_token():
    with relayed() as (_, _, _, tunnels, _, _):
        # a call signed for the relay, not for P, is refused by P itself: the relay only carries bytes
        with grpc.insecure_channel(tunnels.dial("p.example:1")) as channel, pytest.raises(grpc.RpcError) as err:
            stage_pb2_grpc.StageStub(channel).Probe(
                stage_pb2.ProbeRequest(payload=b"x"), timeout=10, metadata=signer("relay").metadata("someone-else")
            )
        assert err.value.code() == grpc.StatusCode.UNKNOWN and "wrong audience" in err.value.details()


def test_a_stranger_cannot_attach_and_anonymous_calls_are_refused():
    relay = relay_servicer()
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Attach(iter(()), metadata=relay_md("stranger", "Attach"), timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "does not announce relay" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Attach(iter(()), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert relay.attached() == []


def test_connecting_to_a_peer_that_is_not_attached_is_refused_by_name():
    relay = relay_servicer(limits=RelayLimits(attach_wait_s=0.2))  # it announces this relay: a short wait first
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        first = stage_pb2.RelayFrame(target=IDS["peer"].peer_id)
        replies = stage_pb2_grpc.RelayStub(channel).Connect(
            iter([first]), metadata=relay_md("caller", "Connect", first), timeout=10
        )
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "is not attached" in err.value.details()


def test_an_accept_for_a_connection_the_relay_did_not_ask_for_is_refused():
    relay = relay_servicer(allowed=("peer", "stranger"))
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        first = stage_pb2.RelayFrame(conn_id=7)
        with pytest.raises(grpc.RpcError) as err:
            metadata = relay_md("stranger", "Accept", first)
            list(stage_pb2_grpc.RelayStub(channel).Accept(iter([first]), metadata=metadata))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_oversized_frame_ends_the_connection():
    limits = RelayLimits(max_frame_bytes=1024)
    with relayed(limits=limits) as (_, _, address, _, _, _), grpc.insecure_channel(address) as channel:
        frames = [stage_pb2.RelayFrame(target=IDS["peer"].peer_id), stage_pb2.RelayFrame(data=b"x" * 4096)]
        replies = stage_pb2_grpc.RelayStub(channel).Connect(
            iter(frames), metadata=relay_md("caller", "Connect", frames[0]), timeout=10
        )
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds 1024" in err.value.details()


def test_a_frame_after_the_first_carries_data_only():
    # frames are forwarded as they came (no new message per frame): one naming a target or a connection mid-stream
    # is malformed and ends the connection instead of reaching the other end
    with relayed() as (_, _, address, _, _, _), grpc.insecure_channel(address) as channel:
        frames = [stage_pb2.RelayFrame(target=IDS["peer"].peer_id), stage_pb2.RelayFrame(data=b"x", conn_id=3)]
        replies = stage_pb2_grpc.RelayStub(channel).Connect(
            iter(frames), metadata=relay_md("caller", "Connect", frames[0]), timeout=10
        )
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data only" in err.value.details()


def test_a_newer_attach_replaces_the_older():
    with relayed() as (relay, _, address, tunnels, first, _):
        second = Attachment(lambda: (IDS["relay"].peer_id, address), signer("peer"), first.local_address).start()
        try:
            assert second.attached.wait(10)
            # the older Attach's stream ended (the first re-attaches in turn: the newest always serves)
            deadline = time.monotonic() + 10
            while first.attached.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert relay.attached() == [IDS["peer"].peer_id]
            # the two now replace each other in turn; with the older stopped, the newer holds the place
            first.close()
            deadline = time.monotonic() + 10
            while not second.attached.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert relay.attached() == [IDS["peer"].peer_id] and second.attached.is_set()
            assert probe(tunnels, b"still served") == b"still served"
        finally:
            second.close()


def test_a_relay_killed_mid_call_fails_the_call_fast_and_nothing_hangs():
    block, entered = threading.Event(), threading.Event()

    class SlowStage(EchoStage):
        def Probe(self, request, context):
            entered.set()
            block.wait(30)
            return stage_pb2.ProbeReply(payload=b"late")

    relay = relay_servicer()
    with serve(relay) as (relay_server, relay_address), serve(SlowStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = Attachment(lambda: (IDS["relay"].peer_id, relay_address), signer("peer"), p_address).start()
        route = RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, relay_address)
        tunnels = Tunnels(signer("caller"), lambda a: route)
        try:
            assert attachment.attached.wait(10)
            errors = []

            def call():
                try:
                    probe(tunnels, b"x", timeout=30)
                except grpc.RpcError as e:
                    errors.append(e)

            caller = threading.Thread(target=call)
            started = time.monotonic()
            caller.start()
            assert entered.wait(10)
            relay_server.stop(grace=None)
            caller.join(15)
            assert not caller.is_alive() and time.monotonic() - started < 10
            assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
        finally:
            block.set()
            tunnels.close()
            attachment.close()


def test_the_reverse_connection_runs_in_the_relays_process():
    """When the caller is P's relay itself, the tunnel pipes into the Attach without a Connect call."""
    relay = relay_servicer()
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = Attachment(lambda: (IDS["relay"].peer_id, relay_address), signer("peer"), p_address).start()
        route = RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, "unused:1")
        tunnels = Tunnels(signer("relay"), lambda a: route, local=relay)
        try:
            assert attachment.attached.wait(10)
            assert probe(tunnels, b"neighbour", who="relay") == b"neighbour"
        finally:
            tunnels.close()
            attachment.close()


# ---- dial-back -------------------------------------------------------------------------------------------


def test_dial_back_reaches_the_announced_address_and_the_asker_decides_from_its_own_echo():
    nonces = NonceBook()
    asker = relay_servicer(nonces=nonces)
    asker.verifier = CallVerifier(IDS["peer"].peer_id)
    with serve(asker) as (_, asker_address):
        # one helper per question: a helper holds a caller's turn for its whole dial timeout (issue 27)
        for address, expected in ((asker_address, True), ("127.0.0.1:1", False)):  # nobody answers there: False
            helper = relay_servicer(dial_back=DialBackHelper({IDS["peer"].peer_id: address}.get, signer("relay")))
            with serve(helper) as (_, helper_address):
                assert check_reachable([(IDS["relay"].peer_id, helper_address)], signer("peer"), nonces) is expected
        # no helper answers: unknown
        assert check_reachable([(IDS["relay"].peer_id, "127.0.0.1:1")], signer("peer"), nonces) is None


def _silent_listener() -> socket.socket:
    """A port that takes TCP connections and never says a word (as a NAT'd host whose SYNs are dropped is, to
    gRPC: the connection never becomes ready)."""
    return socket.create_server(("127.0.0.1", 0), backlog=16)


def test_dial_back_asks_its_helpers_at_once():
    nonces = NonceBook()
    asker = relay_servicer(nonces=nonces)
    asker.verifier = CallVerifier(IDS["peer"].peer_id)
    with serve(asker) as (_, asker_address), _silent_listener() as silent:
        announced = {IDS["peer"].peer_id: asker_address}
        helper = relay_servicer(dial_back=DialBackHelper(announced.get, signer("relay"), interval_s=0.0))
        with serve(helper) as (_, helper_address):
            silent_address = f"127.0.0.1:{silent.getsockname()[1]}"
            helpers = [(IDS["caller"].peer_id, silent_address), (IDS["relay"].peer_id, helper_address)]
            started = time.monotonic()
            assert check_reachable(helpers, signer("peer"), nonces, timeout_s=4.0) is True
            assert time.monotonic() - started < 3.0  # before: the silent helper's whole timeout first


def test_an_attach_to_a_relay_that_never_connects_fails_fast():
    failed = threading.Event()
    with _silent_listener() as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        attachment = Attachment(
            lambda: (IDS["relay"].peer_id, address), signer("peer"), "127.0.0.1:1",
            RelayLimits(attach_connect_s=0.5), on_fail=lambda relay, code: failed.set(),
        ).start()  # fmt: skip
        try:
            assert failed.wait(5.0), "the peer moves on to another relay (before: it waited on this one)"
            assert not attachment.attached.is_set()
        finally:
            attachment.close()


def test_dial_back_dials_only_what_the_caller_announced():
    dialed = []

    def channel(address):
        dialed.append(address)
        return grpc.insecure_channel(address)

    helper = relay_servicer(dial_back=DialBackHelper({}.get, signer("relay"), channel=channel))
    with serve(helper) as (_, address), grpc.insecure_channel(address) as ch:
        stub = stage_pb2_grpc.RelayStub(ch)
        request = stage_pb2.DialBackRequest(nonce=b"n" * 32)
        metadata = relay_md("stranger", "DialBack", request)
        with pytest.raises(grpc.RpcError) as err:  # a caller that announces no address gets no dial at all
            stub.DialBack(request, metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "announces no address" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # malformed nonce
            short = stage_pb2.DialBackRequest(nonce=b"n")
            stub.DialBack(short, metadata=relay_md("stranger", "DialBack", short), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # anonymous
            stub.DialBack(stage_pb2.DialBackRequest(nonce=b"n" * 32), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dialed == []


def test_one_dial_back_at_a_time_per_caller():
    release, entered = threading.Event(), threading.Event()

    class Stuck(stage_pb2_grpc.RelayServicer):
        def Echo(self, request, context):
            entered.set()
            release.wait(20)
            return stage_pb2.EchoReply(known=False)

    from swarm.net.relay import RelayError

    with serve(Stuck()) as (_, stuck_address):
        helper = DialBackHelper({IDS["peer"].peer_id: stuck_address}.get, signer("relay"), timeout_s=2, interval_s=0)
        assert helper.dial_back(IDS["peer"].peer_id, b"a" * 32)[0] is False  # answered before the dial
        try:
            assert entered.wait(10)
            with pytest.raises(RelayError, match="under way"):
                helper.dial_back(IDS["peer"].peer_id, b"b" * 32)
        finally:
            release.set()
        # the Echo answered, but the turn is held for the whole timeout (its length would tell the port's state)
        with pytest.raises(RelayError, match="under way"):
            helper.dial_back(IDS["peer"].peer_id, b"b" * 32)
        deadline = time.monotonic() + 10
        while helper.busy(IDS["peer"].peer_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert helper.dial_back(IDS["peer"].peer_id, b"c" * 32)[0] is False  # the turn is free again
        helper.close()


def test_dial_backs_are_spaced_per_caller_and_say_nothing_about_how_a_dial_failed():
    from swarm.net.reach import DIALING
    from swarm.net.relay import RelayError

    helper = DialBackHelper({IDS["peer"].peer_id: "127.0.0.1:1"}.get, signer("relay"), timeout_s=0.3, interval_s=60.0)
    assert helper.dial_back(IDS["peer"].peer_id, b"a" * 32) == (False, DIALING)
    deadline = time.monotonic() + 10
    while helper.busy(IDS["peer"].peer_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(RelayError, match="one dial-back per 60 s"):
        helper.dial_back(IDS["peer"].peer_id, b"b" * 32)


class Mute(stage_pb2_grpc.RelayServicer):
    pass


def test_a_peer_that_never_accepts_fails_the_connect_and_a_late_accept_is_refused():
    relay = relay_servicer(limits=RelayLimits(accept_timeout_s=0.5))
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        attach = stub.Attach(iter(()), metadata=relay_md("peer", "Attach"), timeout=20)  # never opens an Accept
        assert next(attach).conn_id == 0
        started = time.monotonic()
        first = stage_pb2.RelayFrame(target=IDS["peer"].peer_id)
        replies = stub.Connect(iter([first]), metadata=relay_md("caller", "Connect", first), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "did not accept" in err.value.details()
        assert time.monotonic() - started < 5
        conn_id = next(attach).conn_id
        assert conn_id > 0
        with pytest.raises(grpc.RpcError) as err:  # too late: the connection is gone
            accept = stage_pb2.RelayFrame(conn_id=conn_id)
            list(stub.Accept(iter([accept]), metadata=relay_md("peer", "Accept", accept), timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        attach.cancel()


@pytest.mark.parametrize(
    "first",
    [stage_pb2.RelayFrame(), stage_pb2.RelayFrame(target="x" * 65), stage_pb2.RelayFrame(target="p", data=b"x")],
)
def test_a_malformed_connect_is_refused(first):
    relay = relay_servicer()
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        replies = stage_pb2_grpc.RelayStub(channel).Connect(
            iter([first]), metadata=relay_md("caller", "Connect", first), timeout=10
        )
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_one_caller_cannot_take_every_connection_to_an_attached_peer():
    limits = RelayLimits(conns_per_caller=1)
    with (
        relayed(limits=limits) as (_, _, address, tunnels, _, _),
        grpc.insecure_channel(tunnels.dial("p.example:1")) as held,
    ):
        md = signer("caller").metadata(IDS["peer"].peer_id)
        stage_pb2_grpc.StageStub(held).Probe(stage_pb2.ProbeRequest(payload=b"x"), timeout=10, metadata=md)
        with grpc.insecure_channel(address) as channel:  # the caller's one connection is open: a second is refused
            first = stage_pb2.RelayFrame(target=IDS["peer"].peer_id)
            replies = stage_pb2_grpc.RelayStub(channel).Connect(
                iter([first]), metadata=relay_md("caller", "Connect", first), timeout=10
            )
            with pytest.raises(grpc.RpcError) as err:
                list(replies)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # another caller still gets through
        route = RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, address)
        others = Tunnels(signer("stranger"), lambda a: route)
        try:
            assert probe(others, b"other", who="stranger") == b"other"
        finally:
            others.close()


def test_a_connect_waits_for_the_attach_of_a_peer_moving_to_this_relay_and_not_for_strangers():
    import threading
    import time

    # "peer" announces this relay (it is moving here): a Connect that comes first is held until it attaches
    relay = relay_servicer(limits=RelayLimits(attach_wait_s=30.0))
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        route = RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, relay_address)
        tunnels = Tunnels(signer("caller"), lambda a: route if a == "p.example:1" else None)
        got: list[bytes] = []
        caller = threading.Thread(target=lambda: got.append(probe(tunnels, b"moved", timeout=30)), daemon=True)
        caller.start()
        deadline = time.monotonic() + 20
        while relay._waiting != 1 and time.monotonic() < deadline:
            caller.join(0.05)  # poll: the Connect is waiting for the Attach
        assert relay._waiting == 1, "the Connect waits for the announced peer's Attach"
        attachment = Attachment(lambda: (IDS["relay"].peer_id, relay_address), signer("peer"), p_address).start()
        try:
            caller.join(30)
            assert got == [b"moved"] and relay._waiting == 0
        finally:
            tunnels.close()
            attachment.close()
    # a target that does not announce this relay is refused at once, whatever the wait allowed
    stranger = relay_servicer(allowed=(), limits=RelayLimits(attach_wait_s=30.0))
    with serve(stranger) as (_, address), grpc.insecure_channel(address) as channel:
        started = time.monotonic()
        first = stage_pb2.RelayFrame(target=IDS["peer"].peer_id)
        replies = stage_pb2_grpc.RelayStub(channel).Connect(
            iter([first]), metadata=relay_md("caller", "Connect", first), timeout=60
        )
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() - started < 15
