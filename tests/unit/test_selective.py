"""Optimus-CC's selective compression: per-link choice of the epilogue's codecs (replica averaging, tied sync),
the plan key that carries them (validated), the averager built from it, and the cost term."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from swarm.bench.selective import rows
from swarm.compression import DEFAULT_FORWARD_CODEC, CodecConfig, make_codec
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement, PlanRecord, validate_plan
from swarm.proto import stage_pb2
from swarm.runtime.average import SUM_CODEC
from swarm.scheduler.bits import (
    AVERAGE_LADDER,
    TIED_LADDER,
    BitsPolicy,
    EpilogueFigures,
    LinkFigures,
    choose_codecs,
    choose_epilogue,
    epilogue_bytes,
    rechoose_epilogue,
)
from swarm.scheduler.plans import ModelSpec, TransformerShape
from swarm.scheduler.selective import choose_for_plan, planned_epilogue
from tests.unit.runtime.test_average import flat
from tests.unit.runtime.test_replica_host import FP32, GRADQ, Replicas

MBIT = 1e6 / 8
ELEMENTS = 25e6  # a stage of two GPT layers at hidden 1024
STEP = 0.9  # s: the step's pipeline time


def fig(mbit: float, elements: float = ELEMENTS, step: float = STEP) -> EpilogueFigures:
    return EpilogueFigures(mbit * MBIT, elements, step)


# ---- the choice ------------------------------------------------------------------------------------------------


def test_averaging_on_a_fast_link_stays_wide_and_on_a_slow_link_is_compressed():
    fast, slow = choose_epilogue([fig(100_000)], None), choose_epilogue([fig(100)], None)
    assert fast.average_labels == ("fp32",)
    assert slow.average_labels == (SUM_CODEC,) == (AVERAGE_LADDER[-1],)  # the floor: rank-8 factors
    middle = choose_epilogue([fig(10_000)], None)
    assert middle.average_labels == ("bf16",)  # 16-bit: fp32 would take 80 ms > 5% of 0.9 s, bf16 40 ms fits
    eight = choose_epilogue([fig(5_000)], None)  # bf16 80 ms does not fit, 8 bits 40 ms do: the 2-bit rung not yet
    assert eight.average_labels == ("gradq8+ef+rot+nr+cs+g1024",)
    assert fast.tied_label is None and "avg0 fp32" in fast.why


def test_each_stage_and_the_tied_sync_get_their_own_link_s_codec():
    chosen = choose_epilogue([fig(100_000), None, fig(100)], fig(100, elements=32e6))
    assert chosen.average_labels == ("fp32", None, AVERAGE_LADDER[-1])  # a one-replica stage sums nothing
    assert chosen.tied_label == TIED_LADDER[-1]  # the tied floor: rank-16 int8 factors


def test_the_tied_sync_on_a_slow_link_takes_the_rung_of_fewest_bytes_for_the_weights_shape():
    """Rank-16 factors of a [256, 128] tied weight (the default model's) are 6.3 KB against the 4-bit sum's 16 KB; of
    a [256, 32] one (the quick model's) 4.7 KB against 4 KB: the planner sizes the factors of the weight's own
    matrix (`cols`, its hidden size), not of a flat gradient's squarest view."""
    wide = EpilogueFigures(1 * MBIT, 256 * 128, 0.01, cols=128)  # a short step: no share for precision
    narrow = EpilogueFigures(1 * MBIT, 256 * 32, 0.01, cols=32)
    assert choose_epilogue([], wide).tied_label == TIED_LADDER[-1] == "lowrank16+ef+f8"
    assert choose_epilogue([], narrow).tied_label == TIED_LADDER[-2] == "gradq4+ef+rot+nr+cs+g256"
    assert epilogue_bytes(TIED_LADDER[-1], 256 * 32, 32) == (256 + 32) * 16 + 8 * 16  # int8 codes, fp32 scales


def test_boundaries_keep_today_s_rule_and_the_fill_share_narrows_only_exposed_messages():
    sizes = {label: 4e6 * CodecConfig.parse(label).wire_bits / 32 for label in ("fp32", "acsgd8+ch+nr")}.get

    def size(label: str) -> float:
        return sizes(label) or 4e6 * CodecConfig.parse(label).wire_bits / 32

    fast = LinkFigures(10_000 * MBIT, 10_000 * MBIT, 0.1)
    slow = LinkFigures(10 * MBIT, 10 * MBIT, 0.1)
    assert choose_codecs([fast, slow], size) == choose_codecs([fast, slow], size, step_s=None)
    out = choose_codecs([fast, slow], size, step_s=1.0)
    assert out[0].forward_label == "fp32" and out[1].forward_label == DEFAULT_FORWARD_CODEC  # the floor
    # at 1000 Mbit fp32 hides under 100 ms of compute, but the fill's message would add 32 ms + 32 ms to a 1 s step
    mid = LinkFigures(1000 * MBIT, 1000 * MBIT, 0.1)
    assert choose_codecs([mid], size)[0].forward_label == "fp32"
    assert choose_codecs([mid], size, step_s=1.0)[0].forward_label != "fp32"


def test_hysteresis_no_flip_flop_around_a_threshold():
    policy = BitsPolicy()
    base = ([fig(10_000)], fig(1000, 32e6))
    chosen = choose_epilogue(*base, policy)
    # probes wobble +-30% around the figures the plan was chosen from: never a re-choice
    for factor in (1.3, 0.77, 1.2, 0.8, 1.45):
        wobble = ([fig(10_000 * factor)], fig(1000 / factor, 32e6))
        assert not rechoose_epilogue(base, wobble, policy)
    moved = ([fig(10_000 / 2)], fig(1000, 32e6))
    assert rechoose_epilogue(base, moved, policy)
    assert choose_epilogue(*moved, policy).average_labels != chosen.average_labels
    assert rechoose_epilogue(None, base, policy)  # nothing chosen yet
    assert rechoose_epilogue(base, ([fig(10_000), fig(10_000)], None), policy)  # another shape


def test_policy_refuses_floors_off_the_ladders_and_shares_out_of_range():
    with pytest.raises(ValueError):
        BitsPolicy(average_floor="gradq2+ef")
    for share in (0.0, 1.0, math.nan):
        with pytest.raises(ValueError):
            BitsPolicy(epilogue_share=share)


# ---- the plan key --------------------------------------------------------------------------------------------


def peer(pid: str) -> PeerAnnouncement:
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0)


PEERS = [peer(p) for p in ("p0", "p1", "p2", "p3")]
STAGES = [
    {"layer_start": 0, "layer_end": 2, "peer_ids": ["p0", "p1"]},
    {"layer_start": 2, "layer_end": 4, "peer_ids": ["p2", "p3"]},
]


def record(epilogue) -> PlanRecord:
    return PlanRecord(version=2, document={"stages": STAGES, "epilogue_codecs": epilogue}, created_at=1.0)


def test_a_plan_with_well_formed_epilogue_codecs_passes_and_peers_read_their_own():
    good = {"average": ["fp32", "gradq8+ef+rot+nr+cs+g1024"], "tied": "bf16", "why": "x"}
    validate_plan(record(good), 4, PEERS)
    validate_plan(record({"average": [None, None]}), 4, PEERS)
    average, tied = PlanDocument.from_wire({"stages": STAGES, "epilogue_codecs": good}).epilogue_configs(1)
    assert average == CodecConfig.parse("gradq8+ef+rot+nr+cs+g1024") and tied == CodecConfig.parse("bf16")
    assert PlanDocument.from_wire({"stages": STAGES}).epilogue_configs(0) == (None, None)  # none: the backward codec


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "fp32",
        {"tied": "fp32"},  # no average
        {"average": ["fp32"]},  # one per stage
        {"average": ["fp32", "fp32", "fp32"]},
        {"average": ["fp32", "nosuchcodec9"]},
        {"average": ["fp32", "acsgd2+ch"]},  # sample buffers: a gradient sum cannot use them
        {"average": ["fp32", float("nan")]},
        {"average": ["fp32", 8]},
        {"average": ["fp32", "x" * 65]},  # oversized label
        {"average": ["fp32", "fp32"], "tied": "aqsgd4"},
        {"average": ["fp32", "fp32"], "tied": 4},
        {"average": ["fp32", "fp32"], "why": "x" * 401},
        {"average": ["fp32", "fp32"], "extra": 1},
    ],
)
def test_a_plan_with_malformed_epilogue_codecs_is_refused(bad):
    with pytest.raises(ValueError, match="epilogue_codecs|JSON"):  # NaN: no JSON, refused with the record
        validate_plan(record(bad), 4, PEERS)


