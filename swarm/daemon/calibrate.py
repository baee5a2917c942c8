"""The planner's prediction from what the plan's own peers measured in this run.

A block timed alone (`measure_compute`) is several times faster per layer than the same stage inside the
pipeline (encode and decode, the gRPC calls, the GIL shared with the transport), and a step holds more than
the pipeline (`Reduce`, `Grads`, `Step`, the trainer's calls). So once the peers of a plan have trained a few
steps, the planner reads each one's clocks from its `Status` (the host's metrics, nothing new on the wire):

- seconds per micro-batch of its stage: the forward, backward, encode and decode phases' time over the
  forward and backward passes (`swarm_phase_seconds`), over a window of steps;
- seconds per step: the whole step as the trainer saw it up to its `Step` (`StepRequest.trainer_elapsed_s`)
  plus the stage's Step (phase "trainer"), else as the stage saw it (its first call to its `Step`:
  `swarm_step_seconds`, which misses the trainer's own work before its first call and after `Step`), same window;
- bytes it sent each way and for the tied gradient (`swarm_wire_bytes_total`), same window.

`calibrated_breakdown` then re-predicts the plan: each peer's compute speed from its stage's measured
seconds per micro-batch, the links as probed carrying the bytes the stages measured sending (per micro-batch
each way, the tied gradient per step: real deltas compress better than the planner's synthetic ones), and a
per-step overhead equal to what the longest stage clock
measured beyond that pipeline (everything in a step that is not compute or link time; never below 0). The
planner publishes the plan again with that prediction (same stages: a peer only bumps its version). The
window starts `after_steps` into the plan (AQ-SGD's first sight of every sample, full messages, is over after
one epoch) and the figures are taken once per set of stages: the prediction is made during the run, from the
run's own early steps, and then compared with the steps that follow it.

A `Status` reply comes from a peer the signed announcements name; its figures are checked whole (finite,
non-negative, counters that only grow, within `MAX_SECONDS`) and a peer whose clocks do not read that way is
left out of the window, which then waits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from swarm.peers.plan import PlanDocument, PlanStage
from swarm.scheduler import ModelSpec, PlanInput
from swarm.scheduler.plans import Breakdown

__all__ = ["Calibrator", "calibrator", "StageClock", "Measured", "calibrated_breakdown", "read_clock", "status_reader"]

log = logging.getLogger("swarm.daemon.calibrate")

WORK_PHASES = ("compute", "encode", "decode")
MAX_SECONDS = 1e7
"""Largest clock sum taken from a peer (about 4 months of one stage's work): beyond it a reply is refused."""
MAX_COUNT = 1e12
MAX_RATIO = 4.0
"""Most bytes on the wire per fp32 byte taken from a peer (fp32 sends 1 plus its framing)."""
MAX_BYTES = 1e18


@dataclass(frozen=True)
class StageClock:
    """A stage's cumulative clocks as its `Status` reported them."""

    steps: int
    step_s: float
    work_s: float
    passes: int
    """Forward and backward passes its compute phase timed (two per micro-batch)."""
    sent: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    """Bytes it put on the wire: forward to the next stage, backward to the previous, the tied gradient, its stage's
    gradient sum (to its replicas)."""
    trainer: tuple[int, float] = (0, 0.0)
    """Steps timed whole (the trainer's time up to its `Step` plus the stage's Step: phase "trainer") and their
    seconds."""
    fp32: tuple[float, float] = (0.0, 0.0)
    """The fp32 size of what it sent forward and backward (`swarm_fp32_bytes_total`), counted with `sent`."""


@dataclass(frozen=True)
class Measured:
    """One stage's figures over a window of steps."""

    micro_batch_s: float
    """Forward + backward + encode + decode of one micro-batch, seconds."""
    step_s: float
    """Mean step as the stage saw it, seconds."""
    steps: int
    forward_bytes: float = 0.0
    """Bytes it sent forward per micro-batch (0 on the last stage)."""
    backward_bytes: float = 0.0
    """Bytes it sent backward per micro-batch (0 on the first stage)."""
    tied_bytes: float = 0.0
    """Bytes of the tied gradient it sent per step, to every other member of the tied group together."""
    first_step: int = 0
    """Steps the stage had done when the window opened: the window is its steps first_step + 1 onwards (the
    experiment compares its clock with the trainer's own over the same steps)."""
    forward_ratio: float = 0.0
    """Bytes it sent forward over their fp32 size (0: none sent). Counted together, the two agree at any moment;
    bytes over passes do not (a reading mid-step finds forward and backward passes apart: the 1 Mbit/s fp32 cell
    read its forward 6% under and its backward 6% over what each message was, h/cal's run r1)."""
    backward_ratio: float = 0.0
    """Bytes it sent backward over their fp32 size (0: none sent)."""
    average_bytes: float = 0.0
    """Bytes of its stage's gradient sum it sent per step, to every other replica of the stage together (0: one
    replica)."""


def _figure(metrics: Mapping[str, float], key: str, most: float) -> float | None:
    value = metrics.get(key, 0.0)
    if type(value) is not float or not math.isfinite(value) or not 0.0 <= value <= most:
        return None
    return value


def read_clock(metrics: Mapping[str, float], stage: int) -> StageClock | None:
    """The clocks of `stage` from a `StatusReply.metrics` map; None when any figure is missing or malformed."""
    values = [
        _figure(metrics, "swarm_step_seconds_count", MAX_COUNT),
        _figure(metrics, "swarm_step_seconds_sum", MAX_SECONDS),
        _figure(metrics, f'swarm_phase_seconds_count{{phase="compute",stage="{stage}"}}', MAX_COUNT),
    ]
    work = [
        _figure(metrics, f'swarm_phase_seconds_sum{{phase="{p}",stage="{stage}"}}', MAX_SECONDS) for p in WORK_PHASES
    ]
    sent = [
        _figure(metrics, f'swarm_wire_bytes_total{{direction="{d}",link="{link}"}}', MAX_BYTES)
        for d, link in (("forward", stage), ("backward", stage - 1), ("tied", "tied"), ("average", "average"))
    ]
    fp32 = [
        _figure(metrics, f'swarm_fp32_bytes_total{{direction="{d}",link="{link}"}}', MAX_BYTES)
        for d, link in (("forward", stage), ("backward", stage - 1))
    ]
    whole = [
        _figure(metrics, f'swarm_phase_seconds_count{{phase="trainer",stage="{stage}"}}', MAX_COUNT),
        _figure(metrics, f'swarm_phase_seconds_sum{{phase="trainer",stage="{stage}"}}', MAX_SECONDS),
    ]
    if any(v is None for v in (*values, *work, *sent, *whole, *fp32)):
        return None
    steps, step_s, passes = values
    if steps != int(steps) or passes != int(passes) or whole[0] != int(whole[0]):
        return None
    whole_steps = (int(whole[0]), whole[1])
    return StageClock(int(steps), step_s, float(sum(work)), int(passes), tuple(sent), whole_steps, tuple(fp32))


def window(before: StageClock, after: StageClock) -> Measured | None:
    """The figures between two readings; None unless every counter grew (a restarted host starts again)."""
    steps, passes = after.steps - before.steps, after.passes - before.passes
    step_s, work_s = after.step_s - before.step_s, after.work_s - before.work_s
    sent = [a - b for a, b in zip(after.sent, before.sent, strict=True)]
    fp32 = [a - b for a, b in zip(after.fp32, before.fp32, strict=True)]
    if steps < 1 or passes < 2 or step_s <= 0 or work_s <= 0 or min(sent) < 0 or min(fp32) < 0:
        return None
    ratios = [s / f if f > 0 else 0.0 for s, f in zip(sent[:2], fp32, strict=True)]  # forward, backward
    if not all(math.isfinite(r) and r <= MAX_RATIO for r in ratios):
        return None  # no codec sends several times a message's fp32 size: a malformed or hostile reply
    micro = passes / 2
    timed, timed_s = after.trainer[0] - before.trainer[0], after.trainer[1] - before.trainer[1]
    if timed == steps and timed_s > 0:  # every step of the window timed whole, from the trainer's start
        step_s = timed_s
    return Measured(
        work_s / micro, step_s / steps, steps, sent[0] / micro, sent[1] / micro, sent[2] / steps, before.steps,
        *ratios, average_bytes=sent[3] / steps,
    )  # fmt: skip


class Calibrator:
    """Reads the plan peers' clocks and, once per set of stages, gives their figures over a window of steps.

    Args:
        read: peer id -> its `StatusReply` (None when it does not answer).
        after_steps: steps into the plan the window starts (every stage has done at least this many).
        window_steps: steps the window spans at least (every stage).
        every_s: least time between two readings of the peers.
        window_s: seconds the window spans at least. Steps on a shared machine vary: on 2 loaded cores a 0.2 s
            step read 0.13-0.43 s, and a window of 4-6 such steps (1 s) was 10-13% off the run's mean on its own
            noise (a mean of n steps is off by about its spread over root n); 4 s of steps halves that.
        enough_steps: a window of this many steps (every stage) closes whatever its seconds: what the seconds
            buy is steps to average, and a short run of fast steps never spans `window_s` (a quiet machine's
            40-step throttled cells at 0.12 s a step never calibrated under 4 s alone).
    """

    def __init__(
        self,
        read: Callable[[str], object | None],
        after_steps: int = 4,
        window_steps: int = 4,
        every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 4.0,
        enough_steps: int = 16,
    ):
        if after_steps < 0 or window_steps < 1 or every_s < 0 or not 0 <= window_s < math.inf or enough_steps < 1:
            raise ValueError(
                "Calibrator: need after_steps >= 0, window_steps >= 1, every_s >= 0, 0 <= window_s, enough_steps >= 1"
            )
        self.read, self.after_steps, self.window_steps = read, after_steps, window_steps
        self.enough_steps = enough_steps
        self.every_s, self.clock, self.window_s = every_s, clock, window_s
        self._key: tuple | None = None
        self._start: dict[str, StageClock] = {}
        self._opened: float | None = None
        self._done = False
        self._next = 0.0

    @property
    def done(self) -> bool:
        """Whether the window of the last plan observed closed (its figures were given)."""
        return self._done

    def observe(self, plan: PlanDocument) -> dict[str, Measured] | None:
        """Every plan peer's figures once the window is complete (then None again until the stages change)."""
        key = plan.stages
        if key != self._key:
            self._key, self._start, self._done, self._opened = key, {}, False, None
        if self._done or self.clock() < self._next:
            return None
        self._next = self.clock() + self.every_s
        now: dict[str, StageClock] = {}
        for index, stage in enumerate(key):
            for pid in stage.peer_ids:
                reply = self.read(pid)
                clock = None
                if reply is not None and getattr(reply, "stage", None) == index:
                    clock = read_clock(dict(reply.metrics), index)
                if clock is None:
                    return None  # every stage in the window, or none
                now[pid] = clock
        for pid, clock in now.items():
            start = self._start.get(pid)
            # not started yet, or its host restarted (its counters went back)
            if (start is None or clock.steps < start.steps) and clock.steps >= self.after_steps:
                self._start[pid] = clock
        if set(self._start) != set(now):
            self._opened = None
            return None
        if self._opened is None:
            self._opened = self.clock()  # every stage's start read: the window's seconds count from here
        measured = {pid: window(self._start[pid], clock) for pid, clock in now.items()}
        if any(m is None or m.steps < self.window_steps for m in measured.values()):
            return None
        if self.clock() - self._opened < self.window_s and any(m.steps < self.enough_steps for m in measured.values()):
            return None
        self._done = True
        return measured  # type: ignore[return-value]


def calibrated_breakdown(
    plan: PlanDocument, plan_input: PlanInput, spec: ModelSpec, measured: Mapping[str, Measured]
) -> tuple[Breakdown, Breakdown]:
    """(calibrated, uncalibrated) predictions of `plan`'s layout: each plan peer's compute speed from its stage's
    measured seconds per micro-batch, the probed links, and the step overhead the stage clocks measured beyond
    that pipeline (the longest clock: stage 0's, which sees the whole step; never below 0)."""
    from swarm.scheduler.cost import FullCost, Layout

    index = {p.peer_id: i for i, p in enumerate(plan_input.peers)}
    stages = plan.stages
    grid = np.array([[index[pid] for pid in st.peer_ids] for st in stages])
    layers = np.array([len(st.layers) for st in stages], dtype=np.int64)
    layout = Layout(grid, layers)
    before = FullCost(plan_input, dataclasses.replace(spec, step_overhead_s=0.0)).evaluate(layout)
    peers = list(plan_input.peers)
    for st, n in zip(stages, layers, strict=True):
        for pid in st.peer_ids:
            if pid in measured:
                speed = n * max(spec.flops_per_layer, 1.0) / measured[pid].micro_batch_s
                peers[index[pid]] = dataclasses.replace(peers[index[pid]], compute_flops_per_s=speed)
    calibrated = PlanInput(tuple(peers), plan_input.delay_s, plan_input.bandwidth_bytes_per_s, plan_input.burst_bytes)
    spec = measured_bytes(spec, stages, measured)
    pipeline = FullCost(calibrated, dataclasses.replace(spec, step_overhead_s=0.0)).evaluate(layout)
    step = max(m.step_s for m in measured.values())
    # what the step's phases (pipeline, sums) leave of the clock; the links' rate bound is no phase
    phases = pipeline.compute_s + pipeline.transfer_s + pipeline.latency_s + pipeline.steady_s
    overhead = max(0.0, step - phases - max(pipeline.sync_s, pipeline.tied_s))
    after = FullCost(calibrated, dataclasses.replace(spec, step_overhead_s=overhead)).evaluate(layout)
    return after, before


def measured_bytes(spec: ModelSpec, stages: Sequence[PlanStage], measured: Mapping[str, Measured]) -> ModelSpec:
    """`spec` with the bytes the peers sent: the busiest boundary's forward and backward bytes per micro-batch,
    the tied gradient's bytes per step and partner (each end-stage replica sends it to every other one), and the
    replicas' sums' bytes per partner and layer (whatever codec the plan's epilogue or the fixed policy sums with)."""
    last = len(stages) - 1
    if last < 1:
        return spec
    rows = [[measured[pid] for pid in st.peer_ids if pid in measured] for st in stages]
    fp32 = 4 * spec.message_elements  # a message's fp32 size: its measured ratio prices it exactly
    forward = [m.forward_ratio * fp32 if fp32 and m.forward_ratio else m.forward_bytes for r in rows[:last] for m in r]
    backward = [m.backward_ratio * fp32 if fp32 and m.backward_ratio else m.backward_bytes for r in rows[1:] for m in r]
    partners = len(stages[0].peer_ids) + len(stages[last].peer_ids) - 1
    # each end its own: the last stage's tied gradient can be 3x the first's, and the rate bound of a direction
    # is what its own sender puts on it (one figure for both read the larger on the smaller's direction: +7%)
    first = max((m.tied_bytes / partners for m in rows[0]), default=0.0)
    final = max((m.tied_bytes / partners for m in rows[last]), default=0.0)
    figures = {"forward_bytes": max(forward, default=0.0), "backward_bytes": max(backward, default=0.0)}
    figures |= {"tied_bytes": first or final, "tied_bytes_last": final or first}
    # a replica sends its whole sum to each other replica (`GradientAverager`): per partner and layer, the largest
    sums = [
        m.average_bytes / (len(st.peer_ids) - 1) / len(st.layers)
        for st, row in zip(stages, rows, strict=True) if len(st.peer_ids) > 1 and len(st.layers) for m in row
    ]  # fmt: skip
    figures["gradient_bytes_per_layer"] = max(sums, default=0.0)
    # the plan's links sent what they sent: measured bytes price them, not the per-link ladder they were chosen from
    ladder = None if figures["forward_bytes"] > 0 and figures["backward_bytes"] > 0 else spec.link_ladder
    return dataclasses.replace(spec, link_ladder=ladder, **{k: v for k, v in figures.items() if v > 0})


def calibrator(plans, channels, addresses: Callable[[], dict[str, str]]) -> Calibrator | None:
    """The planner's `Calibrator` of a peer's `PlanningConfig` (None: --calibrate-after-steps not given)."""
    if plans.calibrate_after_steps is None:
        return None
    return Calibrator(status_reader(channels, addresses), after_steps=plans.calibrate_after_steps)


def status_reader(channels, addresses: Callable[[], dict[str, str]], timeout_s: float = 1.0):
    """peer id -> its `StatusReply` over the stage service (None when it does not answer or has no address)."""
    import grpc

    from swarm.proto import stage_pb2, stage_pb2_grpc

    def read(pid: str):
        address = addresses().get(pid)
        if address is None:
            return None
        try:
            return stage_pb2_grpc.StageStub(channels.get(address)).Status(stage_pb2.Empty(), timeout=timeout_s)
        except grpc.RpcError:
            return None

    return read
