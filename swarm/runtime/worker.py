"""One pipeline stage's compute: forward and backward per micro-batch, and the optimizer step.

`StageWorker` is pure compute with no transport. The in-process runtime (`swarm.runtime.inprocess`) calls it
directly; a gRPC servicer calls the same methods after decoding a message, so both paths share one
implementation of what a stage does. Everything a stage needs to know about the rest of the pipeline
arrives as arguments: the gradient of the objective with respect to its output, the global gradient
norm for clipping, and the sum of the tied embedding's gradients.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from swarm.model.gpt import Stage
from swarm.runtime.precision import PRECISIONS, LossScaler, ScalerConfig, autocast

__all__ = ["OptimConfig", "StageConfig", "lr_at", "StageWorker", "PRECISIONS"]

log = logging.getLogger("swarm.runtime.worker")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay, and clipping by the global gradient norm."""

    lr_peak: float = 2e-3
    """Learning rate reached at the end of the warm-up (the default model spiked at 3e-3)."""
    lr_min_ratio: float = 0.1
    """Learning rate at the end of the cosine, as a fraction of `lr_peak`."""
    warmup_steps: int = 40
    """Optimizer steps of linear warm-up from 0. About 2 / (1 - beta2) (Ma & Yarats 2021): reaching the peak
    within Adam's second-moment horizon (10 steps at beta2 0.95) spiked the default model's loss from 3.7 to
    8.2 as it left the unigram plateau; see scripts/loss_spike.py."""
    total_steps: int = 1000
    """Optimizer steps the cosine spans; the rate stays at its minimum afterwards."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices (embeddings, linear weights); none on norms."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """Adam's epsilon (added to the root of the second moment)."""
    grad_clip_norm: float | None = 1.0
    """Clip the global gradient norm (all stages, tied embedding counted once) to this; None = off."""

    def __post_init__(self) -> None:
        if self.lr_peak <= 0 or not 0 <= self.lr_min_ratio <= 1:
            raise ValueError("need lr_peak > 0 and 0 <= lr_min_ratio <= 1")
        if not self.eps > 0 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError("need eps > 0 and 0 <= betas < 1")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("need warmup_steps >= 0 and total_steps >= 1")


