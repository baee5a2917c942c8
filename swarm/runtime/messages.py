"""The stage host's Step order, Grads report and Status, as plain dataclasses.

The host works with these; the servicer (`swarm.runtime.service`) turns a StepRequest into a `StepOrder` and
the host's `GradReport` and `StageStatus` into their protobuf replies, field by field of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GradReport", "StageStatus", "StepOrder"]


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
    metrics: dict[str, float] = field(default_factory=dict)
    """the host's counters and gauges, keyed as swarm.metrics snapshots"""