# ---- the averager built from the plan ------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["bf16", "gradq8+ef+rot+nr+cs+g1024", SUM_CODEC, "fp32"])
def test_replicas_summing_with_the_plan_s_codec_hold_identical_weights_after_step(label):
    pipe = Replicas(2, backward=GRADQ)  # the flags' codec: 4-bit gradq; the plan overrides it
    plan = {"stages": [{"layer_start": 0, "layer_end": 2, "peer_ids": pipe.peers}], "epilogue_codecs": {}}
    plan["epilogue_codecs"] = {"average": [label], "tied": None}
    for host in pipe.hosts:
        host.averager.set_codecs(*PlanDocument.from_wire(plan).epilogue_configs(0))
    pipe.split_step(0)
    own = [flat(pipe, r) for r in range(2)]
    replies = pipe.reduce(0)
    assert torch.equal(flat(pipe, 0), flat(pipe, 1))
    if label == "fp32":
        assert torch.equal(flat(pipe, 0), own[0] + own[1])
    averager = pipe.hosts[0].averager
    config = averager._config(0, 0)  # a factored codec's bytes are its layout's payload, not a bit width's
    bits = 8 * make_codec(config).payload_nbytes(averager.numel) / averager.numel
    assert replies[0].wire_bytes < replies[0].fp32_wire_bytes * (bits / 32) * 1.2 + 4096
    for r in range(2):
        pipe.step(r, 0)
    digests = {pipe.client(r).Status(stage_pb2.Empty()).weights_digest for r in range(2)}
    assert len(digests) == 1
    residuals = [h.averager.residual for h in pipe.hosts]
    if CodecConfig.parse(label).error_feedback:  # a lossy gradient codec keeps its error feedback
        assert all(res is not None and float(res.abs().sum()) > 0 for res in residuals)
    else:
        assert all(res is None for res in residuals)


