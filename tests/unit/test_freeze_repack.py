"""The live side of the elastic repack: stages report their frozen prefix, the planner repacks once every plan
stage agrees (swarm.daemon.repack.RepackWatch), hosts of a frozen plan start frozen, and `swarm train --freeze`
keeps one FreezePolicy across re-plans (swarm.train.freezing)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from swarm.compression import CodecConfig
from swarm.daemon.repack import RepackWatch, frozen_figure, repack_plan
from swarm.model.gpt import ModelConfig
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement, PlanRecord, validate_plan
from swarm.runtime.freeze import FreezePolicy, apply_frozen
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import OptimConfig, StageConfig
from swarm.train import freezing
from swarm.train.freezing import FreezeConfig, add_freeze_arguments, driver_factory, freeze_config

GPT = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=1)
FP32 = CodecConfig(name="fp32")
IDS = "abcd"


def _record(version: int = 3, **extra) -> PlanRecord:
    stages = [{"layer_start": i, "layer_end": i + 1, "peer_ids": [p]} for i, p in enumerate(IDS)]
    return PlanRecord(version=version, document={"stages": stages, **extra}, created_at=1.0)


def _reply(pid: str, stage: int, version: int = 3, frozen=3.0, **metrics):
    figures = {} if frozen is None else {"swarm_frozen_layers": frozen}
    return SimpleNamespace(peer_id=pid, stage=stage, plan_version=version, metrics={**figures, **metrics})


def _replies(**override) -> dict:
    out = {p: _reply(p, i) for i, p in enumerate(IDS)}
    out.update(override)
    return out


def _watch(replies: dict) -> RepackWatch:
    return RepackWatch(lambda pid: replies.get(pid), every_s=0.0)


# ---- what a stage reports ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [(0.0, 0), (3.0, 3), (None, None), (4.0, None), (-1.0, None), (1.5, None), (math.nan, None), (math.inf, None)],
)
def test_a_stages_frozen_figure_is_read_only_when_whole_and_in_range(value, expected):
    metrics = {} if value is None else {"swarm_frozen_layers": value}
    assert frozen_figure(metrics, 4) == expected
    assert frozen_figure({"swarm_frozen_layers": 3}, 4) is None  # not the float a Status map carries


def test_a_host_reports_the_prefix_it_applied_in_status_and_a_host_of_a_frozen_plan_never_trains_it():
    pipe = LocalPipeline(GPT, 2, FP32, FP32, stage_cfg=StageConfig(OptimConfig(warmup_steps=1, total_steps=20)))
    host = pipe.switches[0][0].target.host
    assert host.status().metrics["swarm_frozen_layers"] == 0.0
    one_stage = [{"layer_start": 0, "layer_end": 4, "peer_ids": ["p"]}]
    plan = PlanDocument.from_wire({"stages": one_stage, "frozen_layers": 1})
    for other in pipe.hosts:  # what swarm-peer does to every host it builds for a plan (both ends of the tied pair)
        apply_frozen(other, plan.frozen)
    assert host.status().metrics["swarm_frozen_layers"] == 1.0 and host.worker.frozen_layers == 1
    before = {k: v.detach().clone() for k, v in host.worker.module.named_parameters() if k.startswith("blocks.0.")}
    pipe.freeze = FreezePolicy(n_layers=4)
    pipe.freeze.adopt(1)  # the trainer follows the plan's prefix (a Step with less is refused)
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 64, (8, 17), generator=gen)
    from swarm.model.data import Batch

    result = pipe.train_step(Batch(torch.arange(8), windows[:, :-1], windows[:, 1:]), 2)
    assert math.isfinite(result.loss)
    after = dict(host.worker.module.named_parameters())
    assert before and all(torch.equal(v, after[k]) for k, v in before.items())  # layer 0 never trained


@pytest.mark.parametrize("parts", [{}, {"frozen_layers": 0}, {"frozen_layers": 2}])
def test_the_frozen_prefix_of_a_plan(parts):
    plan = PlanDocument.from_wire({"stages": [{"layer_start": 0, "layer_end": 4, "peer_ids": ["p"]}], **parts})
    assert plan.frozen == (2 if parts.get("frozen_layers") else 0)


# ---- when the planner repacks ------------------------------------------------------------------------------


def test_the_planner_repacks_only_when_every_plan_stage_reports_the_same_larger_prefix():
    assert _watch(_replies()).agreed(_record()) == 3
    assert _watch(_replies()).agreed(_record(frozen_layers=3)) is None  # the plan already has it
    assert _watch(_replies(d=_reply("d", 3, frozen=2.0))).agreed(_record()) is None  # they disagree
    assert _watch(_replies(d=_reply("d", 3, version=2))).agreed(_record()) is None  # a lagging stage
    assert _watch(_replies(d=_reply("d", 3, version=4))).agreed(_record()) is None  # ahead: not this plan's
    assert _watch(_replies(d=None)).agreed(_record()) is None  # never answers
    assert _watch(_replies(d=_reply("e", 3))).agreed(_record()) is None  # a stranger answers at d's address
    assert _watch(_replies(d=_reply("d", 2))).agreed(_record()) is None  # another stage's figure
    assert _watch(_replies(d=_reply("d", 3, frozen=math.nan))).agreed(_record()) is None  # malformed
    assert _watch(_replies(d=_reply("d", 3, frozen=None))).agreed(_record()) is None  # absent
    assert _watch(_replies(d=_reply("d", 3, frozen=1e300))).agreed(_record()) is None  # oversized


def test_the_watch_reads_the_peers_at_most_every_every_s():
    now, reads = [0.0], []
    replies = _replies()
    watch = RepackWatch(lambda pid: reads.append(pid) or replies[pid], every_s=5.0, clock=lambda: now[0])
    assert watch.agreed(_record()) == 3 and len(reads) == 4
    assert watch.agreed(_record()) is None and len(reads) == 4
    now[0] = 5.0
    assert watch.agreed(_record()) == 3 and len(reads) == 8


class _DHT:
    def __init__(self, fail: bool = False):
        self.published, self.fail = [], fail

    def publish_plan(self, version, plan):
        record = PlanRecord(version=version, document=plan, created_at=1.0)  # validates its shape, as the DHT's does
        validate_plan(record, 4, [PeerAnnouncement(p, "127.0.0.1:5000", "cpu", 1 << 30, 1.0) for p in IDS])
        if self.fail:
            raise ValueError("refused")
        self.published.append((version, plan.to_wire()))  # what the DHT carries

    def get_plan(self, n_layers, peers=None, check_trainers=True):
        return PlanRecord(*self.published[-1], created_at=1.0) if self.published else None


def _planner(dht, version=4):
    return SimpleNamespace(dht=dht, spec=SimpleNamespace(layers=4), next_version=lambda peers: version)


def test_the_planner_publishes_the_repacked_plan_without_the_old_stages_per_stage_keys():
    dht = _DHT()
    current = _record(precisions=["fp32"] * 4, step_time_s=1.0, trainer_ids=["t"])
    got = _watch(_replies()).round(_planner(dht), current, [])
    assert got is not None and got.version == 4 and len(dht.published) == 1
    plan = dht.published[0][1]
    assert plan["frozen_layers"] == 3 and len(plan["stages"]) == 2  # 3 frozen layers + 1 active: 2 stages
    assert [s["peer_ids"] for s in plan["stages"]] == [["a", "b"], ["c", "d"]]  # the freed peers as replicas
    assert "precisions" not in plan and "step_time_s" not in plan and plan["trainer_ids"] == ["t"]
    assert plan["stages"] == repack_plan(current.document, 3).stage_dicts()


def _announced(pid: str, key: str) -> PeerAnnouncement:
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0, compute_key=key)


def test_freed_peers_on_hardware_the_plan_already_computes_on_stand_by_instead_of_replicating():
    # four CPU peers on one machine: a replica would split the same cores and add only its sum
    dht, one = _DHT(), "0123456789abcdef"
    got = _watch(_replies()).round(_planner(dht), _record(), [_announced(p, one) for p in IDS])
    plan = dht.published[0][1]
    assert got is not None and [s["peer_ids"] for s in plan["stages"]] == [["a"], ["c"]]
    assert plan["unused_peer_ids"] == ["b", "d"], "the freed peers stand by (for repairs), not dropped"
    assert PlanDocument.from_wire(plan).frozen == 3


@pytest.mark.parametrize(
    "keys, stages, standby",
    [
        ({}, [("a", "b"), ("c", "d")], ()),  # no key announced: every peer counts as its own hardware
        ({"a": "1" * 16, "b": "2" * 16, "c": "3" * 16, "d": "4" * 16}, [("a", "b"), ("c", "d")], ()),
        ({"a": "1" * 16, "b": "1" * 16, "c": "2" * 16, "d": "3" * 16}, [("a",), ("c", "d")], ("b",)),
        # b's hardware is the second stage's first peer's: that stage keeps its first peer, b stands by
        ({"a": "1" * 16, "b": "2" * 16, "c": "2" * 16, "d": "3" * 16}, [("a",), ("c", "d")], ("b",)),
        ({"a": "1" * 16, "b": "", "c": "1" * 16, "d": "1" * 16}, [("a", "b"), ("c",)], ("d",)),
    ],
)
def test_a_freed_peer_replicates_only_with_compute_of_its_own(keys, stages, standby):
    plan = repack_plan(_record().document, 3, compute_keys=keys)
    assert [s.peer_ids for s in plan.stages] == [tuple(s) for s in stages]
    assert plan.unused_peer_ids == standby and plan.frozen == 3


def test_a_compute_key_is_16_hex_digits_or_empty():
    assert _announced("a", "").compute_key == ""
    for bad in ("0123", "0123456789ABCDEF", "0123456789abcdeg", 7, None, "0123456789abcdef0"):
        with pytest.raises(ValueError, match="compute_key"):
            _announced("a", bad)
    wire = _announced("a", "0123456789abcdef").to_wire()
    assert PeerAnnouncement.from_wire(wire).compute_key == "0123456789abcdef"
    del wire["compute_key"]  # an older peer's announcement: unknown hardware
    assert PeerAnnouncement.from_wire(wire).compute_key == ""


def test_no_repack_is_published_when_nothing_is_due_or_the_plan_is_refused():
    assert _watch(_replies(a=None)).round(_planner(_DHT()), _record(), []) is None
    assert _watch(_replies()).round(_planner(_DHT(), version=None), _record(), []) is None
    dht = _DHT(fail=True)
    assert _watch(_replies()).round(_planner(dht), _record(), []) is None and not dht.published


def test_a_route_carries_its_plans_frozen_prefix():
    peers = [
        PeerAnnouncement(p, f"127.0.0.1:{5000 + i}", "cpu", 1 << 30, 1.0, stage=i, layer_start=i, layer_end=i + 1)
        for i, p in enumerate(IDS)
    ]
    peers = [dataclasses.replace(p, plan_version=3) for p in peers]
    frozen, thawed = _record(frozen_layers=2), _record()
    assert frozen.document.route_of(peers, frozen.version).frozen_layers == 2
    assert thawed.document.route_of(peers, thawed.version).frozen_layers == 0


# ---- the trainer's side ------------------------------------------------------------------------------------


def test_the_policy_adopts_a_plans_prefix_never_back_and_starts_its_windows_again():
    policy = FreezePolicy(n_layers=4, interval=1, tolerance=10.0)
    policy.observe(0, [1.0] * 4)
    assert policy.adopt(2, step=1) == 2 and policy.history == [(1, 2)] and policy._previous is None
    assert policy.adopt(1) == 2 and policy.adopt(99) == 3  # never back; never the last layer
    assert policy.observe(2, [1.0] * 4) == 3


def test_swarm_train_freeze_flags():
    parser = argparse.ArgumentParser()
    add_freeze_arguments(parser)
    assert freeze_config(parser.parse_args([])) is None
    cfg = freeze_config(parser.parse_args(["--freeze", "--freeze-interval", "2", "--freeze-tolerance", "5"]))
    assert cfg == FreezeConfig(interval=2, tolerance=5.0)
    with pytest.raises(ValueError):
        freeze_config(parser.parse_args(["--freeze", "--freeze-tolerance", "0"]))
    from swarm.testbed import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert freeze_config(parser.parse_args(["--freeze", "--freeze-alpha", "1"])) == FreezeConfig(alpha=1.0)


def test_one_policy_survives_every_new_route(monkeypatch):
    made = []

    class Recording:
        def __init__(self, *args, policy, **kwargs):
            made.append((args, policy))

    import swarm.runtime.freeze as freeze_module

    monkeypatch.setattr(freeze_module, "FreezingDriver", Recording)
    make = driver_factory(FreezeConfig(interval=2), 4)
    route = SimpleNamespace(driver_args=lambda: (["x"], ["p"]), frozen_layers=0)
    make(route, "1f1b", 4)
    make(SimpleNamespace(driver_args=lambda: (["y"], ["q"]), frozen_layers=2), "1f1b", 4)
    assert made[0][1] is made[1][1] is make.policy and make.policy.frozen == 2
    assert made[1][0] == (["y"], ["q"], "1f1b", 4)


def test_a_trainer_without_freeze_follows_a_frozen_plan_says_so_and_never_freezes_more(monkeypatch, caplog):
    made = []

    class Recording:
        def __init__(self, *args, policy=None, **kwargs):
            made.append(policy)

    import swarm.runtime.driver as driver_module
    import swarm.runtime.freeze as freeze_module

    monkeypatch.setattr(freeze_module, "FreezingDriver", Recording)
    monkeypatch.setattr(driver_module, "PipelineDriver", Recording)
    make = freezing.driver_factory(None, 4)
    route = lambda frozen: SimpleNamespace(driver_args=lambda: ([], []), frozen_layers=frozen)  # noqa: E731
    with caplog.at_level("INFO", logger="swarm.train.freezing"):
        make(route(0), "1f1b", 4)
        assert made == [None] and not caplog.records, "an unfrozen plan: the plain driver"
        make(route(2), "1f1b", 4)
        make(route(2), "1f1b", 4)  # a later re-plan keeps following
    assert made[1] is made[2] is make.policy and make.policy.frozen == 2
    assert [r.getMessage() for r in caplog.records] == [
        "the plan freezes layers [0, 2): following it (without --freeze this trainer freezes no more)"
    ]
    for step in range(40):  # settled norms would freeze a --freeze trainer's layers; this one only follows
        assert make.policy.observe(step, [1.0] * 4) == 2
    make(route(0), "1f1b", 4)  # a plan that forgot the prefix: the Steps still carry it (never thawed)
    assert made[3] is make.policy and make.policy.frozen == 2


def test_a_prefix_that_moves_no_layer_is_held_and_goes_out_with_the_repack():
    """1 frozen layer of 4 allows no fewer stages: no plan version is published for it alone (the trainer would
    re-plan for nothing); the planner reads its plan with the prefix held, and the repack carries the larger one."""
    dht, replies = _DHT(), _replies(**{p: _reply(p, i, frozen=1.0) for i, p in enumerate(IDS)})
    watch = _watch(replies)
    current = _record()
    assert watch.round(_planner(dht), current, []) is None and not dht.published
    assert watch.frozen == 1
    carried = watch.carried(current)
    assert carried.document.frozen == 1 and carried.version == current.version
    assert carried.document.stages == current.document.stages
    assert watch.agreed(carried) is None, "the held figure is the base: only a larger one is news"
    assert watch.carried(_record(frozen_layers=2)).document.frozen == 2, "a plan that carries more is kept"
    replies.update(_replies())  # the stages froze 3 layers: 2 stages now
    got = watch.round(_planner(dht), carried, [])
    assert got is not None and dht.published[0][1]["frozen_layers"] == 3 and len(dht.published[0][1]["stages"]) == 2
    assert watch.frozen == 3


# ---- a trainer that connects while the planner holds a prefix ------------------------------------------------


def _status(frozen):
    return SimpleNamespace(metrics={} if frozen is None else {"swarm_frozen_layers": frozen})


@pytest.mark.parametrize(
    "statuses, expected",
    [
        ([[_status(2.0)], [_status(2.0), _status(2.0)]], 2),  # every replica of every stage: the same figure
        ([[_status(2.0)], [_status(2.0), None]], 2),  # a replica that does not answer says nothing
        ([[_status(2.0)], [None]], 0),  # a stage with no answer: no agreement
        ([[_status(2.0)], [_status(3.0)]], 0),  # they disagree (a liar, or a stage still applying)
        ([[_status(3.0)], [_status(None)]], 0),  # one reports none
        ([[_status(3.0)], [_status(1e300)]], 0),  # malformed
        ([[_status(0.0)], [_status(0.0)]], 0),
    ],
)
def test_the_stages_prefix_counts_only_when_every_stage_reports_the_same(statuses, expected):
    assert freezing.stages_prefix(statuses, 4) == expected


class _Driver:
    closed = False

    def close(self):
        self.closed = True


def test_a_trainer_connecting_to_stages_that_froze_more_than_their_plan_adopts_their_prefix():
    """A trainer that resumes (or joins) while the planner holds a prefix that moved no layer: its plan says 0; it
    drives (and its steps.csv says it drives) at the stages' prefix instead."""
    made, lines = [], []
    make = lambda r: made.append(r) or _Driver()  # noqa: E731
    first = _Driver()
    route = dataclasses.make_dataclass("R", ["plan_version", "frozen_layers"], frozen=True)(4, 0)
    got = freezing.with_stages_prefix(first, route, [[_status(2.0)], [_status(2.0)]], make, 4, lines.append)
    assert first.closed and got is not first and made[0].frozen_layers == 2 and "froze layers [0, 2)" in lines[0]
    same = _Driver()
    carried = dataclasses.replace(route, frozen_layers=2)
    both = [[_status(2.0)], [_status(2.0)]]
    assert freezing.with_stages_prefix(same, carried, both, make, 4, lines.append) is same and not same.closed
    disagree = _Driver()
    assert freezing.with_stages_prefix(disagree, route, [[_status(2.0)], [_status(3.0)]], make, 4) is disagree
    silent = _Driver()  # stage 1 did not answer the model check's Status
    assert freezing.with_stages_prefix(silent, route, [[_status(2.0)], [None]], make, 4) is silent and len(made) == 1
