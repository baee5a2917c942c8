"""Bits per link: the policy (slow links fewer bits, fast links more, a floor, hysteresis), the plan's "codecs"
validated whole, the planner publishing and re-choosing them, and a peer building its ends from them."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.peers.dht import SwarmDHT
from swarm.peers.dht_config import DHTConfig
from swarm.peers.entries import RunKeys
from swarm.peers.plan import PlanDocument
from swarm.peers.records import LinkMeasurement, PeerAnnouncement, PlanRecord, validate_plan
from swarm.runtime.average import TIED_CODEC, GradientAverager, group_config
from swarm.scheduler.bits import (
    BACKWARD_LADDER,
    FORWARD_LADDER,
    TIED_LADDER,
    BitsPolicy,
    LinkFigures,
    choose_link,
    codec_sizes,
    rechoose,
)
from swarm.scheduler.sizes import model_spec
from tests.unit.daemon.test_planner_versions import planner as make_planner

SIZES = codec_sizes(ModelConfig(), 2)  # bytes per micro-batch of each label (fp32: ~121 kB)
COMPUTE_S = 0.05


def link(mbit: float, compute_s: float = COMPUTE_S) -> LinkFigures:
    return LinkFigures(mbit * 1e6 / 8, mbit * 1e6 / 8, compute_s)


def bits(label: str) -> int:
    return 32 if label == "fp32" else CodecConfig.parse(label).bits


def test_slow_links_get_fewer_bits_and_fast_links_more():
    chosen = [choose_link(link(rate), SIZES) for rate in (1, 10, 100, 1000)]
    fw = [bits(c.forward_label) for c in chosen]
    bw = [bits(c.backward_label) for c in chosen]
    assert fw == sorted(fw) and bw == sorted(bw) and fw[0] < fw[-1] and bw[0] < bw[-1], chosen
    assert chosen[-1].forward_label == "fp32" and chosen[-1].backward_label == "fp32"  # 1 Gbit/s hides fp32
    assert all(c.why for c in chosen)


def test_the_loss_budget_is_a_floor_even_when_nothing_hides():
    c = choose_link(link(0.01), SIZES)
    assert (c.forward_label, c.backward_label) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC) and "floor" in c.why
    policy = BitsPolicy(forward_floor="acsgd4+ch+nr", backward_floor="gradq8+ef+rot+nr+cs+g1024")
    c = choose_link(link(0.01), SIZES, policy)
    assert (c.forward_label, c.backward_label) == ("acsgd4+ch+nr", "gradq8+ef+rot+nr+cs+g1024")
    with pytest.raises(ValueError):
        BitsPolicy(forward_floor="directq1")
    # the ternary rung below the default floor is chosen only when a policy names it
    policy = BitsPolicy(backward_floor="gtern+ef+rot+nr+r150+g1024")
    assert choose_link(link(0.01), SIZES, policy).backward_label == "gtern+ef+rot+nr+r150+g1024"
    assert choose_link(link(1000), SIZES, policy).backward_label == "fp32"


def test_the_ladders_are_the_default_codec_family():
    assert BitsPolicy().forward_floor == DEFAULT_FORWARD_CODEC and BitsPolicy().backward_floor == DEFAULT_BACKWARD_CODEC
    assert BACKWARD_LADDER[-1] == "gtern+ef+rot+nr+r150+g1024"  # below the default floor: a policy names it
    assert SIZES(BACKWARD_LADDER[-1]) < SIZES(BACKWARD_LADDER[-2])
    assert FORWARD_LADDER[-1] == "acsgd2+ch+nr+fsl32+fslw4+fsle10+dsl8+s20"  # below the default floor: policies name it
    assert SIZES(FORWARD_LADDER[-1]) < SIZES(FORWARD_LADDER[-2])
    for ladder in (FORWARD_LADDER[:4], BACKWARD_LADDER[:4]):
        rungs = [CodecConfig.parse(label) for label in ladder]
        assert [c.wire_bits for c in rungs] == [32, 8, 4, 2]
        assert [SIZES(label) for label in ladder] == sorted((SIZES(label) for label in ladder), reverse=True)
    # one family: each wider rung is the floor at more bits, with 16-bit first sights forward (a fast link's
    # choice: the floor's subspace-coded ones trade error for bytes) and channel deltas, groups of 1024 backward;
    # the rung below the floor is the floor with its changes at a lower rank
    floor = CodecConfig.parse(DEFAULT_FORWARD_CODEC)
    assert (floor.first_sight_rank, floor.first_sight_width_divisor, floor.delta_rank) == (32, 4, 16)
    assert FORWARD_LADDER[3] == DEFAULT_FORWARD_CODEC
    for label, bits in zip(FORWARD_LADDER[1:3], (8, 4), strict=True):
        off = {"first_sight_rank": 0, "first_sight_width_divisor": 0, "first_sight_energy": 0, "delta_rank": 0,
               "subspace_step_percent": 0}  # fmt: skip
        wider = replace(floor, bits=bits, **off)
        assert CodecConfig.parse(label) == wider
    assert CodecConfig.parse(FORWARD_LADDER[-1]) == replace(floor, delta_rank=8)
    floor = CodecConfig.parse(DEFAULT_BACKWARD_CODEC)
    assert floor.group_size == 256
    for label, bits in zip(BACKWARD_LADDER[1:3], (8, 4), strict=True):
        assert CodecConfig.parse(label) == replace(floor, bits=bits, group_size=1024, error_feedback=True)
    # the tied sum: the backward at 4 bits, then the floor, what a peer without the plan's epilogue codecs sums with
    # (with error feedback, which every sum keeps: a sum's next message is the same parameters' next step)
    tied_floor = replace(floor, bits=GradientAverager.tied_min_bits, error_feedback=True)
    assert CodecConfig.parse(TIED_LADDER[-2]) == tied_floor
    assert TIED_LADDER[-1] == GradientAverager.tied_codec == TIED_CODEC
    assert group_config(None, floor, tied=True) == group_config(CodecConfig.parse(TIED_CODEC), floor, tied=True)


def test_unchanged_measurements_do_not_rechoose_and_a_big_move_does():
    old = [link(10)]
    assert rechoose(None, old)
    assert not rechoose(old, [link(12)]), "within the 1.5x hysteresis"
    assert rechoose(old, [link(30)]) and rechoose(old, [link(10, compute_s=1.0)])
    assert rechoose(old, [link(10), link(10)]), "another boundary count"


def two_stage_plan(**extra) -> PlanRecord:
    stages = [{"layer_start": 0, "layer_end": 2, "peer_ids": [A]}, {"layer_start": 2, "layer_end": 4, "peer_ids": [B]}]
    return PlanRecord(3, {"stages": stages, **extra}, 1.0)


A, B = "0a0000000000", "0b0000000000"
PEERS = [PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, 10.0) for pid in (A, B)]


@pytest.mark.parametrize(
    "codecs",
    [
        [{"forward": "zz3", "backward": "gradq4"}],  # unknown codec
        [{"forward": "aqsgd2", "backward": "gradq4+xx"}],  # unknown suffix
        [{"forward": "aqsgd99", "backward": "gradq4"}],  # unknown width
        [],  # wrong count
        [{"forward": "aqsgd2", "backward": "gradq4"}] * 2,  # wrong count
        [{"forward": "aqsgd2"}],  # missing backward
        [{"forward": "aqsgd2", "backward": "gradq4", "extra": 1}],
        [{"forward": "a" * 65, "backward": "gradq4"}],  # oversized
        [{"forward": 2, "backward": "gradq4"}],
        [{"forward": "aqsgd2", "backward": "gradq4", "why": "x" * 401}],
        [{"forward": "aqsgd2", "backward": math.nan}],
        "aqsgd2",
    ],
)
def test_a_plans_codecs_are_validated_whole(codecs):
    with pytest.raises(ValueError, match="codecs|JSON"):  # NaN: the record refuses it before the plan check
        validate_plan(two_stage_plan(codecs=codecs), 4, PEERS)


def test_a_valid_plan_with_codecs_passes():
    validate_plan(two_stage_plan(codecs=[{"forward": "aqsgd2+ch", "backward": "gradq4+ef", "why": "ok"}]), 4, PEERS)
    validate_plan(two_stage_plan(), 4, PEERS)  # no codecs: the flags' codecs


def three_stages(codecs=None) -> PlanDocument:
    stages = [{"layer_start": s, "layer_end": s + 1, "peer_ids": [f"p{s}"]} for s in range(3)]
    return PlanDocument.from_wire({"stages": stages} if codecs is None else {"stages": stages, "codecs": codecs})


def test_each_stage_takes_its_two_boundaries_codecs():
    plan = three_stages([{"forward": "fp32", "backward": "gradq8+ef"}, {"forward": "aqsgd2", "backward": "gradq2+ef"}])
    default = ("aqsgd4", "gradq4")
    assert plan.link_labels(0, default) == ("fp32", "gradq8+ef", "fp32", "gradq8+ef")
    assert plan.link_labels(1, default) == ("aqsgd2", "gradq8+ef", "fp32", "gradq2+ef")
    assert plan.link_labels(2, default) == ("aqsgd2", "gradq2+ef", "aqsgd2", "gradq2+ef")
    assert three_stages().link_labels(1, default) == ("aqsgd4", "gradq4", "aqsgd4", "gradq4")
    flags = (CodecConfig.parse("aqsgd4"), CodecConfig.parse("gradq4"))
    assert three_stages().link_configs(1, flags) == flags * 2  # the flags' configs themselves where nothing changes


def test_a_plans_codecs_keep_the_peers_own_codec_options():
    """The plan names each link's codec; the peer's --group-size, --zstd-level, --codec-seed and --buffer-dir
    (fields no plan label sets, group size only where the label has no +gN) hold on every link end."""
    local = dict(group_size=256, zstd_level=7, seed=11)
    flags = (CodecConfig.parse("aqsgd4", **local, buffer_dir="/tmp/bufs"), CodecConfig.parse("gradq4", **local))
    plan = three_stages(
        [
            {"forward": "acsgd2+ch+nr", "backward": "gradq2+ef+rot+nr+cs+g1024"},  # other codecs, +g1024 on one
            {"forward": "aqsgd4", "backward": "gradq4"},  # the flags' own labels
        ]
    )
    forward_send, backward_send, forward_recv, backward_recv = plan.link_configs(1, flags)
    assert (forward_send, backward_recv) == flags, "the plan names the flags' labels: the flags' configs themselves"
    assert forward_recv == CodecConfig.parse("acsgd2+ch+nr", **local, buffer_dir="/tmp/bufs")
    assert backward_send == CodecConfig.parse("gradq2+ef+rot+nr+cs+g1024", zstd_level=7, seed=11)
    assert backward_send.group_size == 1024, "the label's +g1024 wins over --group-size"
    for end in (forward_send, backward_send, forward_recv, backward_recv):
        assert (end.zstd_level, end.seed) == (7, 11)


def bare_daemon():
    """A `PeerDaemon` with only what `_make_host` reads: flags' codecs aqsgd4/gradq4, every peer dialed direct."""
    from swarm.daemon.peer import PeerDaemon
    from swarm.runtime.worker import OptimConfig

    daemon = PeerDaemon.__new__(PeerDaemon)
    daemon.cfg = SimpleNamespace(
        optim=OptimConfig(),
        device="cpu",
        precision="fp32",
        budget=None,
        bw_epilogue="",
        sensitivity_every_steps=0,
        compute_slowdown=1.0,
    )
    daemon.model, daemon.speed, daemon.shaping = ModelConfig(), 10.0, None
    daemon.codecs = (CodecConfig.parse("aqsgd4"), CodecConfig.parse("gradq4"))
    daemon.dht, daemon.transport, daemon.signer, daemon.book, daemon.metrics = SimpleNamespace(peer_id=A), *[None] * 4
    daemon.checkpoints = SimpleNamespace(setup=lambda host: None, on_step=lambda host: None)
    daemon.nat = SimpleNamespace(tunnels=SimpleNamespace(dial=lambda address: address))
    return daemon


