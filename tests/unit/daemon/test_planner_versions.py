"""The planner numbers its plans above everything the peers follow, stays within the version bound, and
re-publishes the same stages when only the trainers change (so no layer moves)."""

from __future__ import annotations

from swarm.compression import CodecConfig
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner
from swarm.model.gpt import ModelConfig
from swarm.peers.dht import SwarmDHT
from swarm.peers.dht_config import DHTConfig
from swarm.peers.entries import RunKeys
from swarm.peers.fields import MAX_PLAN_VERSION
from swarm.peers.records import PeerAnnouncement, PlanRecord, TrainerAnnouncement
from swarm.scheduler.plans import ModelSpec
from swarm.scheduler.sizes import model_spec

MODEL = ModelConfig(n_layers=2, hidden_dim=32, n_heads=2, seq_len_tokens=16)
SPEC = model_spec(MODEL, CodecConfig("fp32"), CodecConfig("fp32"))
A, B, C = "0a0000000000", "0b0000000000", "0c0000000000"


def peer(pid: str, plan_version: int = 0) -> PeerAnnouncement:
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0, plan_version=plan_version)


def two_stages(version: int, first: str, second: str, **extra) -> PlanRecord:
    stages = [
        {"layer_start": 0, "layer_end": 1, "peer_ids": [first]},
        {"layer_start": 1, "layer_end": 2, "peer_ids": [second]},
    ]
    return PlanRecord(version=version, document={"stages": stages, **extra}, created_at=1.0)


def swarm(me: str, records: dict[str, list], **config) -> tuple[SwarmDHT, list[tuple[int, dict]]]:
    """A SwarmDHT whose records live in `records` (no DHT process); what it publishes lands there too."""
    published: list[tuple[int, dict]] = []
    dht = SwarmDHT.__new__(SwarmDHT)
    dht.config, dht.peer_id, dht._warned, dht._keys = DHTConfig(**config), me, set(), RunKeys.of_run("run")
    dht._parse_all = lambda key, kind: list(records.get(kind, []))
    dht.links = lambda: []

    def publish_plan(version, plan):
        published.append((version, plan.to_wire()))  # what the DHT carries
        records.setdefault("plan", []).append((me, PlanRecord(version=version, document=plan, created_at=1e6)))

    dht.publish_plan = publish_plan
    return dht, published


def planner(dht, spec: ModelSpec = SPEC, *, min_peers: int = 2, n_stages: int = 2, **overrides) -> Planner:
    """A one-replica planner over `dht` that plans at once (no settling, no probe wait) at a fixed clock (100.0);
    `overrides` are further `Planner` arguments or replace those. The tests of other modules share it."""
    kwargs = dict(settle_s=0.0, probe_wait_s=0.0, clock=lambda: 100.0) | overrides
    return Planner(PlanningConfig(min_peers=min_peers, replicas=1), dht, spec, n_stages=n_stages, **kwargs)


def test_a_new_trainer_gets_the_same_stages_under_the_next_version():
    current = two_stages(4, A, B, trainer_ids=[])
    records = {"peers": [peer(A, 4), peer(B, 4)], "plan": [(A, current)]}
    dht, published = swarm(A, records)
    assert planner(dht).round() is None, "nothing changed"
    records["trainers"] = [TrainerAnnouncement("t2"), TrainerAnnouncement("t1")]
    assert planner(dht).round() is not None
    assert published == [(5, {**current.document.to_wire(), "trainer_ids": ["t1", "t2"]})]


def test_a_planner_taking_over_numbers_above_what_the_peers_follow():
    old = two_stages(5, B, C)  # published by B, no longer elected once A (lower id) announced
    dht, published = swarm(A, {"peers": [peer(A), peer(B, 5), peer(C, 5)], "plan": [(B, old)]})
    planner(dht).round()
    assert [v for v, _ in published] == [6]


def test_with_trusted_planners_announced_versions_cannot_inflate_the_next_one():
    current = two_stages(3, A, B)
    records = {"peers": [peer(A, 3), peer(B, MAX_PLAN_VERSION), peer(C)], "plan": [(A, current)]}
    dht, published = swarm(A, records, trusted_planners=(A,))
    assert planner(dht).next_version(records["peers"]) == 4


def test_at_the_version_bound_the_planner_stops_instead_of_overflowing():
    top = two_stages(MAX_PLAN_VERSION, A, B)
    dht, published = swarm(A, {"peers": [peer(A), peer(B), peer(C)], "plan": [(A, top)]})
    assert planner(dht).round() is None and published == []


def test_survivors_re_plan_below_min_peers_once_a_plan_exists():
    """--min-peers holds the first plan back; once the swarm runs, a peer leaving makes the survivors
    re-plan with whoever is left instead of waiting forever."""
    records = {"peers": [peer(A)]}
    dht, published = swarm(A, records)
    assert planner(dht).round() is None and published == [], "the first plan waits for 2 peers"
    records["plan"] = [(A, two_stages(4, A, B, trainer_ids=[]))]
    records["peers"] = [peer(A, 4)]  # B left
    assert planner(dht).round() is not None
    [(version, plan)] = published
    assert version == 5 and [s["peer_ids"] for s in plan["stages"]] == [[A]]
    assert (plan["stages"][0]["layer_start"], plan["stages"][-1]["layer_end"]) == (0, MODEL.n_layers)
