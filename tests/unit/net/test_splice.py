"""The relay's raw data port (swarm.net.splice) over real sockets on loopback: relayed connections' bytes flow as
plain TCP, paced and counted as frames were; a peer that cannot reach the data port falls back to the Accept
stream; hellos from strangers, with a wrong secret, duplicated, late, slow or malformed are refused without a
word, and nothing hangs."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest

from swarm.metrics import Metrics
from swarm.net.auth import PROOF_BYTES, PROOF_KEY, TOKEN_KEY
from swarm.net.relay import Attachment, RelayLimits, RelayRoute, Tunnels
from swarm.net.splice import HELLO, HELLO_PATH, TAKEN, VERSION, DataPort, hello, hello_head, splice
from swarm.proto import stage_pb2, stage_pb2_grpc
from tests.unit.net.test_relay import IDS, EchoStage, probe, relay_md, relay_servicer, serve, signer

pytestmark = pytest.mark.timeout(60)


def counting(relay):
    """Wraps the relay's data-port hand-over (before `listen_raw`): the list records each one's (peer, outcome)."""
    taken, take = [], relay.take_raw

    def wrapped(conn_id, secret, peer, sock):
        ok = take(conn_id, secret, peer, sock)
        taken.append((peer, ok))
        return ok

    relay.take_raw = wrapped
    return taken


def attach(relay_address: str, p_address: str, **kw) -> Attachment:
    attachment = Attachment(lambda: (IDS["relay"].peer_id, relay_address), signer("peer"), p_address, **kw).start()
    assert attachment.attached.wait(10)
    return attachment


def caller_tunnels(relay_address: str) -> Tunnels:
    return Tunnels(signer("caller"), lambda a: RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, relay_address))


@pytest.mark.parametrize("reverse", [False, True], ids=["two-legs", "reverse"])
def test_relayed_bytes_flow_by_the_data_port_and_are_counted(reverse):
    metrics = Metrics()
    relay = relay_servicer(metrics=metrics)
    taken = counting(relay)
    relay.listen_raw("127.0.0.1")
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = attach(relay_address, p_address)
        route = RelayRoute(IDS["peer"].peer_id, IDS["relay"].peer_id, relay_address)
        who = "relay" if reverse else "caller"
        tunnels = Tunnels(signer(who), lambda a: route, local=relay if reverse else None)
        try:
            payload = bytes(range(256)) * 4096  # 1 MiB each way
            assert probe(tunnels, payload, who=who) == payload
            assert probe(tunnels, b"again", who=who) == b"again"  # (gRPC may share the connection)
        finally:
            tunnels.close()
            attachment.close()
            relay.close()
    assert taken and all(ok for _, ok in taken), "every connection taken by the data port (not an Accept)"
    ends = {IDS["peer"].peer_id} if reverse else {IDS["peer"].peer_id, IDS["caller"].peer_id}
    assert {peer for peer, _ in taken} == ends, "two legs: the caller's leg by the data port too"
    snap = metrics.snapshot()
    c, p = IDS[who].peer_id, IDS["peer"].peer_id
    assert snap[f'swarm_relayed_bytes_total{{link="{c}->{p}"}}'] > len(payload)
    assert snap[f'swarm_relayed_bytes_total{{link="{p}->{c}"}}'] > len(payload)


def test_raw_relayed_bytes_are_paced_by_the_relays_shaper():
    from swarm.peers.shaper import LinkShape, LinkShaping

    shaping = LinkShaping(LinkShape(rate_bytes_per_s=2e6, burst_bytes=64 << 10))
    relay = relay_servicer(shaping=shaping, address_of={IDS["peer"].peer_id: "p.example:1"}.get)
    taken = counting(relay)
    relay.listen_raw("127.0.0.1")
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = attach(relay_address, p_address)
        tunnels = caller_tunnels(relay_address)
        try:
            probe(tunnels, b"warm")
            payload = b"z" * (1 << 20)
            started = time.monotonic()
            assert probe(tunnels, payload) == payload
            elapsed = time.monotonic() - started
        finally:
            tunnels.close()
            attachment.close()
            relay.close()
    assert taken and all(ok for _, ok in taken)
    assert elapsed >= 0.45, elapsed  # 1 MiB each way at 2 MB/s per destination
    assert set(shaping._shapers) == {"p.example:1", IDS["caller"].peer_id}


def test_a_peer_that_cannot_reach_the_data_port_falls_back_to_the_accept_stream():
    relay = relay_servicer()
    relay.listen_raw("127.0.0.1")
    relay.data_port.close()  # offered, but nobody listens: the dial is refused
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = attach(relay_address, p_address)
        tunnels = caller_tunnels(relay_address)
        try:
            assert probe(tunnels, b"through frames") == b"through frames"
            assert relay_address in attachment._raw.failed, "not tried again for a while"
        finally:
            tunnels.close()
            attachment.close()


def test_a_caller_that_cannot_reach_the_data_port_sends_frames_instead(monkeypatch):
    import swarm.net.splice as splice_module

    dial = splice_module.dial_data_port

    def callers_fail(*args):  # the caller's tunnel thread cannot reach the port; P's Accept threads can
        return None if threading.current_thread().name == "swarm-tunnel-conn" else dial(*args)

    monkeypatch.setattr(splice_module, "dial_data_port", callers_fail)
    metrics = Metrics()
    relay = relay_servicer(metrics=metrics)
    taken = counting(relay)
    relay.listen_raw("127.0.0.1")
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = attach(relay_address, p_address)
        tunnels = caller_tunnels(relay_address)
        try:
            payload = b"q" * (300 << 10)
            assert probe(tunnels, payload) == payload
            assert relay_address in tunnels._raw.failed, "the next connections do not ask for it"
        finally:
            tunnels.close()
            attachment.close()
            relay.close()
    assert {peer for peer, ok in taken if ok} == {IDS["peer"].peer_id}, "P's leg still by the data port"
    c, p = IDS["caller"].peer_id, IDS["peer"].peer_id
    assert metrics.snapshot()[f'swarm_relayed_bytes_total{{link="{c}->{p}"}}'] > len(payload)


def test_a_peer_told_not_to_use_the_data_port_takes_the_accept_stream():
    relay = relay_servicer()
    taken = counting(relay)
    relay.listen_raw("127.0.0.1")
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = attach(relay_address, p_address, raw=False)
        tunnels = caller_tunnels(relay_address)
        try:
            assert probe(tunnels, b"frames") == b"frames"
        finally:
            tunnels.close()
            attachment.close()
            relay.close()
    assert taken == []


def _hello_reply(port: int, data: bytes) -> bytes:
    """What the data port answers `data` with: TAKEN, or b"" when it closed the socket without a word."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        try:
            return sock.recv(1)
        except ConnectionResetError:
            return b""


