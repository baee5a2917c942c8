"""The planner's epilogue-only choice from measured figures, and the settings and flags that carry it."""

import math

import pytest

from swarm.compression import CodecConfig
from swarm.runtime.boundary import EpilogueOnly
from swarm.runtime.epilogue import EpiloguePlan, StageTimes
from swarm.scheduler.epilogue_only import choose_epilogue_only, link_times

COMPUTE = [(0.01, 0.02), (0.015, 0.03)]  # the last stage (head and loss) the slowest, as measured here
MB = 1e6 / 8


def _times(rate_mbit: float, precise: float = 65536.0, compressed: float = 4096.0) -> StageTimes:
    return link_times(COMPUTE, [rate_mbit * MB], [0.0], 8192.0, precise, compressed)


def test_link_times_are_latency_plus_bytes_over_rate():
    t = link_times(COMPUTE, [1000.0], [0.5], 100.0, 2000.0, 10.0)
    assert t.forward_send_s == (0.6,) and t.precise_send_s == (2.5,) and t.compressed_send_s == (0.51,)
    assert t.forward_s == (0.01, 0.015) and t.backward_s == (0.02, 0.03)


@pytest.mark.parametrize("rates,latency", [([], [0.0]), ([1.0, 1.0], [0.0]), ([0.0], [0.0]), ([-1.0], [0.0])])
def test_link_times_refuse_bad_links(rates, latency):
    with pytest.raises(ValueError):
        link_times(COMPUTE, rates, latency, 1.0, 1.0, 1.0)


def test_a_fast_link_leaves_every_message_precise_and_a_slow_one_compresses_every_one():
    fast = choose_epilogue_only("1f1b", 4, _times(10000.0))
    assert fast.plan.tails == (0,) and fast.exposed == 0 and fast.chosen_s <= fast.compressed_s * 1.01
    slow = choose_epilogue_only("1f1b", 4, _times(1.0))
    assert slow.plan.tails == (4,) and slow.chosen_s == slow.compressed_s < slow.precise_s


def test_in_between_only_the_drain_stays_compressed():
    mid = choose_epilogue_only("1f1b", 4, _times(100.0), tolerance=0.0)
    assert mid.plan == EpiloguePlan((1,), "1f1b", 4)
    assert mid.chosen_s <= mid.compressed_s * (1 + 1e-9) < mid.precise_s
    row = mid.row()
    assert row["tails"] == "1" and row["compressed_messages"] == 1 and row["backward_messages"] == 4
    assert math.isclose(row["predicted_compute_s"], 4 * 0.045)
    assert "compress 1/4" in mid.why


@pytest.mark.parametrize("tolerance", [-0.1, 1.0, math.nan])
def test_a_tolerance_out_of_range_is_refused(tolerance):
    with pytest.raises(ValueError):
        choose_epilogue_only("1f1b", 4, _times(10.0), tolerance)


def test_the_peer_flag_parses_and_renders_back():
    e = EpilogueOnly.parse("fp32:1,2:1f1b:4")
    assert e.precise == CodecConfig.parse("fp32") and e.plan == EpiloguePlan((1, 2), "1f1b", 4)
    assert EpilogueOnly.parse(e.label()) == e
    anyshape = EpilogueOnly.parse("bf16:1")
    assert anyshape.plan == EpiloguePlan((1,)) and EpilogueOnly.parse(anyshape.label()) == anyshape
    assert EpilogueOnly.parse("") is None


@pytest.mark.parametrize(
    "bad", ["fp32", "fp32:", "fp32:x", "fp32:-1", "nope:1", "fp32:1:1f1b", "fp32:1:nope:4", "fp32:1:1f1b:x"]
)
def test_the_peer_flag_refuses_bad_values_naming_itself(bad):
    with pytest.raises(ValueError, match="--bw-epilogue"):
        EpilogueOnly.parse(bad)


def test_a_peer_config_with_a_bad_epilogue_fails_at_once():
    from swarm.daemon.peer_config import PeerConfig, peer_flags

    with pytest.raises(ValueError, match="--bw-epilogue"):
        PeerConfig(bw_epilogue="fp32:x")
    argv = peer_flags().to_argv(PeerConfig(bw_epilogue="fp32:1:1f1b:4"))
    assert "--bw-epilogue" in argv and "fp32:1:1f1b:4" in argv