def test_a_peer_builds_its_boundary_ends_from_the_plans_codecs():
    from swarm.runtime.host import StageRole

    daemon = bare_daemon()
    stages = [{"layer_start": 0, "layer_end": 2, "peer_ids": [A]}, {"layer_start": 2, "layer_end": 4, "peer_ids": [B]}]
    plan = PlanDocument.from_wire({"stages": stages, "codecs": [{"forward": "aqsgd2", "backward": "gradq2+ef"}]})
    host = daemon._make_host(StageRole(1, 2, 2, 4, 3), plan)
    ends = host.links
    assert ends.forward_recv.config.label == "aqsgd2" and ends.backward_recv.config.label == "gradq2+ef"
    assert host.assignment.link_codecs[1].label == "gradq2+ef"


def fake_dht(records: dict, links: list) -> tuple[SwarmDHT, list]:
    """A SwarmDHT whose records live in `records` (no DHT process); what it publishes lands there too."""
    published: list = []
    dht = SwarmDHT.__new__(SwarmDHT)
    dht.config, dht.peer_id, dht._warned, dht._keys = DHTConfig(), A, set(), RunKeys.of_run("run")
    dht._parse_all = lambda key, kind: list(records.get(kind, []))
    dht.links = lambda: list(links)

    def publish_plan(version, plan):
        published.append((version, plan.to_wire()))  # what the DHT carries
        records.setdefault("plan", []).append((A, PlanRecord(version=version, document=plan, created_at=1e6)))

    dht.publish_plan = publish_plan
    return dht, published


