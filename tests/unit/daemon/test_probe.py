"""`LinkProber.measure` against a peer that takes the TCP connection but never answers (behind NAT a dial into a
private address is dropped without a word; a stalled peer looks the same): it gives up within `answer_s`, not the
Sink's 30 s, so the daemon's loop that follows plans is not held."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from swarm.daemon.probe import LinkProber
from swarm.peers.shaper import LinkShaping
from swarm.peers.transport import Channels, TransportConfig

pytestmark = pytest.mark.timeout(60)


class _DHT:
    peer_id = "prober"


def test_a_probe_of_a_peer_that_never_answers_gives_up_within_answer_s():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the kernel's backlog; nothing ever reads or answers them
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    channels = Channels(TransportConfig())
    try:
        prober = LinkProber(_DHT(), "127.0.0.1:1", LinkShaping(), channels)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            prober.measure(address, timeout_s=30.0, answer_s=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 15.0, "held for the Sink's timeout, not the answer's"
    finally:
        channels.close()
        silent.close()


class _Announced:
    def __init__(self, peer_id: str, address: str):
        self.peer_id, self.address = peer_id, address


class _Peers(_DHT):
    def __init__(self):
        self.announced: list[_Announced] = []
        self.stored = []

    def peers(self):
        return list(self.announced)

    def store_link(self, measurement) -> None:
        self.stored.append(measurement)


def test_a_round_that_finds_nobody_says_so_so_the_daemon_looks_again_soon():
    dht = _Peers()
    prober = LinkProber(dht, "127.0.0.1:1", LinkShaping(), channels=None)
    prober.measure = lambda address: (1e-3, 125e3, 65536.0)  # no network: the round's bookkeeping alone
    assert prober.round(now=0.0) == 0 and not prober.found_peers  # alone: the daemon asks again within 1 s
    dht.announced = [_Announced("prober", "127.0.0.1:1"), _Announced("other", "127.0.0.1:2")]
    assert prober.round(now=1.0) == 1 and prober.found_peers
    assert [m.dst for m in dht.stored] == ["other"] and dht.stored[0].burst_bytes == 65536.0
    # the data path's zstd decision on that link reads the measured rate (nothing in the application shapes it)
    assert prober.shaping.for_destination("127.0.0.1:2").known_rate() == 125e3
    assert prober.shaping.for_destination("127.0.0.1:3").known_rate() is None
    assert prober.round(now=2.0) == 0 and prober.found_peers  # measured: the plan interval's refresh now


def test_a_channel_whose_dial_target_changes_is_retired_not_closed_under_its_calls():
    """A peer that starts announcing a relay changes its dial target; a call already on the old channel must finish
    (closing it failed the call with "Channel closed!" and the step ran again), and retired channels stay bounded."""
    from concurrent import futures

    started, release = __import__("threading").Event(), __import__("threading").Event()

    def slow(request, context):
        started.set()
        release.wait(10)
        return request

    handler = grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(slow)})
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    targets = iter([f"127.0.0.1:{port}", f"localhost:{port}"] + [f"127.0.0.{i}:{port}" for i in range(2, 40)])
    channels = Channels(TransportConfig(), dial=lambda address: next(targets))
    try:
        old = channels.get("peer")
        call = old.unary_unary("/t.T/Echo").future(b"x", timeout=10)
        assert started.wait(10)
        new = channels.get("peer")  # the dial target changed under the call
        assert new is not old
        release.set()
        assert call.result() == b"x", "the call on the retired channel finishes"
        for _ in range(Channels.retired_kept + 3):
            channels.get("peer")
        assert len(channels._retired) == Channels.retired_kept
    finally:
        release.set()
        channels.close()
        server.stop(0)
    assert channels._retired == [] and channels._channels == {}