def test_a_codec_switch_drops_the_old_codec_s_residual_and_a_same_plan_keeps_it():
    pipe = Replicas(2, backward=GRADQ)
    pipe.split_step(0)
    pipe.reduce(0)
    for r in range(2):
        pipe.step(r, 0)
    host = pipe.hosts[0]
    assert host.averager.residual is not None
    host.averager.set_codecs(None, None)  # the same (no plan key): nothing changes
    assert host.averager.residual is not None
    host.averager.set_codecs(CodecConfig.parse("bf16"), None)
    assert host.averager.residual is None


def test_without_a_plan_key_the_averager_sums_with_the_backward_codec_as_before():
    pipe = Replicas(2, backward=FP32)
    pipe.split_step(0)
    own = [flat(pipe, r) for r in range(2)]
    pipe.reduce(0)
    assert torch.equal(flat(pipe, 0), own[0] + own[1])


# ---- the planner's figures and the cost term ------------------------------------------------------------------


def test_the_planner_s_epilogue_validates_and_its_predicted_step_uses_the_chosen_bytes():
    from swarm.bench.selective import swarm_at

    spec = ModelSpec.transformer(TransformerShape(layers=4, hidden=256, seq_len=64, micro_batch_size=4))
    spec = ModelSpec(**{**spec.__dict__, "tied_bytes": 32000 * 256 / 2, "full_duplex": True})
    plan_input = swarm_at(10.0, None, 2, 2, 2e12)
    stages = [
        {"layer_start": 0, "layer_end": 2, "peer_ids": ["p0", "p1"]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": ["p2", "p3"]},
    ]
    added = planned_epilogue(stages, plan_input, spec)
    assert added.codecs.average_labels == (AVERAGE_LADDER[-1],) * 2  # 10 Mbit/s: compressed
    peers = [peer(f"p{i}") for i in range(4)]
    plan = PlanDocument.from_wire({"stages": stages}).with_epilogue(added.codecs)
    plan = plan.with_prediction(added.breakdown.total_s, dataclasses.asdict(added.breakdown))
    validate_plan(PlanRecord(version=2, document=plan, created_at=1.0), 4, peers)
    _, _, fp32 = choose_for_plan(stages, swarm_at(1e6, None, 2, 2, 2e12), spec)
    assert added.breakdown.total_s > fp32.total_s  # slower links, slower step
    assert added.breakdown.sync_s > 0 and added.breakdown.tied_s > 0
    uneven = [{"layer_start": 0, "layer_end": 4, "peer_ids": ["p0", "p1"]}, {**stages[1], "peer_ids": ["p2"]}]
    assert planned_epilogue(uneven, plan_input, spec) is None  # not a layout the cost model scores


def test_with_measured_codec_speed_a_fast_link_plans_wide_sums_and_predicts_their_encoding():
    from swarm.bench.selective import swarm_at
    from swarm.scheduler.bits import CodecSpeed
    from swarm.scheduler.selective import epilogue_figures, selective_breakdown

    spec = ModelSpec.transformer(TransformerShape(layers=4, hidden=256, seq_len=64, micro_batch_size=4))
    spec = ModelSpec(**{**spec.__dict__, "tied_bytes": 32000 * 256 / 2, "full_duplex": True})
    fast = swarm_at(560.0, None, 2, 2, 2e12)  # ~70 MB/s: what the peers' probes read on this machine's loopback
    wide = ("fp32", "bf16")
    quantized_dear = CodecSpeed(tuple((label, 1e-9 if label in wide else 2e-7, 1e-9 if label in wide else 1e-7)
                                      for label in (*AVERAGE_LADDER, *TIED_LADDER)))  # fmt: skip
    by_bytes = planned_epilogue(STAGES, fast, spec)
    timed = planned_epilogue(STAGES, fast, spec, speed=quantized_dear)
    assert set(timed.codecs.average_labels) <= set(wide) and timed.codecs.tied_label in wide
    assert by_bytes.codecs.tied_label not in wide  # on bytes alone the tied sync stays quantized
    # the prediction counts each exchange's encoding: the floor's sums, timed, are slower than predicted on bytes
    figures = epilogue_figures(STAGES, fast, spec, quantized_dear)
    floors = selective_breakdown(STAGES, fast, spec, by_bytes.codecs)
    assert selective_breakdown(STAGES, fast, spec, by_bytes.codecs, figures).total_s > floors.total_s
    assert timed.breakdown.total_s < selective_breakdown(STAGES, fast, spec, by_bytes.codecs, figures).total_s


def test_selective_predicted_step_is_never_above_fp32_and_at_most_two_shares_above_all_compressed():
    share = BitsPolicy().epilogue_share
    for row in rows(shape=TransformerShape(layers=4, hidden=256, seq_len=64, micro_batch_size=4, micro_batches=4)):
        assert row["selective_s"] <= row["fp32_s"] + 1e-9, row
        assert row["selective_s"] <= row["compressed_s"] * (1 + 2 * share) + 1e-9, row
    slow = rows((1.0, 10.0))
    assert all(r["selective_s"] == r["compressed_s"] for r in slow)  # slow links: everything at the floors
    fast = rows((10_000.0,))[0]
    assert fast["boundary"] == "fp32/fp32" and "fp32" not in fast["tied"]
    assert fast["selective_s"] < fast["fp32_s"]


# ---- the live planner and the peer -----------------------------------------------------------------------------


def test_the_planner_publishes_epilogue_codecs_and_rechooses_them_only_past_the_hysteresis():
    from tests.unit.scheduler.test_bits import A, B, measured, per_link_planner

    model, planner, records, links, published = per_link_planner()
    ((version, first),) = published
    validate_plan(PlanRecord(version, first, 1.0), model.n_layers, records["peers"])
    assert first["epilogue_codecs"]["tied"] == TIED_LADDER[-1]  # 1 Mbit/s: the tied sync at its floor
    assert first["epilogue_codecs"]["average"] == [None, None]  # no replicas: nothing else summed
    assert first["breakdown"]["tied_s"] > 0 and first["step_time_s"] == first["breakdown"]["total_s"]
    records["peers"] = [PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, 40.0, plan_version=version)
                        for pid in (A, B)]  # fmt: skip
    links[:] = measured(1.3)
    assert planner.round() is None and len(published) == 1, "a small move keeps the codecs"
    links[:] = measured(100_000.0)
    assert planner.round() is not None
    fast = published[-1][1]
    assert fast["stages"] == first["stages"]
    assert TIED_LADDER.index(fast["epilogue_codecs"]["tied"]) < TIED_LADDER.index(TIED_LADDER[-1])
    assert fast["step_time_s"] < first["step_time_s"]


