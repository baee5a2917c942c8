"""`Tunnels.dial` of a relayed peer's own address: its calls to itself stay local."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.net.tunnel import RelayRoute, Tunnels


def _tunnels(routes: dict[str, RelayRoute]) -> Tunnels:
    local = SimpleNamespace(peer_id="me", holds=lambda peer_id: False)
    return Tunnels(None, routes.get, local=local)


def test_a_relayed_peer_dials_itself_directly():
    routes = {"10.78.0.26:50051": RelayRoute("me", "r", "10.77.0.10:50051")}
    routes["10.78.0.58:50051"] = RelayRoute("other", "r", "10.77.0.10:50051")
    tunnels = _tunnels(routes)
    try:
        before = tunnels.dial("10.78.0.26:50051")  # not yet relayed itself: the tunnel, as before
        assert before.startswith("127.0.0.1:")
        tunnels.own_address = "127.0.0.1:4242"
        # before: its own calls went out through its relay and back (relayed bytes "me->me" on the relay)
        assert tunnels.dial("10.78.0.26:50051") == "127.0.0.1:4242"
        other = tunnels.dial("10.78.0.58:50051")  # another relayed peer: still its tunnel
        assert other.startswith("127.0.0.1:") and other != "127.0.0.1:4242"
        assert tunnels.dial("10.77.0.12:50051") == "10.77.0.12:50051"  # a reachable peer: dialed directly
    finally:
        tunnels.close()


def test_a_peer_without_its_own_servicer_never_takes_a_routed_address_for_itself():
    # the trainer (no relay servicer, no id of its own here): every relayed stage is a tunnel, whatever the id
    tunnels = Tunnels(None, {"a:1": RelayRoute("me", "r", "r:1")}.get)
    tunnels.own_address = "127.0.0.1:4242"
    try:
        assert tunnels.dial("a:1").startswith("127.0.0.1:") and tunnels.dial("a:1") != "127.0.0.1:4242"
    finally:
        tunnels.close()


def test_a_peer_that_moves_its_relay_gets_a_new_tunnel_address_and_the_old_listener_closes():
    """A NAT'd peer moving its Attach to another relay: connections already made stay pinned to the old relay,
    which drops them when the old Attach closes (the nat experiment's step 25 failed so). A new dial target makes
    the caller's pool retire the old channel (its calls finish) and open the next connection through the new relay."""
    import socket

    import pytest

    routes = {"a:1": RelayRoute("p", "r1", "r1:1")}
    tunnels = Tunnels(None, routes.get)
    try:
        first = tunnels.dial("a:1")
        assert tunnels.dial("a:1") == first  # same relay: same tunnel
        routes["a:1"] = RelayRoute("p", "r2", "r2:1")
        second = tunnels.dial("a:1")
        assert second != first and second.startswith("127.0.0.1:")
        assert tunnels.dial("a:1") == second
        with pytest.raises(OSError):  # the old listener takes no new connection
            socket.create_connection(("127.0.0.1", int(first.rsplit(":", 1)[1])), timeout=2).close()
    finally:
        tunnels.close()


def test_an_accept_on_a_relay_channel_closed_meanwhile_is_dropped_quietly(caplog):
    """The suite's warning: a peer leaving closed its relay's channel while a `swarm-accept` thread was taking a
    connection; grpc raised ValueError("Cannot invoke RPC: Channel closed!") and the thread died with a traceback.
    The connection is now dropped as a failed Accept is: its socket closed, nothing raised."""
    import logging
    import socket as socketlib
    import threading

    from swarm.net.tunnel import Attachment

    server = socketlib.create_server(("127.0.0.1", 0))
    accepted: list = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
    acceptor.start()

    class _Closed:
        def Accept(self, frames, metadata=()):
            raise ValueError("Cannot invoke RPC: Channel closed!")

    attachment = Attachment(lambda: None, None, f"127.0.0.1:{server.getsockname()[1]}", raw=False)
    with caplog.at_level(logging.DEBUG, logger="swarm.relay"):
        attachment._accept(_Closed(), "relay", 7)  # must not raise
    acceptor.join(10)
    assert accepted and accepted[0].recv(1) == b""  # the peer's own server saw the connection closed
    assert any("not taken" in r.getMessage() for r in caplog.records)
    accepted[0].close()
    server.close()
