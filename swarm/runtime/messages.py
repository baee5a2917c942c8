"""The stage host's calls, Step order, Grads report and Status, as plain dataclasses.

The host works with these; the servicer (`swarm.runtime.service`) turns a call's CallInfo into a `CallInfo`
(`swarm.runtime.callinfo.info_from_wire`) and a StepRequest into a `StepOrder`, and the host's `GradReport` and
`StageStatus` into their protobuf replies, field by field of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = [
    "CallInfo",
    "GradReport",
    "ReduceOrder",
    "ReduceReport",
    "StageCall",
    "StageStatus",
    "StepOrder",
    "from_wire",
]


def from_wire(cls, message):
    """The dataclass `cls` of a protobuf `message` with fields of the same names: every field as it came,
    repeated ones as tuples."""
    values = {f.name: getattr(message, f.name) for f in fields(cls)}
    return cls(**{k: v if isinstance(v, str | int | float) else tuple(v) for k, v in values.items()})


@dataclass(frozen=True)
class CallInfo:
    """What a Forward, Backward or PutLabels says about itself (`stage.proto`'s CallInfo, field for field).

    Fields at proto3's defaults mean what the stage reads for them: `num_micro_batches` 0 is 1, `schedule` ""
    is 1f1b, `deadline_s` 0 is 120 s, `loss_weight` 0 is 1 / num_micro_batches (`swarm.runtime.callinfo`)."""

    step: int = 0
    micro_batch: int = 0
    stage: int = 0
    """the stage the caller addresses"""
    plan_version: int = 0
    num_micro_batches: int = 0
    schedule: str = ""
    route: tuple[str, ...] = ()
    """gRPC address of every stage of the call's route, in pipeline order (empty: the stage's plan gives it)"""
    route_peers: tuple[str, ...] = ()
    """peer id of every stage of the route"""
    deadline_s: float = 0.0
    loss_weight: float = 0.0
    chain: int = 0
    """the route the call runs on (`Route.index`; named as the wire's `CallInfo.chain`)"""
    stage_micro: tuple[int, ...] = ()
    """uneven replica counts: the micro-batch's index at each stage's replica (empty: `micro_batch`)"""
    stage_micro_count: tuple[int, ...] = ()
    tied: bool = False
    """an Average of the tied group"""
    loss_scale: float = 0.0
    attempt_id: int = 0
    """the trainer's attempt of the step (0: none)"""


@dataclass
class StageCall:
    """One Forward or Backward as the host takes it: its info, and its payload as it came (the tensor message
    that the stage's links decode, or the token batch into stage 0), read and bounded at the edge."""

    info: CallInfo
    message: object | None = None
    """the tensor message (`swarm.compression` wire format), None for a token batch or nothing"""
    tokens: object | None = None
    """the token batch into stage 0"""
    parsed: tuple | None = None
    """checked (tokens, sample ids) of `tokens`, once the stage has admitted the call"""


@dataclass(frozen=True)
class StepOrder:
    """The trainer's Step: apply the step's gradients (or skip it, or abandon it)."""

    step: int
    global_grad_norm: float = 0.0
    abandon: bool = False
    """drop the step's gradients instead of stepping"""
    plan_version: int = 0
    skip: bool = False
    """the global norm is not finite: drop the gradients and back the loss scale off"""
    loss_scale: float = 0.0
    """the scale the step's gradients were computed with (0: not known)"""
    trainer_elapsed_s: float = 0.0
    """the trainer's time in this step so far (the stage times the whole step for the planner's calibration)"""
    frozen_layers: int = 0
    """layers [0, n) frozen from the next step on"""
    attempt_id: int = 0
    """with `abandon`: the attempt abandoned (0: none)"""
    tied_grad_sum: bool = False
    """whether the request carried the retired tied gradient (the end stages sum it in Reduce): refused"""
    want_digest: bool = False
    """reply with sampled digests of the weights after this step (`swarm.runtime.verify`)"""
    digest_stride: int = 0
    """the digests hash every digest_stride-th weight element"""
    digest_seed: int = 0
    """this step's offset draw for the digest"""
    previous_digest_seed: int = 0
    """the previous step's draw, to hash again (0: none): shows whether the weights moved"""


@dataclass(frozen=True)
class ReduceOrder:
    """The trainer's Reduce: sum the step's gradients with these replicas (and the tied group's, at an end stage)."""

    step: int
    plan_version: int = 0
    stage: int = 0
    group_peers: tuple[str, ...] = ()
    """the replicas taking part, in summation order; this peer among them"""
    group_addresses: tuple[str, ...] = ()
    deadline_s: float = 0.0
    """how long to wait for every other replica's gradients (0: the budget's longest wait)"""
    tied_peers: tuple[str, ...] = ()
    """the tied group (first and last stages' replicas), empty off the end stages"""
    tied_addresses: tuple[str, ...] = ()
    attempt_id: int = 0
    """the trainer's attempt of the step (`CallInfo.attempt_id`): this Reduce's Average streams carry it"""


@dataclass(frozen=True)
class ReduceReport:
    """What a Reduce sent: to the stage group and to the tied group, beside what fp32 would have cost."""

    wire_bytes: int = 0
    fp32_wire_bytes: int = 0
    group_size: int = 0
    tied_wire_bytes: int = 0
    tied_fp32_wire_bytes: int = 0


@dataclass(frozen=True)
class GradReport:
    """A stage's gradients, for the trainer's global norm and freezing criterion."""

    grad_sq_norm: float
    """squared norm (stage 0 counts the tied group's sum, the last stage not; +Inf: Inf/NaN found)"""
    loss_scale: float
    """the loss scale the step was computed with (1: unscaled)"""
    layer_sq_norms: tuple[float, ...] = ()
    """each of the stage's blocks' squared norm, in layer order"""


@dataclass(frozen=True)
class StageStatus:
    """What a stage is and has done (`swarm status`, heartbeats of the planner, the trainer's model check)."""

    peer_id: str
    stage: int
    layer_start: int
    layer_end: int
    plan_version: int
    steps_done: int
    compute_layers_per_s: float
    buffered_samples: int
    device: str
    weights_digest: str
    """SHA-256 (hex) of the stage's parameters: equal on replicas in step"""
    replica: int
    last_step: int
    """the last step this stage applied (0: none yet)"""
    model_identity: str
    step_open: bool = False
    """a step is open on this stage (between its first admitted call and its Step or abandon)"""
    metrics: dict[str, float] = field(default_factory=dict)
    """the host's counters and gauges, keyed as swarm.metrics snapshots"""
