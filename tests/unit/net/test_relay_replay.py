"""The relay's own calls bound to themselves (issue 27): Attach, Connect, Accept, DialBack and Echo each carry a
proof of this call (method, its request or first frame, a nonce, the time) beside the token, checked by the
relay's `CallVerifier`, over real gRPC on loopback. A captured call sent again, on another method or with other
fields, a stale one, or a token alone, is refused UNAUTHENTICATED before it changes anything; the honest call
is served."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from swarm.net.auth import CallVerifier
from swarm.net.reach import DIALING, DialBackHelper, NonceBook
from swarm.net.relay import RelayLimits, relay_metadata, relay_path
from swarm.proto import stage_pb2, stage_pb2_grpc
from tests.unit.net.test_relay import IDS, relay_md, relay_servicer, serve, signer

pytestmark = pytest.mark.timeout(60)

RELAY, PEER = IDS["relay"].peer_id, IDS["peer"].peer_id


def refused(call) -> str:
    """The details of `call()`'s UNAUTHENTICATED refusal (any other outcome fails the test)."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    return err.value.details()


def attach(stub, metadata):
    """An Attach with `metadata`, once the relay accepted it (its first AttachDown, conn_id 0)."""
    call = stub.Attach(iter(()), metadata=metadata, timeout=30)
    assert next(call).conn_id == 0
    return call


def connect(stub, who: str = "caller", metadata=None, first=None):
    first = first or stage_pb2.RelayFrame(target=PEER)
    return stub.Connect(iter([first]), metadata=metadata or relay_md(who, "Connect", first), timeout=10)


def test_a_replayed_attach_is_refused_and_the_peer_keeps_its_connections():
    relay = relay_servicer(limits=RelayLimits(accept_timeout_s=0.5))
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        captured = relay_md("peer", "Attach")
        honest = attach(stub, captured)
        held = relay._attached[PEER]
        # sent again while the peer is attached (to take its relayed connections), or after it left: refused
        assert "replayed call" in refused(lambda: next(stub.Attach(iter(()), metadata=captured, timeout=10)))
        assert relay._attached[PEER] is held, "the honest Attach is not replaced"
        with pytest.raises(grpc.RpcError):
            list(connect(stub))  # nobody opens the Accept: UNAVAILABLE after accept_timeout_s
        assert next(honest).conn_id > 0, "the connection is asked of the honest peer's Attach"
        honest.cancel()
        assert "replayed call" in refused(lambda: next(stub.Attach(iter(()), metadata=captured, timeout=10)))
        again = attach(stub, relay_md("peer", "Attach"))  # the peer's own next Attach: served
        assert relay.holds(PEER)
        again.cancel()


def test_a_captured_connect_cannot_be_sent_again_nor_turned_into_another_call():
    relay = relay_servicer(allowed=("peer", "stranger"), limits=RelayLimits(accept_timeout_s=0.5))
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        peer_attach = attach(stub, relay_md("peer", "Attach"))
        first = stage_pb2.RelayFrame(target=PEER)
        captured = relay_md("caller", "Connect", first)
        # never sent by its caller yet: its proof still binds it to a Connect of this first frame
        other = stage_pb2.RelayFrame(target=IDS["stranger"].peer_id)
        assert "does not sign this call" in refused(lambda: list(connect(stub, metadata=captured, first=other)))
        spliced = stage_pb2.RelayFrame(target=PEER, splice=True)
        assert "does not sign this call" in refused(lambda: list(connect(stub, metadata=captured, first=spliced)))
        accept = stage_pb2.RelayFrame(conn_id=1)
        assert "does not sign this call" in refused(
            lambda: list(stub.Accept(iter([accept]), metadata=captured, timeout=10))
        )
        assert "does not sign this call" in refused(lambda: next(stub.Attach(iter(()), metadata=captured, timeout=10)))
        request = stage_pb2.DialBackRequest(nonce=b"n" * 32)
        assert "does not sign this call" in refused(lambda: stub.DialBack(request, metadata=captured, timeout=10))
        # its own call is served once: the relay asks the attached peer to accept it
        with pytest.raises(grpc.RpcError) as err:
            list(connect(stub, metadata=captured, first=first))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "did not accept" in err.value.details()
        served = next(peer_attach).conn_id
        assert served > 0
        assert "replayed call" in refused(lambda: list(connect(stub, metadata=captured, first=first)))
        # the replay took no slot and asked nothing of the peer: the next honest Connect is the next connection
        with pytest.raises(grpc.RpcError):
            list(connect(stub))
        assert next(peer_attach).conn_id == served + 1
        peer_attach.cancel()