def test_hellos_are_taken_only_from_the_asked_peer_with_its_secret_once():
    relay = relay_servicer(limits=RelayLimits(accept_timeout_s=5.0))
    port = relay.listen_raw("127.0.0.1")
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        attach_call = stub.Attach(iter(()), metadata=relay_md("peer", "Attach"), timeout=30)  # we answer by hand
        assert next(attach_call).conn_id == 0
        caller_done = threading.Event()
        first = stage_pb2.RelayFrame(target=IDS["peer"].peer_id)

        def caller_frames():  # the target, then nothing: the stream stays open until the caller goes
            yield first
            caller_done.wait(30)

        replies = stub.Connect(caller_frames(), metadata=relay_md("caller", "Connect", first), timeout=20)
        down = next(attach_call)
        assert down.conn_id > 0 and down.splice_port == port and len(down.splice_secret) == 16
        conn_id, secret = down.conn_id, bytes(down.splice_secret)
        relay_id = IDS["relay"].peer_id
        peer, stranger = signer("peer"), signer("stranger")
        wrong = bytes(16 - len(b"x")) + b"x"
        assert _hello_reply(port, hello(conn_id, secret, stranger, relay_id)) == b"", "a stranger's hello"
        assert _hello_reply(port, hello(conn_id, wrong, peer, relay_id)) == b"", "a wrong secret"
        assert _hello_reply(port, hello(conn_id + 7, secret, peer, relay_id)) == b"", "a connection never asked"
        assert _hello_reply(port, b"GET / HTTP/1.1\r\n\r\n" + bytes(64)) == b"", "not a hello"
        too_long = HELLO.pack(b"swsp", VERSION, conn_id, secret, 60000)
        assert _hello_reply(port, too_long) == b"", "a token longer than any"
        # the peer's token captured (its Attach's, in plaintext): alone, with the stranger's proof, or with a proof
        # of another call, it takes nothing; nor does the earlier hello format (version 1: the token alone)
        captured = dict(relay_md("peer", "Attach"))
        token = captured[TOKEN_KEY]
        head = HELLO.pack(b"swsp", VERSION, conn_id, secret, len(token)) + token
        own = dict(stranger.metadata(relay_id, HELLO_PATH, hello_head(conn_id, secret)))[PROOF_KEY]
        assert _hello_reply(port, head + own) == b"", "a captured token with a stranger's proof"
        assert _hello_reply(port, head + captured[PROOF_KEY]) == b"", "a captured token with its Attach's proof"
        assert _hello_reply(port, head + bytes(PROOF_BYTES)) == b"", "a captured token with a forged proof"
        old = HELLO.pack(b"swsp", 1, conn_id, secret, len(token)) + token
        assert _hello_reply(port, old) == b"", "the token-only hello of version 1"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as good:
            sent = hello(conn_id, secret, peer, relay_id)
            good.sendall(sent)
            assert good.recv(1) == TAKEN
            assert _hello_reply(port, sent) == b"", "the same hello sent again"
            assert _hello_reply(port, hello(conn_id, secret, peer, relay_id)) == b"", "taken once only"
            with pytest.raises(grpc.RpcError) as err:  # nor by a late Accept
                accept = stage_pb2.RelayFrame(conn_id=conn_id)
                list(stub.Accept(iter([accept]), metadata=relay_md("peer", "Accept", accept), timeout=10))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            caller_done.set()  # the caller goes: the relay ends the raw connection too
            replies.cancel()
            good.settimeout(10)
            assert good.recv(16) == b"", "closed when the caller's Connect ended"
        attach_call.cancel()
    relay.close()


