"""The published plan as one typed document: the plans the live planner makes survive `to_wire` / `from_wire`
unchanged (same dict, same JSON text), and the document answers what peers and trainers ask of a plan."""

from __future__ import annotations

import json

import pytest

from swarm.compression import CodecConfig
from swarm.peers.plan import PlanDocument, PlanStage
from swarm.peers.plan_codecs import EpilogueCodecs, LinkCodecs
from swarm.peers.records import PlanRecord
from tests.unit.daemon.test_freeze_replan import _frozen_plan
from tests.unit.daemon.test_repair import A, B, C, D, E, grid
from tests.unit.scheduler.test_bits import measured, per_link_planner


def round_trips(wire: dict) -> None:
    document = PlanDocument.from_wire(wire)
    assert document.to_wire() == wire
    assert json.dumps(document.to_wire()) == json.dumps(wire), "same keys in the same order: the same DHT bytes"
    assert PlanDocument.from_wire(json.loads(json.dumps(wire))) == document
    record = PlanRecord(3, document, 1.0)
    assert PlanRecord.from_wire(record.to_wire()) == record


def test_the_planners_plans_round_trip_through_the_wire():
    _, planner, records, links, published = per_link_planner()
    links[:] = measured(1000.0)  # the codecs are chosen again: a second plan, from the current one
    records["peers"] = [p.__class__(**{**p.__dict__, "plan_version": published[0][0]}) for p in records["peers"]]
    planner.round()
    assert len(published) == 2
    for _, wire in published:
        assert {"codecs", "epilogue_codecs", "trainer_ids", "breakdown", "step_time_s"} <= set(wire), wire
        round_trips(wire)


def test_repaired_grown_and_repacked_plans_round_trip():
    round_trips(_frozen_plan().to_wire())
    from swarm.daemon.repair import grow_plan, repair_plan

    fixed = repair_plan(grid([A, B], [C, D], unused=[E]), alive={A, C, D, E})
    round_trips(fixed.to_wire())
    round_trips(grow_plan(fixed, {A: 1.0, C: 1.0, D: 1.0, E: 1.0, "0z0000000000": 2.0}).to_wire())


def test_link_codecs_are_codec_configs_and_their_labels_are_kept_as_published():
    link = LinkCodecs("acsgd2+ch+nr", "gradq2+ef+rot+nr+cs+g1024", "why")
    assert link.forward == CodecConfig.parse("acsgd2+ch+nr") and link.backward.group_size == 1024
    assert link.to_wire() == {"forward": "acsgd2+ch+nr", "backward": "gradq2+ef+rot+nr+cs+g1024", "why": "why"}
    with pytest.raises(ValueError, match=r"plan\.codecs\[0\]\.forward"):
        PlanDocument.from_wire(
            {"stages": grid([A], [B]).stage_dicts(), "codecs": [{"forward": "x9", "backward": "fp32"}]}
        )
    with pytest.raises(ValueError, match=r"plan\.epilogue_codecs\.tied"):
        EpilogueCodecs((None,), "aqsgd2")  # sample buffers: nothing a gradient sum can use


def test_the_document_answers_where_a_peer_serves_and_whom_the_plan_names():
    plan = grid([A, B], [C], unused=[D]).replace(trainer_ids=("t1",))
    assert plan.place_of(B) == (0, 1) and plan.place_of(C) == (1, 0) and plan.place_of(D) is None
    assert plan.used_peers() == {A, B, C} and plan.named_peers() == {A, B, C, D}
    assert plan.replica_counts == (2, 1) and plan.columns() == [[A, C]] and plan.n_layers == 2
    assert plan.serves_trainer("t1") and not plan.serves_trainer("t2")
    assert plan.frozen == 0 and plan.predicted_step_s == 1.0
    assert plan.stages[0] == PlanStage(0, 1, (A, B))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"stages": (PlanStage(0, 1, (A,)), PlanStage(2, 3, (B,)))}, r"plan\.stages\[1\]\.layer_start"),
        ({"stages": (PlanStage(0, 1, (A,)), PlanStage(1, 2, (A,)))}, r"plan\.stages\[1\]\.peer_ids"),
        ({"unused_peer_ids": (A,)}, r"plan\.unused_peer_ids"),
        ({"precisions": ("fp16", "fp32")}, r"plan\.precisions"),
        ({"frozen_layers": 2}, r"plan\.frozen_layers"),
        ({"trainer_ids": ("t", "t")}, r"plan\.trainer_ids"),
        ({"relay_extra_s": -1.0}, r"plan\.relay_extra_s"),
    ],
)
def test_a_changed_plan_is_checked_whole_again(change, field):
    with pytest.raises(ValueError, match=field):
        grid([A], [B]).replace(**change)