def test_a_peer_builds_its_links_with_its_epilogue_flag():
    from swarm.peers.plan import PlanDocument
    from swarm.runtime.host import StageRole
    from tests.unit.scheduler.test_bits import A, B, bare_daemon

    daemon = bare_daemon()
    stages = [{"layer_start": 0, "layer_end": 2, "peer_ids": [A]}, {"layer_start": 2, "layer_end": 4, "peer_ids": [B]}]
    assert daemon._make_host(StageRole(1, 2, 2, 4, 3)).links.epilogue is None
    daemon.cfg.bw_epilogue = "fp32:1:1f1b:4"
    host = daemon._make_host(StageRole(1, 2, 2, 4, 3), PlanDocument.from_wire({"stages": stages}))
    assert host.links.epilogue == EpilogueOnly.parse("fp32:1:1f1b:4")
    assert host.links.precise_recv is not None


# ---- the live planner's choice (--plan-epilogue-only) ------------------------------------------------------------


def _plan_input(rate_mbit: float, speeds=(1e12, 1e12), delay_s: float = 0.0):
    import numpy as np

    from swarm.scheduler.plans import Peer, PlanInput

    eye = np.eye(2, dtype=bool)
    peers = tuple(Peer(pid, s, 1e12) for pid, s in zip(("a" * 24, "b" * 24), speeds, strict=True))
    return PlanInput(peers, np.where(eye, 0.0, delay_s), np.where(eye, np.inf, rate_mbit * MB))


STAGE_DICTS = [{"layer_start": 0, "layer_end": 2, "peer_ids": ["a" * 24]},
               {"layer_start": 2, "layer_end": 4, "peer_ids": ["b" * 24]}]  # fmt: skip
SIZES = {"aqsgd2": 8192.0, "fp32": 65536.0, "gradq2": 4096.0}.__getitem__


def test_the_planner_times_stages_from_the_announced_speeds_and_links_from_the_probes():
    from swarm.scheduler.epilogue_only import FORWARD_SHARE, plan_epilogue_only
    from swarm.scheduler.plans import ModelSpec

    spec = ModelSpec(layers=4, flops_per_layer=0.015e12, forward_bytes=1, backward_bytes=1,
                     gradient_bytes_per_layer=0, memory_bytes_per_layer=0, micro_batches=4)  # fmt: skip
    # two layers at 0.015 s each: 0.03 s forward + backward a micro-batch, a third of it forward
    chosen = {r: plan_epilogue_only(STAGE_DICTS, _plan_input(r), spec, SIZES, ("aqsgd2", "gradq2")) for r in (1, 1e4)}
    stage = 2 * 0.015
    times = link_times([(FORWARD_SHARE * stage, (1 - FORWARD_SHARE) * stage)] * 2, [1 * MB], [0.0], 8192, 65536, 4096)
    assert chosen[1].plan == choose_epilogue_only("1f1b", 4, times).plan == EpiloguePlan((4,), "1f1b", 4)
    assert chosen[1e4].plan.tails == (0,)  # a fast link: every backward message precise
    # the slower replica sets a stage's compute; a one-stage plan has no boundary to choose for
    slower = plan_epilogue_only(STAGE_DICTS, _plan_input(1, (1e12, 1e6)), spec, SIZES, ("aqsgd2", "gradq2"))
    assert slower.compute_s > chosen[1].compute_s
    one = [{"layer_start": 0, "layer_end": 4, "peer_ids": ["a" * 24]}]
    assert plan_epilogue_only(one, _plan_input(1), spec, SIZES, ("aqsgd2", "gradq2")) is None