def measured(mbit: float) -> list[LinkMeasurement]:
    return [LinkMeasurement(a, b, 0.001, mbit * 1e6 / 8, 1.0) for a, b in ((A, B), (B, A))]


def per_link_planner(mbit: float = 1.0, **planner_kw):
    """A per-link-codec `Planner` of two peers A, B joined at `mbit` Mbit/s over a fake DHT, after its first round:
    (model, planner, records, links, published); change `records`/`links` in place for the next round.
    `planner_kw` replaces the planner's codec keywords (`codec_bytes=None, epilogue=True`: the selective policy)."""
    model = ModelConfig()
    spec = model_spec(model, CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4"))
    links = measured(mbit)
    records = {"peers": [PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, 40.0) for pid in (A, B)]}
    dht, published = fake_dht(records, links)
    planner = make_planner(dht, spec, **({"codec_bytes": SIZES} | planner_kw))
    planner.round()
    return model, planner, records, links, published


def test_the_planner_publishes_per_link_codecs_and_rechooses_only_past_the_hysteresis():
    model, planner, records, links, published = per_link_planner()
    ((version, first),) = published
    validate_plan(PlanRecord(version, first, 1.0), model.n_layers, records["peers"])
    slow = first["codecs"][0]
    assert (slow["forward"], slow["backward"]) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC), slow
    records["peers"] = [PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 34, 40.0, plan_version=version)
                        for pid in (A, B)]  # fmt: skip
    links[:] = measured(1.2)
    assert planner.round() is None and len(published) == 1, "a small move keeps the codecs"
    links[:] = measured(1000.0)
    assert planner.round() is not None
    fast = published[-1][1]["codecs"][0]
    assert published[-1][1]["stages"] == first["stages"] and bits(fast["forward"]) > 2 and bits(fast["backward"]) > 2