def test_a_replaced_plan_keeps_its_keys_where_they_were_and_adds_new_ones_last():
    """As `{**plan, **changes}` ordered them before the document: a republished plan keeps its text."""
    wire = {"stages": grid([A], [B]).stage_dicts(), "trainer_ids": ["t"], "unused_peer_ids": []}
    plan = PlanDocument.from_wire(wire)
    assert list(plan.replace(trainer_ids=("u",)).to_wire()) == ["stages", "trainer_ids", "unused_peer_ids"]
    frozen = plan.replace(frozen_layers=1, relay_extra_s=0.5)  # to_wire's order among the added keys
    assert list(frozen.to_wire()) == ["stages", "trainer_ids", "unused_peer_ids", "frozen_layers", "relay_extra_s"]
    dropped = frozen.replace(frozen_layers=None).replace(frozen_layers=1)
    assert list(dropped.to_wire())[-1] == "frozen_layers", "a key dropped and set again comes last"
    fresh = PlanDocument(grid([A], [B]).stages, trainer_ids=("t",), frozen_layers=1)
    assert list(fresh.to_wire()) == ["stages", "unused_peer_ids", "frozen_layers", "trainer_ids"]
    assert fresh == PlanDocument.from_wire(json.loads(json.dumps(fresh.to_wire()))), "order is not content"


def test_what_the_planner_chooses_is_added_typed_and_checked_whole():
    plan = grid([A], [B])
    link = LinkCodecs("acsgd2+ch+nr", "gradq2+ef+rot+nr+cs+g1024", "slow link")
    chosen = plan.with_link_codecs([link]).with_epilogue(EpilogueCodecs((None, None), "bf16"))
    chosen = chosen.with_prediction(2.5, {"total_s": 2.5, "sync_s": 0.5}).with_precisions(["fp32", "bf16"])
    assert chosen.codecs == (link,) and chosen.epilogue.tied == CodecConfig.parse("bf16")
    assert chosen.step_time_s == 2.5 and chosen.breakdown == (("total_s", 2.5), ("sync_s", 0.5))
    assert chosen.precision(1, "fp32") == "bf16"
    assert PlanDocument.from_wire(json.loads(json.dumps(chosen.to_wire()))) == chosen
    with pytest.raises(ValueError, match=r"plan\.codecs"):
        plan.with_link_codecs([link, link])  # one per boundary
    with pytest.raises(ValueError, match=r"plan\.codecs\[0\]"):
        plan.with_link_codecs([{"forward": "fp32", "backward": "fp32"}])  # the wire form is from_wire's
    with pytest.raises(ValueError, match=r"plan\.epilogue_codecs\.average"):
        plan.with_epilogue(EpilogueCodecs(("bf16",)))  # one per stage
    with pytest.raises(ValueError, match=r"plan\.breakdown"):
        plan.with_prediction(1.0, {"total_s": float("nan")})
    with pytest.raises(ValueError, match=r"plan\.precisions"):
        plan.with_precisions(["fp32"])


def test_the_scheduler_reads_a_published_plan_from_the_document():
    from swarm.scheduler.plans import Plan

    _, planner, records, links, published = per_link_planner()
    document = PlanDocument.from_wire(published[0][1])
    assert Plan.from_document(document) == Plan.from_dict(document.to_wire())
    with pytest.raises(ValueError, match="format"):
        Plan.from_document(grid([A], [B]))
