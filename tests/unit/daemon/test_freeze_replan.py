"""Every plan the live planner publishes after a freeze carries the frozen prefix: a repair and a growth keep it
and the repacked layout, and a full re-search (a stage lost with no standby and no spare replica) carries it and
repacks its searched layout for it (swarm.daemon.repack.with_frozen)."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.compression import CodecConfig
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner
from swarm.daemon.repack import repack_plan, with_frozen
from swarm.model.gpt import ModelConfig
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement, PlanRecord, validate_plan
from swarm.scheduler.sizes import model_spec
from tests.unit.daemon.test_planner_versions import swarm

MODEL = ModelConfig(n_layers=4, hidden_dim=32, n_heads=2, seq_len_tokens=16)
SPEC = model_spec(MODEL, CodecConfig("fp32"), CodecConfig("fp32"))
A, B, C, D, E = (f"0{c}0000000000" for c in "abcde")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _peer(pid: str, version: int = 0) -> PeerAnnouncement:
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0, plan_version=version)


def _frozen_plan() -> PlanDocument:
    """Four one-layer stages repacked for 3 frozen layers: 2 stages x 2 replicas."""
    stages = [{"layer_start": i, "layer_end": i + 1, "peer_ids": [p]} for i, p in enumerate((A, B, C, D))]
    plan = repack_plan(PlanDocument.from_wire({"stages": stages, "unused_peer_ids": [], "trainer_ids": []}), 3)
    assert [list(s.peer_ids) for s in plan.stages] == [[A, B], [C, D]] and plan.frozen_layers == 3
    return plan


def _planner(records: dict, clock: Clock):
    dht, published = swarm(A, records)
    return Planner(
        PlanningConfig(min_peers=2, replicas=1), dht, SPEC, 4, settle_s=5.0, probe_wait_s=0.0, clock=clock
    ), published


def test_a_repair_and_a_growth_keep_the_frozen_prefix_and_the_repacked_layout():
    plan = _frozen_plan()
    peers = [_peer(p, 5) for p in (A, B, C, D)]
    records = {"peers": peers, "plan": [(A, PlanRecord(version=5, document=plan, created_at=1.0))]}
    planner, published = _planner(records, Clock())
    assert planner.round() is None, "nothing changed"
    records["peers"] = [p for p in peers if p.peer_id != D]  # D died: stage 1 keeps C
    planner.round()
    records["peers"] = [*records["peers"], _peer(E)]  # E joins: one more replica
    planner.round()
    assert [v for v, _ in published] == [6, 7]
    for _, got in published:
        assert got["frozen_layers"] == 3
        assert [(s["layer_start"], s["layer_end"]) for s in got["stages"]] == [(0, 3), (3, 4)]


def test_a_full_re_search_carries_the_frozen_prefix():
    plan = _frozen_plan()
    peers = [_peer(p, 5) for p in (A, B, C, D)]
    records = {"peers": peers, "plan": [(A, PlanRecord(version=5, document=plan, created_at=1.0))]}
    clock = Clock()
    planner, published = _planner(records, clock)
    assert planner.round() is None, "nothing changed"
    # C and D die: stage 1 lost every replica, stage 0 has two (B moves there: a re-assignment, no search)
    records["peers"] = [_peer(A, 5), _peer(B, 5)]
    planner.round()
    assert published[-1][1]["frozen_layers"] == 3
    # B dies too: stage 1 has nobody and stage 0 no spare replica: only a full search helps
    records["peers"] = [_peer(A, 6)]
    assert planner.round() is None, "a full search waits for the set to settle"
    clock.t += 6
    planner.round()
    version, got = published[-1]
    assert version == 7 and got["frozen_layers"] == 3, "the searched plan kept the frozen prefix"
    assert [(s["layer_start"], s["layer_end"], s["peer_ids"]) for s in got["stages"]] == [(0, 4, [A])]
    validate_plan(PlanRecord(version=version, document=got, created_at=1.0), 4, records["peers"])


def test_with_frozen_leaves_an_unfrozen_plan_alone_and_drops_the_searched_layouts_per_stage_keys():
    stages = [{"layer_start": i, "layer_end": i + 1, "peer_ids": [p]} for i, p in enumerate((A, B, C, D))]
    codecs = [{"forward": "fp32", "backward": "fp32"}] * 3
    searched = PlanDocument.from_wire(
        {"stages": stages, "precisions": ["fp32"] * 4, "step_time_s": 1.0, "codecs": codecs}
    )

    def previous(n_layers: int, **parts) -> PlanDocument:
        return PlanDocument.from_wire({"stages": [{"layer_start": 0, "layer_end": n_layers, "peer_ids": [E]}], **parts})

    assert with_frozen(searched, None) is searched
    assert with_frozen(searched, previous(4)) is searched
    assert with_frozen(searched, previous(8, frozen_layers=4)) is searched, "a prefix past the model is not carried"
    got = with_frozen(searched, previous(4, frozen_layers=3))
    assert got.frozen_layers == 3 and got.n_stages == 2
    assert got.precisions is None and got.step_time_s is None and got.codecs is None
    assert searched.stage_dicts() == stages and searched.frozen_layers is None, "the searched plan is not changed"


def test_a_held_prefix_goes_out_with_a_repair():
    """The stages froze 1 layer, which moves none (held by the repack watch, no version of its own); when a
    stage dies, the repair that puts a standby in its place carries the prefix, so the standby's host starts
    frozen."""
    from swarm.daemon.repack import RepackWatch

    stages = [{"layer_start": i, "layer_end": i + 1, "peer_ids": [p]} for i, p in enumerate((A, B, C, D))]
    plan = PlanDocument.from_wire({"stages": stages, "unused_peer_ids": [E], "trainer_ids": []})
    peers = [_peer(p, 5) for p in (A, B, C, D, E)]
    records = {"peers": peers, "plan": [(A, PlanRecord(version=5, document=plan, created_at=1.0))]}
    dht, published = swarm(A, records)
    stage_of = {p: i for i, p in enumerate((A, B, C, D))}
    reply = lambda pid: SimpleNamespace(  # noqa: E731
        peer_id=pid, stage=stage_of[pid], plan_version=5, metrics={"swarm_frozen_layers": 1.0}
    )
    watch = RepackWatch(reply, every_s=0.0)
    planner = Planner(
        PlanningConfig(min_peers=2, replicas=1), dht, SPEC, 4, settle_s=5.0, probe_wait_s=0.0, clock=Clock(),
        repack=watch,
    )  # fmt: skip
    assert planner.round() is None and not published and watch.frozen == 1, "held, not published"
    records["peers"] = [p for p in peers if p.peer_id != D]  # D died: E takes its place
    planner.round()
    assert len(published) == 1
    version, got = published[0]
    assert version == 6 and got["frozen_layers"] == 1
    assert [s["peer_ids"] for s in got["stages"]] == [[A], [B], [C], [E]]