@pytest.mark.parametrize("policy", ["fixed", "selective"])
def test_the_selective_policy_chooses_the_epilogue_s_codecs_and_leaves_every_link_at_the_flags_codecs(policy):
    # --codec-policy selective: Optimus-CC's selective stage compression alone; fixed: the planner chooses nothing
    from tests.unit.scheduler.test_bits import A, B, measured, per_link_planner

    _, planner, records, links, published = per_link_planner(codec_bytes=None, epilogue=policy == "selective")
    ((version, first),) = published
    assert "codecs" not in first or not first["codecs"], "the boundaries keep --fw-codec/--bw-codec"
    if policy == "fixed":
        assert "epilogue_codecs" not in first or first["epilogue_codecs"] is None
    else:
        assert first["epilogue_codecs"]["tied"] == TIED_LADDER[-1]  # 1 Mbit/s: the tied sync at its floor
    records["peers"] = [PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, 40.0, plan_version=version)
                        for pid in (A, B)]  # fmt: skip
    links[:] = measured(100_000.0)
    republished = planner.round()
    if policy == "fixed":
        assert republished is None and len(published) == 1, "fixed codecs: a faster link changes nothing"
        return
    fast = published[-1][1]
    assert republished is not None and fast["stages"] == first["stages"]
    assert not fast.get("codecs"), "a link's move re-chooses the epilogue only"
    assert TIED_LADDER.index(fast["epilogue_codecs"]["tied"]) < TIED_LADDER.index(TIED_LADDER[-1])


