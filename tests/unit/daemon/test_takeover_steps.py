"""A taker copies a stage's state only from its most advanced replicas (`most_advanced`): a replica with fewer
steps than another sat out steps or copied stale state, and copying it would leave the stage's replicas apart."""

from __future__ import annotations

from swarm.daemon.replication import most_advanced, patient_ping


def test_a_replica_behind_another_is_never_a_source():
    # the churn run's case: p1 (one step behind) copying plan 4's stage 0 from p5 (17 steps, stale) and p4 (21)
    assert most_advanced(["p5", "p4"], {"p5": 17, "p4": 21}, me="p1") == ["p4"]
    assert most_advanced(["a", "b", "c"], {"a": 9, "b": 9, "c": 8}, me="x") == ["a", "b"], "equals keep their order"


def test_this_peers_own_host_and_unknown_counts_stay():
    assert most_advanced(["me", "a", "b"], {"a": 5, "b": 4}, me="me") == ["me", "a"], "own host offered: not behind"
    assert most_advanced(["a", "b"], {"a": None, "b": 3}, me="x") == ["a", "b"], "an unknown count is not stale"
    assert most_advanced(["a"], {}, me="x") == ["a"] and most_advanced([], {}, me="x") == []


def test_a_holder_that_misses_a_quick_ping_is_asked_again_with_longer_deadlines():
    calls = []

    def make_ping(deadline):
        def ping(peer):
            calls.append((peer, deadline))
            return peer == "slow" and deadline >= 4 or peer == "quick"

        return ping

    ping = patient_ping(make_ping, timeouts=(1.0, 2.0, 4.0, 8.0))
    assert ping("quick") and calls == [("quick", 1.0)], "an answer at once is one ping"
    calls.clear()
    assert ping("slow") and calls == [("slow", 1.0), ("slow", 2.0), ("slow", 4.0)]
    calls.clear()
    assert not ping("gone") and [d for _, d in calls] == [1.0, 2.0, 4.0, 8.0], "silent through every deadline: gone"


def test_over_a_real_channel_a_holder_answering_in_1_5_s_is_kept_and_a_closed_port_is_not():
    import socket
    import threading
    import time

    import grpc

    from swarm.daemon.liveness import status_prober
    from swarm.peers.transport import TransportConfig, make_server
    from swarm.proto import stage_pb2, stage_pb2_grpc

    class Slow(stage_pb2_grpc.StageServicer):
        def Ping(self, request, context):
            time.sleep(1.5)  # a reply queued behind a saturated link's tensor bytes
            return stage_pb2.Empty()

    server, port = make_server(TransportConfig(max_workers=4))
    stage_pb2_grpc.add_StageServicer_to_server(Slow(), server)
    server.start()
    with socket.socket() as s:  # a port nothing listens on: a killed holder's, the connection refused
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]

    class Channels:
        def __init__(self):
            self.open, self.lock = {}, threading.Lock()

        def get(self, address):
            with self.lock:
                return self.open.setdefault(address, grpc.insecure_channel(address))

    channels = Channels()
    addresses = {"holder": f"127.0.0.1:{port}", "dead": f"127.0.0.1:{closed_port}"}
    try:
        quick = status_prober(channels, lambda: addresses, timeout_s=1.0)
        assert not quick("holder"), "one 1 s ping calls the live holder gone (the bug)"
        patient = patient_ping(lambda t: status_prober(channels, lambda: addresses, timeout_s=t))
        assert patient("holder")
        begun = time.monotonic()
        assert not patient("dead") and time.monotonic() - begun < 5, "a refused connection is gone at once"
    finally:
        server.stop(grace=None)
        for channel in channels.open.values():
            channel.close()
