"""The live planner's pure parts: the plan input built from DHT records, roles and routes from a plan."""

from __future__ import annotations

import pytest

from swarm.compression import CodecConfig
from swarm.daemon.planning import DEFAULT_BYTES_PER_S, live_search, role_in_plan, swarm_plan_input
from swarm.model.gpt import ModelConfig
from swarm.peers.records import LinkMeasurement, PeerAnnouncement, PlanRecord
from swarm.peers.routes import PlanRoutes
from swarm.scheduler import plan
from swarm.scheduler.sizes import model_spec

SPEC = model_spec(ModelConfig(), CodecConfig("aqsgd", bits=2), CodecConfig("gradq", bits=4))


def peer(i: int, speed: float = 10.0, **kw) -> PeerAnnouncement:
    return PeerAnnouncement(
        peer_id=f"p{i}", address=f"127.0.0.1:{5000 + i}", device="cpu", memory_bytes=1 << 34,
        compute_layers_per_s=speed, **kw,
    )  # fmt: skip


def link(a: int, b: int, mbit: float, rtt_ms: float = 2.0) -> LinkMeasurement:
    return LinkMeasurement(f"p{a}", f"p{b}", rtt_s=rtt_ms / 1e3, bytes_per_s=mbit * 1e6 / 8, measured_at=1.0)


def test_links_take_their_own_figure_then_the_reverse_then_the_median():
    got = swarm_plan_input([peer(2), peer(0), peer(1)], [link(0, 1, 80), link(1, 0, 40), link(2, 0, 200)], SPEC)
    pi = got.plan_input
    assert [p.peer_id for p in pi.peers] == ["p0", "p1", "p2"]
    bw = pi.bandwidth_bytes_per_s * 8 / 1e6
    assert bw[0, 1] == pytest.approx(80) and bw[1, 0] == pytest.approx(40)
    assert bw[0, 2] == pytest.approx(200), "the reverse direction's figure stands in"
    assert bw[1, 2] == pytest.approx(80) and bw[2, 1] == pytest.approx(80), "unprobed: the median of known links"
    assert pi.delay_s[0, 1] == pytest.approx(1e-3), "one-way delay is half the round trip"
    assert (got.measured_links, got.filled_links) == (3, 2)
    speeds = pi.speeds_flops_per_s
    assert speeds[0] == pytest.approx(10 * SPEC.flops_per_layer)


def test_a_links_round_trip_is_the_smaller_of_its_two_ends_measurements():
    # s56's 1 Mbit/s namespace cell: one end's probe was answered behind the other end's probe bytes (513 ms), the
    # other's not (1.1 ms); the plan priced 257 ms of latency a step and predicted 1.35 s for a 0.71 s step
    pi = swarm_plan_input([peer(0), peer(1)], [link(0, 1, 1, rtt_ms=1.1), link(1, 0, 1, rtt_ms=513.3)], SPEC).plan_input
    assert pi.delay_s[0, 1] == pytest.approx(0.55e-3) and pi.delay_s[1, 0] == pytest.approx(0.55e-3)
    assert pi.bandwidth_bytes_per_s[1, 0] == pytest.approx(125e3), "each direction keeps its own rate"
    one = swarm_plan_input([peer(0), peer(1)], [link(1, 0, 1, rtt_ms=40)], SPEC).plan_input
    assert one.delay_s[0, 1] == pytest.approx(20e-3) == one.delay_s[1, 0], "one end measured: its figure both ways"


def test_an_unmeasured_direction_takes_the_reverse_directions_bucket_with_its_rate():
    # the throttled experiment's 1 Mbit/s default cell (h/cal): one peer probed before the first plan, the other
    # only later; the unprobed direction took the reverse's rate and no bucket, so its messages and the 14 kB tied
    # gradient were priced at the rate: 0.338 s predicted for 0.29 s measured
    measured = LinkMeasurement("p0", "p1", rtt_s=1e-3, bytes_per_s=125e3, measured_at=1.0, burst_bytes=65536.0)
    pi = swarm_plan_input([peer(0), peer(1), peer(2)], [measured], SPEC).plan_input
    assert pi.burst_bytes[0, 1] == pi.burst_bytes[1, 0] == 65536.0
    assert pi.burst_bytes[1, 2] == 65536.0, "unprobed both ways: the median of the measured buckets"
    assert pi.burst_bytes[0, 0] == 0.0
    assert swarm_plan_input([peer(0), peer(1)], [], SPEC).plan_input.burst_bytes[0, 1] == 0.0


