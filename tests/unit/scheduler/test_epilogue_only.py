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
