"""A step's commit record: what the trainer decided before it sent the step's first `Step`, so that a trainer
killed while the Steps were in flight can finish that step on the stages that missed it, never run it again.

The driver hands it to `PipelineDriver.on_commit` (the trainer writes it to its journal, `swarm.train.journal`);
`PipelineDriver.finish_step` sends it again after a restart. A Step for a step a stage applied already is
answered with the lr it used and changes nothing (`StepLedger.applied`), so sending the record twice is safe.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["StepCommit"]


@dataclass(frozen=True)
class StepCommit:
    """The Step every stage of a step gets, and what the trainer's row of that step needs."""

    step: int
    """the step (0-based, as the stages number it)"""
    grad_norm: float
    """the global gradient norm every stage clips by (not finite: every stage skips the step)"""
    loss_scale: float
    """the loss scale the step's gradients were computed with (0: not known)"""
    plan_version: int
    """the plan the step ran on: a stage that follows another refuses the Step"""
    loss: float
    """the step's mean training loss (for its row in steps.csv)"""
    peers: tuple[str, ...]
    """every replica the Step goes to, by peer id: the ones that ran the step"""

    def __post_init__(self) -> None:
        if type(self.step) is not int or self.step < 0 or type(self.plan_version) is not int or self.plan_version < 0:
            raise ValueError(f"StepCommit: step and plan_version must be integers >= 0, got {self.step}, "
                             f"{self.plan_version}")  # fmt: skip
        if not isinstance(self.peers, tuple) or not self.peers or not all(isinstance(p, str) for p in self.peers):
            raise ValueError(f"StepCommit.peers: expected a non-empty tuple of peer ids, got {self.peers!r}")
        for name in ("grad_norm", "loss_scale", "loss"):
            if not isinstance(getattr(self, name), int | float) or isinstance(getattr(self, name), bool):
                raise ValueError(f"StepCommit.{name}: expected a number, got {getattr(self, name)!r}")
        if not (self.loss_scale >= 0 and math.isfinite(self.loss_scale)):
            raise ValueError(f"StepCommit.loss_scale: expected a finite number >= 0, got {self.loss_scale}")

    @property
    def skip(self) -> bool:
        """Whether every stage skips the step (the norm is not finite: fp16 overflow)."""
        return not math.isfinite(self.grad_norm)

    def to_dict(self) -> dict:
        return {**asdict(self), "peers": list(self.peers)}

    @classmethod
    def from_dict(cls, d) -> StepCommit:
        """The record as written by `to_dict`; raises ValueError (naming the field) for anything else."""
        if not isinstance(d, dict):
            raise ValueError(f"a step commit must be an object, got {type(d).__name__}")
        fields = ("step", "grad_norm", "loss_scale", "plan_version", "loss", "peers")
        missing = [f for f in fields if f not in d]
        if missing:
            raise ValueError(f"a step commit lacks {', '.join(missing)}")
        peers = d["peers"]
        return cls(**{f: d[f] for f in fields[:-1]}, peers=tuple(peers) if isinstance(peers, list) else peers)