@dataclass(frozen=True)
class StageConfig:
    """How a stage computes and learns."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    autocast_bf16: bool = False
    """Run the forward under bf16 autocast (weights and optimizer state stay fp32); the same as precision "bf16"."""
    precision: str = "fp32"
    """Compute precision: "fp32", "bf16" (autocast) or "fp16" (autocast with dynamic loss scaling agreed by
    every stage: a stage finding Inf/NaN makes every stage skip the step and lower the scale). Master weights
    and optimizer state stay fp32."""
    device: str = "cpu"
    """Where the stage computes ("cpu", "cuda", "cuda:N")."""
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    """fp16's dynamic loss scaling (every stage of a pipeline must use the same)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.autocast_bf16 and self.precision == "fp16":
            raise ValueError("autocast_bf16 means precision bf16, not fp16")

    @property
    def compute_precision(self) -> str:
        """The precision the stage computes in: `precision`, or "bf16" where only `autocast_bf16` says so."""
        return "bf16" if self.autocast_bf16 else self.precision


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to the minimum."""
    if step < cfg.warmup_steps:
        return cfg.lr_peak * (step + 1) / cfg.warmup_steps
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    ratio = cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr_peak * ratio


class StageWorker:
    """Owns one stage's module, optimizer and the tensors saved between a micro-batch's F and B.

    Args:
        module: the stage (from `swarm.model.gpt.build_stage`).
        cfg: optimizer, schedule and precision.
    """

    def __init__(self, module: Stage, cfg: StageConfig | None = None) -> None:
        self.module = module
        self.cfg = cfg or StageConfig()
        self.step_count = 0
        decay = [p for p in module.parameters() if p.dim() >= 2]
        no_decay = [p for p in module.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.optim.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        self.optimizer = torch.optim.AdamW(
            groups, lr=lr_at(self.cfg.optim, 0), betas=self.cfg.optim.betas, eps=self.cfg.optim.eps
        )
        # Per micro-batch: (input that needs a gradient or None, output) saved by forward for backward.
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.peak_in_flight = 0
        self.precision = self.cfg.compute_precision
        if self.precision == "fp16" and torch.device(self.cfg.device).type == "cpu":
            log.warning("fp16 on the CPU works but is slow (no fp16 matmul: 11x fp32's step measured); bf16 is not")
        self.scaler = LossScaler(self.cfg.scaler) if self.precision == "fp16" else None
        """fp16's loss scale (None: unscaled); advanced by every `step`, skipped or applied"""
        self.found_inf = False
        """this step met Inf/NaN in this stage's gradients or activations (fp16): it must be skipped"""
        self.skipped_steps = 0
        self.frozen_layers = 0
        """layers [0, frozen_layers) of the model are frozen (`swarm.runtime.freeze.set_frozen`)"""
        self.input_grad = not module.is_first
        """something before this stage trains: its input needs a gradient, sent upstream by backward"""
        self.forward_only = False
        """nothing here or before trains: forward keeps nothing and no backward comes"""
        self.frozen_sent: dict[str, set[int]] = {}
        """forward only: samples sent in full since the freeze, per next-stage address (the activation cache)"""
        self.cache_hits = 0
        """forward only: samples answered from the activation cache without computing"""
        self.probe = None
        """a `swarm.runtime.sensitivity_probe.SensitivityProbe` measuring this stage's sensitivity now and then"""

    @property
    def loss_scale(self) -> float:
        """The scale this stage's gradients are computed with this step (1.0 unscaled)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward has run and backward has not (their activations are held)."""
        return len(self._saved)

    def forward(
        self,
        mb: int,
        inputs: torch.Tensor,
        sample_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run micro-batch `mb` forward and keep what its backward needs.

        Args:
            mb: micro-batch index within the step; must not be in flight already.
            inputs: token ids [B, T] on the first stage; elsewhere the activation as the receiver sees it
                (for AQ-SGD, the message buffer m, not the sender's true activation).
            sample_ids: ids of the rows; unused by the compute, accepted so every caller passes the same
                arguments (the boundary codecs key their buffers by them).
            targets: next tokens [B, T]; the last stage returns the loss when given.

        Returns:
            The output, detached: the activation [B, T, D], or on the last stage the mean loss (scalar).
        """
        del sample_ids
        if mb in self._saved:
            raise RuntimeError(f"micro-batch {mb} is already in flight on this stage")
        if self.probe is not None and not self.forward_only:
            self.probe.capture(self.step_count, mb, inputs, targets)
        x = inputs
        if not self.module.is_first:
            x = inputs.detach().requires_grad_(self.input_grad)
        with autocast(self.precision, self.cfg.device), torch.set_grad_enabled(not self.forward_only):
            out = self.module(x, targets) if self.module.is_last else self.module(x)
        if not self.forward_only:  # frozen through here: no backward will come
            self._saved[mb] = (x if x.requires_grad else None, out)
        self.peak_in_flight = max(self.peak_in_flight, len(self._saved))
        out = out.detach().float()  # the boundary codecs take fp32 (the loss is fp32 already)
        if self.scaler is not None and not bool(torch.isfinite(out).all()):
            # fp16 overflow in the forward: the step will be skipped everywhere; send finite zeros meanwhile
            self.found_inf = True
            out = torch.zeros_like(out) if not self.module.is_last else out
        return out

    def backward(self, mb: int, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Backpropagate micro-batch `mb`, accumulating parameter gradients, and free its activations.

        Args:
            mb: a micro-batch whose forward has run.
            grad_out: gradient of the step's objective with respect to this stage's output: for the last
                stage, the weight of this micro-batch's loss in the step's loss (a scalar, e.g.
                1 / n_micro); elsewhere the decoded gradient from the next stage.

        Returns:
            The gradient with respect to this stage's input (to send to the previous stage), or None on
            the first stage.
        """
        x, out = self._saved.pop(mb)
        if self.scaler is None:
            backward(out, grad_out.to(out.dtype).reshape(out.shape))
            grad_in = None if x is None else x.grad
        else:
            grad_in = self._scaled_backward(x, out, grad_out)
        if self.probe is not None:  # now and then: this micro-batch again in fp32 and lower (sensitivity_probe)
            self.probe.measure(self.step_count, mb, self.module, grad_out)
        return grad_in

    def _scaled_backward(self, x: torch.Tensor | None, out: torch.Tensor, grad_out: torch.Tensor):
        """fp16: backward of `grad_out` x scale, on top of the gradients so far times the scale, then everything
        divided by the scale again (exact: a power of two) and checked for Inf/NaN in one fused pass. A stage
        that finds any drops its gradients (zeros travel on) and marks the step to be skipped."""
        scale = self.scaler.scale
        params = [p for p in self.module.parameters() if p.requires_grad]
        held = [p.grad for p in params if p.grad is not None]
        if held:
            torch._foreach_mul_(held, scale)
        backward(out, (grad_out.float() * scale).to(out.dtype).reshape(out.shape))
        grads = [p.grad for p in params if p.grad is not None] + ([x.grad] if x is not None else [])
        found = torch.zeros(1, device=out.device)
        if grads:
            inv = torch.full((1,), 1.0 / scale, device=out.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        if bool(found.item()):
            self.found_inf = True
        if self.found_inf:
            for p in params:
                p.grad = None
            return None if x is None else torch.zeros_like(x)
        return None if x is None else x.grad

    # Between the last backward and `step`, the runtime synchronises the tied embedding and computes the
    # global gradient norm; over the network both are small exchanges of one tensor or one number.

    def tied_grad(self) -> torch.Tensor | None:
        """The gradient of this stage's copy of the tied embedding (zeros if it received none)."""
        param = self.module.tied_parameter()
        if param is None:
            return None
        return torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()

    def set_tied_grad(self, grad: torch.Tensor) -> None:
        """Replace this stage's tied-embedding gradient by `grad` (the sum over both copies)."""
        param = self.module.tied_parameter()
        if param is None:
            raise RuntimeError("this stage holds no tied embedding")
        param.grad = grad.detach().to(param.device, param.dtype, copy=True)

    def grad_sq_norm(self) -> float:
        """Sum of squared gradients of this stage's parameters; the last stage's tied copy is left out when
        the first stage holds the original, so the global norm counts the tied weight once."""
        if self.found_inf:
            return math.inf
        skip = self.module.tied_parameter() if not self.module.is_first else None
        total = 0.0
        for p in self.module.parameters():
            if p.grad is not None and p is not skip:
                total += float(p.grad.detach().float().pow(2).sum())
        return total

    def step(self, global_grad_norm: float | None = None) -> float:
        """Clip by the global norm, take one optimizer step at the scheduled rate, zero the gradients. A
        non-finite norm skips the step instead: the gradients are dropped, the optimizer and the learning-rate
        schedule do not move, and the loss scale backs off (fp16).

        Args:
            global_grad_norm: the norm over all stages (from every stage's `grad_sq_norm`); None uses this
                stage's own, which is right only for a single-stage pipeline.

        Returns:
            The learning rate used (0.0 for a skipped step).
        """
        if self._saved:
            raise RuntimeError(f"step with micro-batches still in flight: {sorted(self._saved)}")
        optim = self.cfg.optim
        norm = math.sqrt(self.grad_sq_norm()) if global_grad_norm is None else global_grad_norm
        skipped = not math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(skipped)
        self.found_inf = False
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return 0.0
        if optim.grad_clip_norm is not None and norm > optim.grad_clip_norm:
            scale = optim.grad_clip_norm / (norm + 1e-6)
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        lr = lr_at(optim, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return lr

    def saved_shape(self, mb: int) -> torch.Size | None:
        """The output shape of micro-batch `mb` while its backward has not run (None if not in flight)."""
        saved = self._saved.get(mb)
        return None if saved is None else saved[1].shape

    def zero_grad(self) -> None:
        """Drop accumulated gradients and in-flight activations (e.g. after an aborted step); the scale stays."""
        self.optimizer.zero_grad(set_to_none=True)
        self._saved.clear()
        self.found_inf = False

    @torch.no_grad()
    def infer(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Forward without keeping anything for backward (evaluation); fp32 out, like `forward`."""
        with autocast(self.precision, self.cfg.device):
            out = self.module(inputs, targets) if self.module.is_last else self.module(inputs)
        return out.float()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}


def backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """`out.backward(grad)` without what `torch.autograd.backward` imports for an explicit gradient (torch.fx's
    symbolic shapes, and with them sympy: 38 MB of RSS in every peer, `swarm bench footprint`). The gradient of
    sum(out * grad) with respect to `out` is 1 * grad, which is `grad` exactly, so every gradient is the same."""
    (out * grad).sum().backward()
