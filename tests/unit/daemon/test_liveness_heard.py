"""A plan peer that calls the planner (its activations, its gradients) is alive whatever its ping did: over a
saturated slow link the ping's answer waits behind the tensor bytes that peer sends (seen at 1 Mbit/s under tc:
the planner dropped the live stage 0 that fed it and planned a 1-stage pipeline). A call heard long ago proves
nothing now, a call is not a ping's proof that this peer can dial the caller, and the servicer records only
authenticated callers, in a bounded table. Fake clock and pings, no sleeps."""

from __future__ import annotations

from swarm.daemon.liveness import Liveness, LivenessConfig


class World:
    def __init__(self):
        self.now = 0.0
        self.answers: dict[str, bool] = {}
        self.calls: dict[str, float] = {}

    def clock(self) -> float:
        return self.now

    def ping(self, pid: str) -> bool:
        return self.answers.get(pid, False)

    def heard(self, pid: str) -> float | None:
        return self.calls.get(pid)


def rounds(live: Liveness, world: World, peers, n: int, calling=()) -> None:
    for _ in range(n):
        world.now += 1.0
        for pid in calling:
            world.calls[pid] = world.now - 0.5  # a call between this round and the last
        live.round(peers)


def test_a_peer_that_keeps_calling_is_never_gone_though_its_pings_time_out():
    world = World()
    cfg = LivenessConfig(every_s=1.0, gone_after_s=3.0, timeout_s=1.0, min_misses=2)
    live = Liveness(world.ping, cfg, clock=world.clock, heard=world.heard)
    world.answers = {"stage0": True, "other": True}
    rounds(live, world, ["stage0", "other"], 2)
    assert live.answered("stage0")
    world.answers = {}  # both pings now wait behind a saturated link
    rounds(live, world, ["stage0", "other"], 10, calling=["stage0"])
    assert live.gone() == {"other"}, "the one that calls is alive; the silent one is gone as before"


def test_a_call_heard_long_ago_proves_nothing_now():
    world = World()
    live = Liveness(world.ping, LivenessConfig(), clock=world.clock, heard=world.heard)
    world.calls["p"] = 0.0
    rounds(live, world, ["p"], 10)
    assert live.gone() == {"p"}


def test_a_call_is_no_proof_this_peer_can_dial_the_caller():
    world = World()
    live = Liveness(world.ping, LivenessConfig(), clock=world.clock, heard=world.heard)
    rounds(live, world, ["natted"], 10, calling=["natted"])
    assert not live.gone() and not live.answered("natted"), "not gone, but not planned as reachable on a call alone"


def test_without_a_source_nothing_changes_and_a_broken_one_is_no_proof():
    world = World()
    live = Liveness(world.ping, LivenessConfig(), clock=world.clock)
    rounds(live, world, ["p"], 10, calling=["p"])
    assert live.gone() == {"p"}

    def broken(pid):
        raise RuntimeError("boom")

    live = Liveness(world.ping, LivenessConfig(), clock=world.clock, heard=broken)
    rounds(live, world, ["p"], 10)
    assert live.gone() == {"p"}


def test_the_servicer_records_authenticated_callers_only_in_a_bounded_table(monkeypatch):
    import grpc
    import pytest

    import swarm.runtime.service as service
    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.connect import _LocalContext, method_path
    from swarm.proto import stage_pb2
    from swarm.runtime.service import StageServicer

    me = Identity.generate()
    servicer = StageServicer(None, CallVerifier(me.peer_id))
    caller = CallSigner(Identity.generate())
    request = stage_pb2.PingRequest()
    metadata = caller.metadata(me.peer_id, method_path("Ping"), request)
    servicer._caller(_LocalContext(metadata))
    assert servicer.heard_from(caller.identity.peer_id) is not None
    with pytest.raises(service.CallRefused) as e:  # a forged token: refused, not recorded
        servicer._caller(_LocalContext((("authorization", "junk"),)))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and len(servicer.heard) == 1
    monkeypatch.setattr(service, "HEARD_MAX", 1)
    stranger = CallSigner(Identity.generate())
    servicer._caller(_LocalContext(stranger.metadata(me.peer_id, method_path("Ping"), request)))
    assert servicer.heard_from(stranger.identity.peer_id) is None, "past the bound a new caller goes unrecorded"
    before = servicer.heard_from(caller.identity.peer_id)
    servicer._caller(_LocalContext(metadata))
    assert servicer.heard_from(caller.identity.peer_id) >= before, "a known caller is still updated"