def test_a_peer_builds_its_averager_from_the_plan_s_epilogue_codecs():

    from swarm.runtime.host import StageRole
    from tests.unit.scheduler.test_bits import bare_daemon

    daemon = bare_daemon()
    epilogue = {"average": ["fp32", "bf16"], "tied": "gradq8+ef+rot+nr+cs+g1024"}
    plan = PlanDocument.from_wire({"stages": STAGES, "epilogue_codecs": epilogue})
    host = daemon._make_host(StageRole(1, 2, 2, 4, 3), plan)
    assert host.averager.codecs == {False: CodecConfig.parse("bf16"), True: CodecConfig.parse(TIED_LADDER[2])}
    assert host.averager._config(0, 0).name == "bf16"  # not the flags' gradq4
    assert host.averager._config(0, 0, tied=True).bits == 8
    bare = daemon._make_host(StageRole(1, 2, 2, 4, 3), PlanDocument.from_wire({"stages": STAGES}))
    assert bare.averager._config(0, 0).name == "mlowrank"  # no epilogue codecs: SUM_CODEC behind compressed links
    assert daemon._make_host(StageRole(1, 2, 2, 4, 3)).averager._config(0, 0).name == "mlowrank"  # no plan: the same


# ---- the convergence experiment's setting ----------------------------------------------------------------------