def test_copies_of_one_connect_sent_at_once_are_served_once():
    relay = relay_servicer(limits=RelayLimits(accept_timeout_s=0.5))
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        peer_attach = attach(stub, relay_md("peer", "Attach"))
        first = stage_pb2.RelayFrame(target=PEER)
        captured = relay_md("caller", "Connect", first)
        codes: list[grpc.StatusCode] = []
        lock = threading.Lock()

        def send():
            try:
                list(connect(stub, metadata=captured, first=first))
            except grpc.RpcError as e:
                with lock:
                    codes.append(e.code())

        threads = [threading.Thread(target=send) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(c.name for c in codes) == ["UNAUTHENTICATED"] * 5 + ["UNAVAILABLE"]
        peer_attach.cancel()


def test_a_replayed_accept_is_refused():
    relay = relay_servicer(limits=RelayLimits(accept_timeout_s=5.0))
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        peer_attach = attach(stub, relay_md("peer", "Attach"))
        release = threading.Event()
        first = stage_pb2.RelayFrame(target=PEER)

        def frames():
            yield first
            release.wait(30)

        replies = stub.Connect(frames(), metadata=relay_md("caller", "Connect", first), timeout=30)
        conn_id = next(peer_attach).conn_id
        accept = stage_pb2.RelayFrame(conn_id=conn_id)
        captured = relay_md("peer", "Accept", accept)
        taken = threading.Event()

        def accept_frames():
            yield accept
            taken.wait(30)

        honest = stub.Accept(accept_frames(), metadata=captured, timeout=30)
        deadline = time.monotonic() + 10
        while not relay._pending[conn_id].taken() and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the relay's state, with a deadline
        assert relay._pending[conn_id].taken()
        assert "replayed call" in refused(lambda: list(stub.Accept(iter([accept]), metadata=captured, timeout=10)))
        taken.set()
        release.set()
        honest.cancel()
        replies.cancel()
        peer_attach.cancel()


def test_a_replayed_dial_back_is_refused_and_its_proof_serves_no_other_call():
    helper = DialBackHelper({PEER: "127.0.0.1:1"}.get, signer("relay"), timeout_s=0.3, interval_s=0.0)
    relay = relay_servicer(dial_back=helper, nonces=NonceBook())
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        request = stage_pb2.DialBackRequest(nonce=b"n" * 32)
        captured = relay_md("peer", "DialBack", request)
        reply = stub.DialBack(request, metadata=captured, timeout=10)
        assert not reply.reached and reply.detail == DIALING
        # sent again: refused as a replay (not RESOURCE_EXHAUSTED for the turn it would hold, nor served later)
        assert "replayed call" in refused(lambda: stub.DialBack(request, metadata=captured, timeout=10))
        deadline = time.monotonic() + 10
        while PEER in helper._busy and time.monotonic() < deadline:
            time.sleep(0.02)  # the turn comes back timeout_s after the dial
        assert PEER not in helper._busy
        assert "replayed call" in refused(lambda: stub.DialBack(request, metadata=captured, timeout=10))
        # a DialBack captured unsent: not good for another nonce, nor as an Echo of the same bytes
        fresh = relay_md("peer", "DialBack", request)
        other = stage_pb2.DialBackRequest(nonce=b"m" * 32)
        assert "does not sign this call" in refused(lambda: stub.DialBack(other, metadata=fresh, timeout=10))
        echo = stage_pb2.EchoRequest(nonce=request.nonce)  # serializes to the very same bytes
        assert "does not sign this call" in refused(lambda: stub.Echo(echo, metadata=fresh, timeout=10))
        assert stub.DialBack(request, metadata=fresh, timeout=10).detail == DIALING


def test_a_replayed_echo_is_refused():
    nonces = NonceBook()
    asker = relay_servicer(nonces=nonces)
    asker.verifier = CallVerifier(PEER)
    with serve(asker) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        request = stage_pb2.EchoRequest(nonce=nonces.issue())
        captured = relay_metadata(signer("relay"), PEER, "Echo", request)
        assert stub.Echo(request, metadata=captured, timeout=10).known
        assert "replayed call" in refused(lambda: stub.Echo(request, metadata=captured, timeout=10))


@pytest.mark.parametrize("method", ["Attach", "Connect", "Accept", "DialBack", "Echo"])
def test_a_token_alone_or_a_stale_proof_is_refused_on_every_relay_call(method):
    relay = relay_servicer(dial_back=DialBackHelper({}.get, signer("relay")), nonces=NonceBook())
    fields = {
        "Attach": None,
        "Connect": stage_pb2.RelayFrame(target=PEER),
        "Accept": stage_pb2.RelayFrame(conn_id=1),
        "DialBack": stage_pb2.DialBackRequest(nonce=b"n" * 32),
        "Echo": stage_pb2.EchoRequest(nonce=b"n" * 32),
    }[method]
    token_only = signer("peer").metadata(RELAY)
    stale = signer("peer").metadata(RELAY, relay_path(method), fields, now=time.time() - 200)
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)

        def send(metadata):
            if method in ("DialBack", "Echo"):
                return getattr(stub, method)(fields, metadata=metadata, timeout=10)
            items = iter(()) if fields is None else iter([fields])
            return list(getattr(stub, method)(items, metadata=metadata, timeout=10))

        assert "missing call proof" in refused(lambda: send(token_only))
        assert "stale call proof" in refused(lambda: send(stale))
        assert relay.attached() == []
