"""A training stage measuring its own sensitivity to lower precision from its real gradients, now and then.

QSync's indicator (`swarm.runtime.sensitivity`) rated on the planner's side uses the model's initial weights and
synthetic inputs; the stage that trains has the real thing: the micro-batch it received and the gradient the next
stage sent back. Every `every_steps` steps (the first `settle_probes` times, then every `later_every_steps`), the
probe keeps micro-batch 0's input (and targets) when its forward runs, and when its backward has run recomputes
that micro-batch's forward and backward with the same output gradient in fp32 and in each low precision
(`gradient_sensitivity`), the step's accumulated gradients put back as they were. Its figure is the mean of the
probes so far (QSync uses the running mean of the first iterations: the relative values change little in
training). The peer announces it (`PeerAnnouncement.sensitivity`), and the planner plans with it
(`swarm.scheduler.precision_choice.announced_sensitivities`).

Cost: two extra forward+backward passes of one micro-batch per probe: with 4 micro-batches, 5% of the stage's
compute over the first `settle_probes * every_steps` steps, and about 0.5% afterwards at the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.runtime.precision import PRECISIONS
from swarm.runtime.sensitivity import MAX_SENSITIVITY, gradient_sensitivity

__all__ = ["ProbeConfig", "SensitivityProbe"]


@dataclass(frozen=True)
class ProbeConfig:
    """When a stage measures its sensitivity, and in which precisions."""

    every_steps: int = 5
    """steps between two probes while settling (0: never probe)"""
    settle_probes: int = 5
    """probes taken every `every_steps` before the interval widens"""
    later_every_steps: int = 100
    """steps between two probes afterwards"""
    precisions: tuple[str, ...] = ("bf16",)
    """the low precisions rated against fp32"""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.settle_probes < 0 or self.later_every_steps < 1:
            raise ValueError("ProbeConfig: need every_steps >= 0, settle_probes >= 0, later_every_steps >= 1")
        if not self.precisions or any(p not in PRECISIONS or p == "fp32" for p in self.precisions):
            raise ValueError(f"ProbeConfig: precisions must be low precisions of {PRECISIONS}, got {self.precisions}")


class SensitivityProbe:
    """One stage's sensitivity measurement (see the module docstring); owned by its `StageWorker` (`probe`), which
    calls `capture` in forward and `measure` in backward.

    Args:
        cfg: when to probe and in which precisions.
        device: the device type autocast runs on.
    """

    def __init__(self, cfg: ProbeConfig | None = None, device: str = "cpu"):
        self.cfg, self.device = cfg or ProbeConfig(), device
        self.sums = dict.fromkeys(self.cfg.precisions, 0.0)
        self.probes = 0
        """probes taken so far"""
        self._captured: tuple[int, torch.Tensor, torch.Tensor | None] | None = None
        self._last_step = -1

    def due(self, step: int) -> bool:
        """Whether the step numbered `step` (the optimizer steps applied before it) is probed."""
        cfg = self.cfg
        if cfg.every_steps == 0 or step == self._last_step:
            return False
        if self.probes < cfg.settle_probes:
            return step % cfg.every_steps == 0
        return step % cfg.later_every_steps == 0

    def capture(self, step: int, mb: int, inputs: torch.Tensor, targets: torch.Tensor | None) -> None:
        """In forward: keeps micro-batch 0's input of a probed step (replaces a capture whose backward never came:
        an abandoned attempt)."""
        if mb == 0 and self.due(step):
            kept = None if targets is None else targets.detach()
            self._captured = (step, inputs.detach(), kept)

    def measure(self, step: int, mb: int, module: torch.nn.Module, grad_out: torch.Tensor) -> dict[str, float] | None:
        """In backward, after the micro-batch's own backward: rates the captured micro-batch with the gradient
        that came back for it (None: nothing captured for this micro-batch and step)."""
        captured = self._captured
        if captured is None or mb != 0 or captured[0] != step:
            return None
        self._captured = None
        _, inputs, targets = captured
        figures = gradient_sensitivity(module, inputs, grad_out, self.cfg.precisions, targets, self.device)
        for p, figure in figures.items():
            self.sums[p] += figure
        self.probes += 1
        self._last_step = step
        return figures

    def figures(self) -> dict[str, float]:
        """The mean of the probes so far per precision, within [0, MAX_SENSITIVITY]; {} before the first probe."""
        if self.probes == 0:
            return {}
        return {p: min(s / self.probes, MAX_SENSITIVITY) for p, s in self.sums.items()}