def test_convergence_sel_settings_train_with_the_planner_s_choice(tmp_path, capsys):
    import json

    from swarm.cli import main
    from swarm.experiments.convergence import DEFAULT_TARGET_SETTING

    # the quick model's tied weight is [256, 32]: at 1 Mbit/s its 4-bit sum (4 KB) is fewer bytes than rank-16
    # factors (4.7 KB), so the planner sums it at 4 bits (`@t4`), the links at their floors
    floor_setting = f"{DEFAULT_TARGET_SETTING}@t4"
    settings = f"fp32/fp32,{floor_setting},sel:1,sel:50,sel:100000"
    argv = ["experiment", "convergence", "--quick", "--json", "--no-progress", "--out", str(tmp_path / "run")]
    assert main([*argv, "--settings", settings]) == 0
    rows = {r["setting"]: r for r in json.loads(capsys.readouterr().out)}
    fp32, floor = rows["fp32/fp32"], rows[floor_setting]
    slow, mid, fast = rows["sel:1"], rows["sel:50"], rows["sel:100000"]

    # 1 Mbit/s: everything at the floors, the all-compressed run to the byte (control bytes aside: their varints
    # carry timings); 100 Gbit/s: fp32's run
    def data(row: dict) -> int:
        return row["wire_bytes"] + row["sync_bytes"]

    assert data(slow) == data(floor) and slow["final_eval_loss"] == floor["final_eval_loss"]
    assert fast["forward"] == "fp32" and fast["final_eval_loss"] == fp32["final_eval_loss"]
    assert "tied fp32" in fast["epilogue"] and "tied gradq4" in slow["epilogue"]
    assert data(floor) < data(mid) < data(fp32)


def test_convergence_at_sel_rate_keeps_the_setting_s_links_and_plans_only_the_sums(tmp_path, capsys):
    # FW/BW@selRATE: what --codec-policy selective plans (links fixed, sums chosen with this machine's codec speed)
    import json

    from swarm.cli import main
    from swarm.experiments.convergence import DEFAULT_TARGET_SETTING as D

    argv = ["experiment", "convergence", "--quick", "--json", "--no-progress", "--out", str(tmp_path / "run")]
    assert main([*argv, "--replicas", "2", "--settings", f"fp32/fp32,{D},{D}@sel1,{D}@sel100000"]) == 0
    rows = {r["setting"]: r for r in json.loads(capsys.readouterr().out)}
    floor, slow, fast = rows[D], rows[f"{D}@sel1"], rows[f"{D}@sel100000"]
    assert (
        (slow["forward"], slow["backward"])
        == (fast["forward"], fast["backward"])
        == (floor["forward"], floor["backward"])
    )
    # at 1 Mbit/s every sum at its floor, the fixed policy's codecs (their rounding seeds are the plan's)
    assert f"avg0 {SUM_CODEC}" in slow["epilogue"] and f"tied {TIED_LADDER[-2]}" in slow["epilogue"]  # [256, 32]
    assert "avg0 gradq2" not in fast["epilogue"] and fast["final_eval_loss"] != slow["final_eval_loss"]
    assert fast["total_wire_bytes"] > floor["total_wire_bytes"]  # wider sums


@pytest.mark.parametrize("text", ["@sel", "@sel0", "@selnan", "@sel-1", "@selx", "@selinf"])
def test_malformed_at_sel_rates_are_refused(text):
    from swarm.experiments.selective import split_selective

    with pytest.raises(ValueError, match="@selRATE"):
        split_selective(f"fp32/fp32{text}")
    assert split_selective("fp32/fp32@sel2.5") == ("fp32/fp32", 2.5) and split_selective("a/b") == ("a/b", None)


