"""The planner's calibration: the plan peers' clocks (from `Status`) over a window of steps re-predict the plan,
and malformed, stranger, late and silent replies leave the prediction alone."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
from test_planner_versions import A, B, peer, swarm, two_stages
from test_planner_versions import planner as make_planner

from swarm.daemon.calibrate import (
    MAX_SECONDS,
    Calibrator,
    Measured,
    StageClock,
    calibrated_breakdown,
    measured_bytes,
    read_clock,
    window,
)
from swarm.peers.records import PlanRecord
from swarm.scheduler.plans import ModelSpec, Peer, PlanInput, TransformerShape


def metrics(
    stage: int, steps: int, step_s: float, work_s: float, passes: int, fw=0.0, bw=0.0, tied=0.0, average=0.0
) -> dict:
    return {
        "swarm_step_seconds_count": float(steps),
        "swarm_step_seconds_sum": step_s,
        f'swarm_phase_seconds_count{{phase="compute",stage="{stage}"}}': float(passes),
        f'swarm_phase_seconds_sum{{phase="compute",stage="{stage}"}}': work_s * 0.8,
        f'swarm_phase_seconds_sum{{phase="encode",stage="{stage}"}}': work_s * 0.1,
        f'swarm_phase_seconds_sum{{phase="decode",stage="{stage}"}}': work_s * 0.1,
        f'swarm_wire_bytes_total{{direction="forward",link="{stage}"}}': fw,
        f'swarm_wire_bytes_total{{direction="backward",link="{stage - 1}"}}': bw,
        'swarm_wire_bytes_total{direction="tied",link="tied"}': tied,
        'swarm_wire_bytes_total{direction="average",link="average"}': average,
    }


def reply(stage: int, **kw) -> SimpleNamespace:
    return SimpleNamespace(stage=stage, metrics=metrics(stage, **kw))


def test_read_clock_sums_the_work_phases_and_refuses_malformed_figures():
    clock = read_clock(metrics(1, 5, 2.0, 1.0, 40, bw=100.0), 1)
    assert clock == StageClock(5, 2.0, pytest.approx(1.0), 40, (0.0, 100.0, 0.0, 0.0))
    good = metrics(0, 5, 2.0, 1.0, 40)
    for key in good:
        for bad in (math.nan, math.inf, -1.0, MAX_SECONDS * 1e12):
            assert read_clock({**good, key: bad}, 0) is None, (key, bad)
    assert read_clock({**good, "swarm_step_seconds_count": 2.5}, 0) is None  # counts are whole
    assert read_clock({**good, "swarm_step_seconds_count": 7}, 0) is None  # not a double: not from a Status map
    # another stage's figures are not this one's: its phases read as 0, the window then refuses them
    other = read_clock(good, 1)
    assert other is not None and other.passes == 0


def test_the_window_prefers_the_whole_steps_the_trainer_timed():
    before = StageClock(4, 10.0, 2.0, 32, (0.0, 0.0, 0.0, 0.0), (4, 11.0))
    after = StageClock(7, 13.0, 3.5, 56, (0.0, 0.0, 0.0, 0.0), (7, 14.3))
    assert window(before, after).step_s == pytest.approx(1.1)  # (14.3 - 11) / 3, not the stage's (13 - 10) / 3
    partly = StageClock(7, 13.0, 3.5, 56, (0.0, 0.0, 0.0, 0.0), (6, 13.2))  # a step without the trainer's figure
    assert window(before, partly).step_s == pytest.approx(1.0)
    good = metrics(0, 5, 2.0, 1.0, 40) | {'swarm_phase_seconds_count{phase="trainer",stage="0"}': 5.0}
    assert read_clock(good | {'swarm_phase_seconds_sum{phase="trainer",stage="0"}': math.nan}, 0) is None


def test_window_takes_differences_and_refuses_counters_that_went_back():
    before = StageClock(4, 10.0, 2.0, 32, (8000.0, 0.0, 100.0, 5000.0))
    after = StageClock(7, 13.0, 3.5, 56, (20000.0, 0.0, 400.0, 20000.0))
    m = window(before, after)
    assert m == Measured(
        pytest.approx(1.5 / 12), pytest.approx(1.0), 3, pytest.approx(1000.0), 0.0, 100.0, 4, average_bytes=5000.0
    )
    assert window(after, before) is None  # a restarted host
    assert window(before, before) is None  # no step in between


class Peers:
    """Status replies per peer id, as the test sets them; None: silent."""

    def __init__(self):
        self.replies: dict[str, SimpleNamespace | None] = {}
        self.reads = 0

    def __call__(self, pid: str):
        self.reads += 1
        return self.replies.get(pid)


PLAN = two_stages(3, A, B).document


def set_steps(peers: Peers, steps: int, stage_of_b: int = 1) -> None:
    """4 micro-batches a step: stage 0 0.04 s and 100 bytes forward each, 0.3 s a step; stage 1 0.03 s, 100 back."""
    mb = 4 * steps
    peers.replies[A] = reply(0, steps=steps, step_s=0.3 * steps, work_s=0.04 * mb, passes=2 * mb, fw=100.0 * mb)
    b = reply(stage_of_b, steps=steps, step_s=0.28 * steps, work_s=0.03 * mb, passes=2 * mb, bw=100.0 * mb)
    peers.replies[B] = b


def test_the_calibrator_waits_for_every_stage_then_gives_the_window_once():
    peers, now = Peers(), [0.0]
    cal = Calibrator(peers, after_steps=4, window_steps=3, every_s=1.0, clock=lambda: now[0], window_s=0.0)
    set_steps(peers, 2)
    assert cal.observe(PLAN) is None  # before the first epoch is over
    now[0] += 1
    set_steps(peers, 4)
    assert cal.observe(PLAN) is None  # the window starts
    set_steps(peers, 7)
    reads = peers.reads
    assert cal.observe(PLAN) is None and peers.reads == reads, "read again before every_s passed"
    now[0] += 1
    measured = cal.observe(PLAN)
    assert measured is not None and set(measured) == {A, B}
    assert measured[A].micro_batch_s == pytest.approx(0.04) and measured[A].step_s == pytest.approx(0.3)
    assert measured[A].forward_bytes == pytest.approx(100.0) and measured[B].backward_bytes == pytest.approx(100.0)
    now[0] += 1
    set_steps(peers, 20)
    assert cal.observe(PLAN) is None, "once per set of stages"
    # new stages: a new window
    moved = two_stages(4, B, A).document
    now[0] += 1
    assert cal.observe(moved) is None


def test_the_window_spans_window_s_as_well_as_window_steps():
    # 0.2 s steps on a loaded machine: 4 steps (0.8 s) were one reading's worth, too few to average their spread
    peers, now = Peers(), [0.0]
    cal = Calibrator(peers, after_steps=4, window_steps=4, every_s=1.0, clock=lambda: now[0], window_s=4.0)
    set_steps(peers, 4)
    assert cal.observe(PLAN) is None  # opened at t = 0
    for t, steps in ((1.0, 9), (2.0, 14), (3.0, 19)):
        now[0] = t
        set_steps(peers, steps)
        assert cal.observe(PLAN) is None, f"{steps - 4} steps but only {t} s"
    now[0] = 4.0
    set_steps(peers, 24)
    measured = cal.observe(PLAN)
    assert measured is not None and measured[A].steps == 20 and measured[A].first_step == 4
    with pytest.raises(ValueError):
        Calibrator(peers, window_s=math.inf)
    with pytest.raises(ValueError):
        Calibrator(peers, window_s=-1.0)


def test_enough_steps_close_the_window_before_window_s():
    # 0.1 s steps on a quiet machine: a 40-step run never spans 4 s after its first epoch, and 16 steps are
    # what 4 s of loaded 0.25 s steps would have averaged
    peers, now = Peers(), [0.0]
    cal = Calibrator(peers, after_steps=4, window_steps=4, every_s=1.0, clock=lambda: now[0], window_s=4.0)
    set_steps(peers, 4)
    assert cal.observe(PLAN) is None  # opened at t = 0
    now[0] = 1.0
    set_steps(peers, 14)
    assert cal.observe(PLAN) is None, "10 steps in 1 s: neither enough steps nor enough seconds"
    now[0] = 2.0
    set_steps(peers, 24)
    measured = cal.observe(PLAN)
    assert measured is not None and measured[A].steps == 20 and measured[A].first_step == 4
    with pytest.raises(ValueError):
        Calibrator(peers, enough_steps=0)


@pytest.mark.parametrize("fault", ["silent", "wrong stage", "malformed"])
def test_a_silent_stranger_or_malformed_peer_holds_the_window(fault):
    peers, now = Peers(), [0.0]
    cal = Calibrator(peers, after_steps=0, window_steps=1, every_s=0.0, clock=lambda: now[0], window_s=0.0)
    set_steps(peers, 1)
    assert cal.observe(PLAN) is None
    set_steps(peers, 5, stage_of_b=0 if fault == "wrong stage" else 1)
    if fault == "silent":
        peers.replies[B] = None
    elif fault == "malformed":
        peers.replies[B].metrics["swarm_step_seconds_sum"] = math.nan
    for _ in range(3):
        assert cal.observe(PLAN) is None


def test_a_restarted_host_starts_its_window_again():
    peers = Peers()
    cal = Calibrator(peers, after_steps=0, window_steps=2, every_s=0.0, window_s=0.0)
    set_steps(peers, 5)
    assert cal.observe(PLAN) is None
    set_steps(peers, 1)  # counters went back: both start again from here
    assert cal.observe(PLAN) is None
    set_steps(peers, 2)
    assert cal.observe(PLAN) is None, "one step is not the window"
    set_steps(peers, 3)
    assert cal.observe(PLAN) is not None


def two_peer_input(rate: float = 1e6) -> PlanInput:
    eye = np.eye(2, dtype=bool)
    peers = (Peer(A, 1e12, 1e12), Peer(B, 1e12, 1e12))
    return PlanInput(peers, np.where(eye, 0.0, 0.0005), np.where(eye, np.inf, rate))


def test_calibrated_breakdown_takes_measured_compute_bytes_and_the_rest_as_overhead():
    spec = ModelSpec(layers=2, flops_per_layer=1e9, forward_bytes=50_000, backward_bytes=50_000,
                     gradient_bytes_per_layer=0, memory_bytes_per_layer=0, micro_batches=4, full_duplex=True,
                     tied_bytes=20_000)  # fmt: skip
    measured = {
        A: Measured(0.02, 0.5, 3, forward_bytes=1000.0, tied_bytes=2000.0),
        B: Measured(0.03, 0.45, 3, backward_bytes=500.0, tied_bytes=2000.0),
    }
    after, before = calibrated_breakdown(PLAN, two_peer_input(), spec, measured)
    # the measured compute replaces 1e9 / 1e12 per layer; the measured bytes the synthetic ones
    assert after.compute_s == pytest.approx(0.05)
    assert after.tied_s == pytest.approx(2000 / 1e6 + 0.001)
    assert before.tied_s == pytest.approx(20_000 / 1e6 + 0.001)
    # the stage clock (0.5 s, the longer) is the step: what the pipeline does not explain is overhead
    assert after.total_s == pytest.approx(0.5) and after.overhead_s > 0.3
    # a clock shorter than the modelled pipeline: no negative overhead, the model stands
    slow = {pid: Measured(1.0, 0.5, 3) for pid in (A, B)}
    after, _ = calibrated_breakdown(PLAN, two_peer_input(), spec, slow)
    assert after.overhead_s == 0.0 and after.total_s > 4.0


def test_calibration_keeps_each_ends_tied_bytes_apart():
    # the throttled experiment's 1 Mbit/s default cell (s22): stage 0 sent 5.8 kB forward per micro-batch and 4.8 kB
    # of tied gradient per step, stage 1 5.2 kB back and 14.1 kB; its steady steps (empty buckets) took 0.28 s.
    # One tied figure (the larger, on both directions) predicted 0.2975 s; each end's own predicts 0.278 s.
    spec = ModelSpec(layers=2, flops_per_layer=1e9, forward_bytes=50_000, backward_bytes=50_000,
                     gradient_bytes_per_layer=0, memory_bytes_per_layer=0, micro_batches=4, full_duplex=True,
                     tied_bytes=20_000)  # fmt: skip
    measured = {
        A: Measured(0.0109, 0.2147, 5, forward_bytes=5778.7, tied_bytes=4844.4),
        B: Measured(0.0111, 0.2142, 5, backward_bytes=5172.4, tied_bytes=14113.2),
    }
    links = two_peer_input(125e3)  # 1 Mbit/s and the shaper's 64 KiB bucket
    links = PlanInput(links.peers, links.delay_s, links.bandwidth_bytes_per_s, np.where(np.eye(2), 0.0, 65536.0))
    after, _ = calibrated_breakdown(PLAN, links, spec, measured)
    assert after.total_s == pytest.approx((4 * 5172.4 + 14113.2) / 125e3)
    both = measured_bytes(spec, PLAN.stages, measured)
    assert (both.tied_bytes, both.tied_bytes_last) == (4844.4, 14113.2)
    # one end sent nothing (a figure missing): the other's stands for both
    one = measured_bytes(spec, PLAN.stages, {A: measured[A], B: Measured(0.1, 0.1, 1)})
    assert (one.tied_bytes, one.tied_bytes_last) == (4844.4, 4844.4)


def test_message_bytes_come_from_the_ratio_counted_with_them_not_from_passes_read_mid_step():
    # stage 0 of 1F1B, read twice mid-step: 16 micro-batches' passes (32) between the readings, but 15 forward
    # messages of 1000 bytes sent (its backward passes ran ahead). Bytes over passes read 937.5 a message; the
    # fp32 counter moves with the bytes (4000 a message of 1000 elements): 1000 exactly
    fp32 = 'swarm_fp32_bytes_total{direction="forward",link="0"}'
    before = read_clock(metrics(0, 4, 4.0, 1.0, 16, fw=8000.0) | {fp32: 32000.0}, 0)
    after = read_clock(metrics(0, 8, 8.0, 2.0, 48, fw=23000.0) | {fp32: 92000.0}, 0)
    m = window(before, after)
    assert m.forward_bytes == pytest.approx(937.5) and m.forward_ratio == pytest.approx(0.25)
    spec = ModelSpec(layers=2, flops_per_layer=1.0, forward_bytes=7.0, backward_bytes=9.0,
                     gradient_bytes_per_layer=0, memory_bytes_per_layer=0, message_elements=1000.0)  # fmt: skip
    assert measured_bytes(spec, PLAN.stages, {A: m, B: Measured(0.1, 0.1, 1)}).forward_bytes == pytest.approx(1000)
    # no element count in the spec: bytes over passes as before
    unknown = dataclasses.replace(spec, message_elements=0.0)
    assert measured_bytes(unknown, PLAN.stages, {A: m}).forward_bytes == pytest.approx(937.5)
    # a reply whose bytes outgrow their fp32 size many times over is refused, as are fp32 counters that went back
    assert window(before, read_clock(metrics(0, 8, 8.0, 2.0, 48, fw=9e9) | {fp32: 92000.0}, 0)) is None
    assert window(before, read_clock(metrics(0, 8, 8.0, 2.0, 48, fw=23000.0) | {fp32: 1.0}, 0)) is None
    assert read_clock(metrics(0, 8, 8.0, 2.0, 48) | {fp32: math.nan}, 0) is None
    assert ModelSpec.transformer(TransformerShape(2, 64, 16, micro_batch_size=2)).message_elements == 2 * 16 * 64


def test_calibration_prices_the_replicas_sums_at_the_bytes_they_sent():
    # a 2x2 swarm at 1 Mbit/s (s44's throttled cell): the cost model's 8-bit sums predicted 3.29 s for a 0.61 s
    # step; each replica sent its 2-bit sum, 66 kB, to its one partner. Priced at what they sent, the sums take 0.53 s
    a2, b2 = "a2" * 12, "b2" * 12
    plan = two_stages(3, A, B).document
    plan = plan.replace(stages=tuple(dataclasses.replace(st, peer_ids=(st.peer_ids[0], x))
                                     for st, x in zip(plan.stages, (a2, b2), strict=True)))  # fmt: skip
    spec = ModelSpec(layers=2, flops_per_layer=1e9, forward_bytes=5_000, backward_bytes=5_000,
                     gradient_bytes_per_layer=260_000, memory_bytes_per_layer=0, micro_batches=4,
                     full_duplex=True)  # fmt: skip
    sums = {pid: Measured(0.01, 0.61, 8, average_bytes=66_000.0) for pid in (A, a2, B, b2)}
    priced = measured_bytes(spec, plan.stages, sums)
    layers = len(plan.stages[0].layers)
    assert priced.gradient_bytes_per_layer == pytest.approx(66_000.0 / layers)
    ids = (A, a2, B, b2)
    eye = np.eye(4, dtype=bool)
    links = PlanInput(tuple(Peer(p, 1e12, 1e12) for p in ids), np.where(eye, 0.0, 0.0005), np.where(eye, np.inf, 125e3))
    after, before = calibrated_breakdown(plan, links, spec, sums)
    assert after.sync_s == pytest.approx(66_000 / 125e3, rel=0.01) and after.sync_s < before.sync_s / 3
    # one replica a stage sums nothing: its figure (0) leaves the spec's
    alone = measured_bytes(spec, PLAN.stages, {A: Measured(0.1, 0.1, 1, average_bytes=0.0), B: Measured(0.1, 0.1, 1)})
    assert alone.gradient_bytes_per_layer == 260_000


def test_measured_bytes_keeps_the_synthetic_figure_where_nothing_was_sent():
    spec = ModelSpec(layers=2, flops_per_layer=1.0, forward_bytes=7.0, backward_bytes=9.0,
                     gradient_bytes_per_layer=0, memory_bytes_per_layer=0, tied_bytes=3.0)  # fmt: skip
    same = measured_bytes(spec, PLAN.stages, {A: Measured(0.1, 0.1, 1), B: Measured(0.1, 0.1, 1)})
    assert (same.forward_bytes, same.backward_bytes, same.tied_bytes) == (7.0, 9.0, 3.0)


def test_the_planner_republishes_the_stages_with_the_calibrated_prediction():
    current = two_stages(4, A, B, trainer_ids=[], step_time_s=0.05)
    records = {"peers": [peer(A, 4), peer(B, 4)], "plan": [(A, current)]}
    dht, published = swarm(A, records)
    peers = Peers()
    cal = Calibrator(peers, after_steps=0, window_steps=2, every_s=0.0, window_s=0.0)
    planner = make_planner(dht, calibrator=cal)
    set_steps(peers, 1)
    assert planner.round() is None and published == []
    set_steps(peers, 3)
    record = planner.round()
    assert isinstance(record, PlanRecord) and record.version == 5
    version, plan = published[0]
    assert plan["stages"] == current.document.to_wire()["stages"] and plan["trainer_ids"] == []
    assert plan["step_time_s"] == pytest.approx(0.3)  # stage 0's clock: 0.3 s per step over the window
    assert plan["breakdown"]["compute_s"] == pytest.approx(0.07)  # the measured 0.04 + 0.03 s per micro-batch
    assert plan["breakdown"]["overhead_s"] > 0.05 and set(plan["measured"]) == {A, B}
    assert plan["first_step_time_s"] == 0.05  # the plan's own prediction before, kept for the report
    assert planner.round() is None, "published once"


def test_a_calibrated_plan_chooses_its_epilogue_only_compression_again_from_the_measured_clocks():
    # the announced block speeds leave out the last stage's head and loss; the calibration's clocks have them
    current = two_stages(4, A, B, trainer_ids=[], step_time_s=0.05)
    records = {"peers": [peer(A, 4), peer(B, 4)], "plan": [(A, current)]}
    dht, published = swarm(A, records)
    peers = Peers()
    calls = []

    def choose(stages, plan_input, spec, measured_s=None, links=None):
        calls.append(measured_s)
        return "fp32:1:1f1b:4" if measured_s is not None else "fp32:4:1f1b:4"

    cal = Calibrator(peers, after_steps=0, window_steps=2, every_s=0.0, window_s=0.0)
    planner = make_planner(dht, calibrator=cal, epilogue_only=choose)
    set_steps(peers, 1)
    assert planner.round() is None
    set_steps(peers, 3)
    assert planner.round() is not None
    ((_, plan),) = published
    assert plan["bw_epilogue"] == "fp32:1:1f1b:4"
    assert calls == [[pytest.approx(0.04), pytest.approx(0.03)]]  # each stage's seconds a micro-batch, measured