def test_a_plan_s_epilogue_only_choice_validates_and_a_peer_runs_it_over_its_flag():
    from swarm.peers.plan import PlanDocument, PlanStage
    from swarm.runtime.host import StageRole
    from tests.unit.scheduler.test_bits import A, B, bare_daemon

    stages = [{"layer_start": 0, "layer_end": 2, "peer_ids": [A]}, {"layer_start": 2, "layer_end": 4, "peer_ids": [B]}]
    plan = PlanDocument.from_wire({"stages": stages, "bw_epilogue": "fp32:2:1f1b:4"})
    assert plan.to_wire()["bw_epilogue"] == "fp32:2:1f1b:4"
    for bad in ("fp32:2", "fp32:2,1:1f1b:4", "fp32:5:1f1b:4", "fp32:-1:1f1b:4", "fp32:1:zz:4", "nope:1:1f1b:4",
                "fp32:1:1f1b:0", 3, "fp32:" + "1," * 600 + "1:1f1b:4"):  # fmt: skip
        with pytest.raises(ValueError, match="bw_epilogue"):
            PlanDocument.from_wire({"stages": stages, "bw_epilogue": bad})
    daemon = bare_daemon()
    daemon.cfg.bw_epilogue = "fp32:1:1f1b:4"
    host = daemon._make_host(StageRole(1, 2, 2, 4, 3), plan)
    assert host.links.epilogue == EpilogueOnly.parse("fp32:2:1f1b:4")  # the plan's, not the flag's
    # a repack onto other stages drops it with the other per-boundary choices
    assert plan.with_stages([PlanStage(0, 4, (A, B))]).bw_epilogue is None


def test_the_planner_publishes_its_epilogue_only_choice_in_a_new_plan():
    from tests.unit.scheduler.test_bits import per_link_planner

    calls = []

    def choose(stages, plan_input, spec, links=None):
        calls.append((len(stages), len(plan_input.peers), links))
        return "fp32:1:1f1b:4"

    _, _, _, _, published = per_link_planner(codec_bytes=None, epilogue_only=choose)
    ((_, first),) = published
    assert first["bw_epilogue"] == "fp32:1:1f1b:4" and calls == [(2, 2, None)], "the flags' codecs on every link"
    _, _, _, _, plain = per_link_planner(codec_bytes=None)
    assert "bw_epilogue" not in plain[0][1]
    calls.clear()
    _, _, _, _, both = per_link_planner(epilogue_only=choose)  # per-link codecs: chosen over the plan's own
    ((_, chosen),) = both
    ((_, _, links),) = calls
    assert [(c.forward_label, c.backward_label) for c in links] == [
        (c["forward"], c["backward"]) for c in chosen["codecs"]
    ]
    assert chosen["bw_epilogue"] == "fp32:1:1f1b:4"


def test_epilogue_only_prices_each_boundary_at_the_codecs_the_plan_chose_for_it():
    from swarm.daemon.peer_config import PlanningConfig
    from swarm.scheduler.epilogue_only import link_times

    assert PlanningConfig(epilogue_only=True).codec_policy == "per-link", "the default policy with epilogue-only"
    times = link_times([(0.01, 0.02)] * 3, [1e6, 1e6], [0.0, 0.0], [1e4, 1e5], 4e5, [2e3, 3e4])
    assert [round(t, 6) for t in (*times.forward_send_s, *times.compressed_send_s)] == [0.01, 0.1, 0.002, 0.03]
    assert times.precise_send_s == (0.4, 0.4), "one precise codec (fp32) on every link"
    same = link_times([(0.01, 0.02)] * 3, [1e6, 1e6], [0.0, 0.0], 1e4, 4e5, 2e3)
    assert same.forward_send_s == (0.01, 0.01) and same.compressed_send_s == (0.002, 0.002)
    with pytest.raises(ValueError, match="message sizes"):
        link_times([(0.01, 0.02)] * 3, [1e6, 1e6], [0.0, 0.0], [1e4], 4e5, 2e3)


def test_measured_clocks_with_a_slower_last_stage_leave_only_the_drain_compressed():
    # equal announced stages expose every message (1F1B); the calibration's clocks, the last stage's head and loss
    # in them, give the drain alone at 100 Mbit/s
    from swarm.scheduler.epilogue_only import plan_epilogue_only
    from swarm.scheduler.plans import ModelSpec

    spec = ModelSpec(layers=4, flops_per_layer=0.015e12, forward_bytes=1, backward_bytes=1,
                     gradient_bytes_per_layer=0, memory_bytes_per_layer=0, micro_batches=4)  # fmt: skip
    codecs = ("aqsgd2", "gradq2")
    announced = plan_epilogue_only(STAGE_DICTS, _plan_input(100), spec, SIZES, codecs)
    measured = plan_epilogue_only(STAGE_DICTS, _plan_input(100), spec, SIZES, codecs, measured_s=[0.03, 0.06])
    assert announced.plan.tails == (4,) and measured.plan.tails == (1,)
    assert measured.compute_s == pytest.approx(4 * 0.06)