@pytest.mark.parametrize("text", ["sel:", "sel:0", "sel:nan", "sel:-5", "sel:1+2", "sel:10:0", "sel:10:inf", "sel:x"])
def test_malformed_sel_settings_are_refused(text):
    from swarm.experiments.selective import selective_plan
    from swarm.model.gpt import ModelConfig

    with pytest.raises(ValueError):
        selective_plan(text, ModelConfig(n_layers=2), 2, 4, 2)
    with pytest.raises(ValueError, match="2\\+ stages"):
        selective_plan("sel:10", ModelConfig(n_layers=2), 1, 4, 2)


def test_a_sel_setting_gives_each_boundary_its_own_codecs_in_process():
    from swarm.experiments.selective import apply_selective, selective_plan
    from swarm.model.gpt import ModelConfig
    from swarm.runtime.inprocess import LocalPipeline

    model = ModelConfig(n_layers=3, hidden_dim=32, n_heads=2, seq_len_tokens=32)
    plan = selective_plan("sel:100000+1", model, 3, 4, 2)
    assert plan.codecs[0].forward_label == "fp32" and plan.codecs[1].forward_label == DEFAULT_FORWARD_CODEC
    pipe = LocalPipeline(model, 3, FP32, FP32)
    try:
        apply_selective(pipe, plan, {}, {})
        middle = pipe.hosts[1].links
        assert middle.forward_recv.config.name == "fp32"  # from stage 0, over the fast boundary
        assert (
            middle.backward_recv.config.name == "gradq" and middle.backward_recv.config.bits == 2
        )  # from stage 2, slow
        assert pipe.hosts[2].averager.codecs[True] is not None  # the tied sync's codec, end stages only
        assert pipe.hosts[1].averager.codecs == {False: None, True: None}
    finally:
        pipe.close()


def test_a_sel_setting_with_replicas_keeps_the_sums_the_epilogue_waits_on_compressed_and_widens_the_hidden_ones():
    # the convergence experiment's --replicas R: each stage has R planned peers, whose sums the epilogue chooses
    from swarm.experiments.selective import selective_plan
    from swarm.options import DEFAULT_MODEL

    one = selective_plan("sel:1", DEFAULT_MODEL, 2, 4, 4)
    assert [s.peer_ids for s in one.stages] == [("s0",), ("s1",)], "one replica: the plan as before"
    slow = selective_plan("sel:1", DEFAULT_MODEL, 2, 4, 4, replicas=2)
    fast = selective_plan("sel:1000", DEFAULT_MODEL, 2, 4, 4, replicas=2)
    assert [len(s.peer_ids) for s in slow.stages] == [2, 2] and slow.stages[0].peer_ids == ("s0r0", "s0r1")
    # at 1 Mbit/s the replicas' sums set the epilogue's length: they stay at the floor; at 1000 they are hidden: widened
    assert all(label == SUM_CODEC for label in slow.epilogue.average_labels), slow.epilogue.average_labels
    assert all(label in ("bf16", "fp32") for label in fast.epilogue.average_labels), fast.epilogue.average_labels
    labels = lambda plan: [(c.forward_label, c.backward_label) for c in plan.codecs]  # noqa: E731
    assert labels(slow) == labels(one), "the boundaries' codecs do not depend on the replicas at this rate"
    with pytest.raises(ValueError, match="replicas"):
        selective_plan("sel:1", DEFAULT_MODEL, 2, 4, 4, replicas=0)


def test_a_move_past_the_hysteresis_to_the_same_codecs_publishes_nothing():
    # regression: the planner compared the codecs with their `why` texts, whose milliseconds change with every
    # measurement, so a move that chose the same codecs republished the plan (a new version for nothing)
    from tests.unit.scheduler.test_bits import A, B, measured, per_link_planner

    _, planner, records, links, published = per_link_planner()
    ((version, first),) = published
    records["peers"] = [PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, 40.0, plan_version=version)
                        for pid in (A, B)]  # fmt: skip
    links[:] = measured(0.25)  # 4x slower: past the hysteresis, still every codec at its floor
    assert planner.round() is None and len(published) == 1