def test_a_slow_or_silent_hello_is_dropped_and_hellos_are_bounded():
    calls = []
    port = DataPort("127.0.0.1", verifier=None, take=lambda *a: calls.append(a) or True, hello_timeout_s=0.3,
                    max_hellos=2)  # fmt: skip
    try:
        silent = [socket.create_connection(("127.0.0.1", port.port), timeout=10) for _ in range(3)]
        started = time.monotonic()
        assert silent[2].recv(1) == b"", "beyond max_hellos: closed at once"
        for sock in silent[:2]:
            assert sock.recv(1) == b"", "dropped after hello_timeout_s"
            sock.close()
        assert time.monotonic() - started < 5
        silent[2].close()
        half = socket.create_connection(("127.0.0.1", port.port), timeout=10)
        half.sendall(HELLO.pack(b"swsp", VERSION, 1, bytes(16), 100)[:10])  # half a header, then nothing
        assert half.recv(1) == b""
        half.close()
        assert calls == []
    finally:
        port.close()


def test_splice_carries_both_ways_and_ends_when_either_side_goes():
    a_out, a_in = socket.socketpair()
    b_out, b_in = socket.socketpair()
    seen = []
    worker = threading.Thread(target=splice, args=(a_in, b_in, seen.append, None))
    worker.start()
    a_out.sendall(b"hello")
    assert b_out.recv(5) == b"hello"
    b_out.sendall(b"world")
    assert a_out.recv(5) == b"world"
    assert seen == [5]
    a_out.close()  # one side ends: the other sees the end, and answering it closes the splice
    b_out.settimeout(10)
    assert b_out.recv(1) == b""
    b_out.close()
    worker.join(10)
    assert not worker.is_alive()