def test_a_swarm_nobody_has_probed_is_planned_at_a_typical_rate():
    got = swarm_plan_input([peer(0), peer(1)], [], SPEC)
    assert got.plan_input.bandwidth_bytes_per_s[0, 1] == DEFAULT_BYTES_PER_S and got.filled_links == 2


def test_live_plans_have_one_replica_and_the_asked_stages_with_faster_peers_holding_more_layers():
    peers = [peer(0, 10.0), peer(1, 10.0), peer(2, 40.0)]
    links = [link(a, b, 100) for a in range(3) for b in range(3) if a != b]
    pi = swarm_plan_input(peers, links, SPEC).plan_input
    made = plan(pi, SPEC, live_search(2), version=3)
    assert made.n_stages == 2 and made.n_replicas == 1 and made.version == 3
    sizes = {s.peer_ids[0]: s.layer_end - s.layer_start for s in made.stages}
    assert "p2" in sizes and sizes["p2"] > min(sizes.values()), sizes
    assert made.stages[0].layer_start == 0 and made.stages[-1].layer_end == SPEC.layers
    assert all(a.layer_end == b.layer_start for a, b in zip(made.stages, made.stages[1:], strict=False))


def test_roles_and_routes_come_from_the_plan_once_every_peer_follows_it():
    record = PlanRecord(
        version=4,
        document={
            "stages": [
                {"layer_start": 0, "layer_end": 3, "peer_ids": ["p2"]},
                {"layer_start": 3, "layer_end": 4, "peer_ids": ["p0"]},
            ],
            "unused_peer_ids": ["p1"],
        },
        created_at=1.0,
    )
    role = role_in_plan(record, "p0")
    assert (role.stage, role.n_stages, role.layer_start, role.layer_end, role.plan_version) == (1, 2, 3, 4, 4)
    assert role_in_plan(record, "p1") is None, "left out: standby"
    old = [
        peer(2, stage=0, layer_start=0, layer_end=2, plan_version=3),
        peer(0, stage=1, layer_start=3, layer_end=4, plan_version=4),
    ]
    assert record.document.route_of(old, record.version) is None, "p2 still follows plan 3"
    new = [peer(2, stage=0, layer_start=0, layer_end=3, plan_version=4), old[1]]
    assert record.document.route_of(new, 4) == PlanRoutes(
        ["127.0.0.1:5002", "127.0.0.1:5000"], ["p2", "p0"], plan_version=4
    )


def test_waiting_for_a_pipeline_stops_as_soon_as_its_check_raises():
    """A local swarm's dead peer ends the wait at the next poll, not after the whole timeout (the check ran only
    when the status line changed, so a peer that died at start-up cost the nat experiment 120 s)."""
    from types import SimpleNamespace

    from swarm.train.follower import discover_route

    dht = SimpleNamespace(peers=lambda: [], get_plan=lambda n_layers, peers: None)
    polls = []

    def check():
        polls.append(1)
        if len(polls) == 3:  # the line never changes after the first poll
            raise RuntimeError("peer0 exited with code 1")

    with pytest.raises(RuntimeError, match="peer0 exited"):
        discover_route(dht, 2, 60.0, lambda line: None, check=check)
    assert len(polls) == 3


def test_a_trainer_waits_for_a_plan_that_names_it():
    from types import SimpleNamespace

    from swarm.train.follower import discover_route

    stages = [
        {"layer_start": 0, "layer_end": 2, "peer_ids": ["p0"]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": ["p1"]},
    ]
    peers = [peer(0, stage=0, layer_start=0, layer_end=2, plan_version=3),
             peer(1, stage=1, layer_start=2, layer_end=4, plan_version=3)]  # fmt: skip
    unnamed = PlanRecord(version=3, document={"stages": stages, "trainer_ids": ["other"]}, created_at=1.0)
    dht = SimpleNamespace(peers=lambda: peers, get_plan=lambda n_layers, peers: unnamed)
    lines: list[str] = []
    with pytest.raises(TimeoutError, match="names trainer me"):
        discover_route(dht, None, 0.0, lines.append, trainer_id="me", n_layers=4)
    named = PlanRecord(version=3, document={"stages": stages, "trainer_ids": ["me"]}, created_at=1.0)
    dht.get_plan = lambda n_layers, peers: named
    route = discover_route(dht, None, 0.0, lines.append, trainer_id="me", n_layers=4)
    assert route.peer_ids == ["p0", "p1"] and route.plan_version == 3
    assert (
        discover_route(SimpleNamespace(peers=lambda: peers, get_plan=lambda n, peers: unnamed), None, 0.0).plan_version
        == 3
    )