def test_hello_refuses_a_bad_secret_and_carries_a_proof_of_its_head():
    with pytest.raises(ValueError):
        hello(1, b"short", signer("peer"), IDS["relay"].peer_id)
    assert struct.calcsize("!4sBQ16sH") == HELLO.size
    made = hello(1, bytes(16), signer("peer"), IDS["relay"].peer_id)
    *_, n = HELLO.unpack_from(made)
    assert len(made) == HELLO.size + n + PROOF_BYTES


def test_a_callers_offer_is_taken_only_by_that_caller_once_and_joins_the_two_sockets():
    relay = relay_servicer(limits=RelayLimits(accept_timeout_s=5.0))
    port = relay.listen_raw("127.0.0.1")
    with serve(relay) as (_, address), grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.RelayStub(channel)
        audience = IDS["relay"].peer_id
        attach_call = stub.Attach(iter(()), metadata=relay_md("peer", "Attach"), timeout=30)
        assert next(attach_call).conn_id == 0
        caller_done = threading.Event()
        first = stage_pb2.RelayFrame(target=IDS["peer"].peer_id, splice=True)

        def caller_frames():
            yield first
            caller_done.wait(30)

        replies = stub.Connect(caller_frames(), metadata=relay_md("caller", "Connect", first), timeout=20)
        down = next(attach_call)
        who = {n: signer(n) for n in ("peer", "caller", "stranger")}
        with socket.create_connection(("127.0.0.1", port), timeout=10) as p_sock:
            p_sock.sendall(hello(down.conn_id, bytes(down.splice_secret), who["peer"], audience))
            assert p_sock.recv(1) == TAKEN
            offer = next(replies)  # the relay's first reply: its data port, for this caller
            assert offer.splice_port == port and offer.conn_id and len(offer.splice_secret) == 16 and not offer.data
            conn_id, secret = offer.conn_id, bytes(offer.splice_secret)
            assert _hello_reply(port, hello(conn_id, secret, who["stranger"], audience)) == b"", "a stranger's hello"
            assert _hello_reply(port, hello(conn_id, secret, who["peer"], audience)) == b"", "not the caller"
            assert _hello_reply(port, hello(conn_id, bytes(16), who["caller"], audience)) == b"", "a wrong secret"
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c_sock:
                c_sock.sendall(hello(conn_id, secret, who["caller"], audience))
                assert c_sock.recv(1) == TAKEN
                assert _hello_reply(port, hello(conn_id, secret, who["caller"], audience)) == b"", "taken once only"
                c_sock.sendall(b"ping")
                assert p_sock.recv(4) == b"ping"
                p_sock.sendall(b"pong")
                assert c_sock.recv(4) == b"pong"
                c_sock.close()  # the caller's socket ends: the target's end sees it
                p_sock.settimeout(10)
                assert p_sock.recv(1) == b""
        caller_done.set()
        replies.cancel()
        attach_call.cancel()
    relay.close()


def test_without_a_data_port_a_splice_asking_connect_gets_an_empty_first_reply_then_frames():
    relay = relay_servicer()  # no data port: the peer's Attachment opens Accepts
    with serve(relay) as (_, relay_address), serve(EchoStage(IDS["peer"].peer_id)) as (_, p_address):
        attachment = attach(relay_address, p_address)
        tunnels = caller_tunnels(relay_address)
        try:
            assert probe(tunnels, b"frames both legs") == b"frames both legs"
            assert tunnels._raw.failed == {}, "nothing offered, nothing failed"
        finally:
            tunnels.close()
            attachment.close()


def test_a_failed_accept_does_not_end_the_data_port():
    """accept() failing for a moment (EMFILE under a flood) must not stop the port for good."""
    import errno

    class Flaky(DataPort):
        failures = 2

        def _accept(self):
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return super()._accept()

    port = Flaky("127.0.0.1", verifier=None, take=lambda *a: False, hello_timeout_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", port.port), timeout=10) as sock:
            sock.sendall(b"x" * HELLO.size)  # served: read, refused, closed
            assert sock.recv(1) == b""
        assert port.failures == 0
    finally:
        port.close()
