"""Mixed precision for a stage: the autocast context, the dynamic loss scaler and the checks that keep the
stages of a pipeline agreed on it.

- "fp32": no autocast. "bf16": the forward under bf16 autocast (no scaling: bf16 has fp32's range).
  "fp16": the forward under fp16 autocast and dynamic loss scaling. Master weights and optimizer state stay
  fp32 in every precision; what a stage hands its boundary codecs is fp32.
- Loss scaling is agreed, not negotiated. Every fp16 stage runs the same deterministic `LossScaler`, and every
  stage sees the same decisions: the trainer sums the stages' squared gradient norms (`Grads`) and sends one
  global norm with `Step`; a non-finite norm means "skip" (`StepRequest.skip`, which must agree with it). A
  skipped step drops the gradients on every stage and replica, does not advance the optimizer or the
  learning-rate schedule (as `torch.amp.GradScaler`), and halves the scale everywhere; `growth_interval`
  applied steps in a row double it. The scale a stage holds travels in `GradReply.loss_scale` and
  `StepReply.loss_scale`; the trainer names it in every call (`CallInfo.loss_scale`, `StepRequest.loss_scale`)
  and a stage holding another one refuses the call before computing anything.
- How a stage scales: the last stage multiplies its loss weight by the scale; every stage multiplies the
  gradient it receives by the scale before its backward and divides its new parameter gradients and its input
  gradient by it afterwards (the scale is a power of two: both are exact in fp32), checking them for Inf/NaN in
  the same pass (`torch._amp_foreach_non_finite_check_and_unscale_`, GradScaler's kernel). So what crosses a
  boundary, what the replicas sum and what is clipped are true, unscaled gradients. A stage that finds Inf/NaN
  (or a non-finite activation of its own) marks the step, zeroes what it would send (the codecs refuse
  non-finite tensors) and reports an infinite norm: every stage then skips the step.
- The scaler's state is part of a stage's checkpoint and handover (`amp.scale`, `amp.good_steps`), so a
  takeover or a new replica continues with the same scale; a stage that restarted without it disagrees and is
  refused, loudly, rather than trained with a wrong scale.
"""

from __future__ import annotations

import argparse
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.net.stream import CallRefused, StageCallError
from swarm.peers.plan import PLAN_PRECISIONS

if TYPE_CHECKING:
    from swarm.runtime.messages import GradReport, StepOrder
    from swarm.runtime.worker import StageWorker

__all__ = [
    "PRECISIONS",
    "LossScaler",
    "ScalerConfig",
    "add_precision_argument",
    "agreed_step",
    "autocast",
    "autocast_dtype",
    "check_scale",
    "check_step",
    "scale_mismatch",
    "step_mismatch",
]

PRECISIONS = PLAN_PRECISIONS
"""What a stage computes in (the names a plan's `precisions` may give, `swarm.peers.plan`)."""

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of `precision` (None for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return _DTYPES.get(precision)


def autocast(precision: str, device: str | torch.device = "cpu") -> AbstractContextManager:
    """The context a stage's forward runs in: torch autocast to bf16/fp16 on `device`'s type, nothing for fp32.
    CPU autocast takes both bf16 and fp16 (torch >= 2.4; checked on 2.13)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    """`--precision {fp32,bf16,fp16}` (default fp32)."""
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="compute precision: fp32; bf16 autocast; fp16 autocast with dynamic loss scaling agreed by every "
        "stage (a non-finite gradient anywhere skips the step everywhere). Weights and optimizer state stay fp32",
    )


@dataclass(frozen=True)
class ScalerConfig:
    """Dynamic loss scaling, torch.amp.GradScaler's defaults; every factor and bound a power of two so that
    scaling and unscaling are exact."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    """applied steps in a row (no skip) after which the scale grows"""
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5):
                raise ValueError(f"{name} must be a finite power of two, got {value}")
        if not (self.growth_factor > 1 > self.backoff_factor and self.growth_interval >= 1):
            raise ValueError("need growth_factor > 1 > backoff_factor and growth_interval >= 1")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError("need min_scale <= init_scale <= max_scale")


class LossScaler:
    """A deterministic dynamic loss scale: stages fed the same skip/apply decisions hold the same scale."""

    def __init__(self, cfg: ScalerConfig | None = None):
        self.cfg = cfg or ScalerConfig()
        self.scale = self.cfg.init_scale
        self.good_steps = 0
        """applied steps since the last skip or growth"""

    def update(self, skipped: bool) -> None:
        """After a step: a skip backs the scale off (to at least `min_scale`) and restarts the count; an applied
        step counts, and `growth_interval` of them grow the scale (to at most `max_scale`)."""
        cfg = self.cfg
        if skipped:
            self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= cfg.growth_interval:
            self.scale = min(self.scale * cfg.growth_factor, cfg.max_scale)
            self.good_steps = 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state as one-element fp32 tensors (checkpoints and handover send no 0-d tensors); exact: the
        scale is a power of two and the count stays below `growth_interval`."""
        return {"amp.scale": torch.tensor([self.scale]), "amp.good_steps": torch.tensor([float(self.good_steps)])}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restores `state_tensors`; checks the whole state before changing anything (a stranger's handover or a
        corrupt checkpoint must not set a NaN or unbounded scale)."""
        scale, good = tensors.get("amp.scale"), tensors.get("amp.good_steps")
        if scale is None or good is None or scale.numel() != 1 or good.numel() != 1:
            raise ValueError("loss scaler state: need one-element amp.scale and amp.good_steps")
        s, g = float(scale.reshape(())), float(good.reshape(()))
        cfg = self.cfg
        if not (math.isfinite(s) and cfg.min_scale <= s <= cfg.max_scale and math.frexp(s)[0] == 0.5):
            raise ValueError(f"amp.scale: {s} is not a power of two in [{cfg.min_scale}, {cfg.max_scale}]")
        if not (math.isfinite(g) and g == int(g) and 0 <= g < cfg.growth_interval):
            raise ValueError(f"amp.good_steps: {g} is not a count below {cfg.growth_interval}")
        self.scale, self.good_steps = s, int(g)


def scale_mismatch(named: float, held: float, scaled: bool) -> str | None:
    """Why a call naming loss scale `named` must be refused by a stage holding `held` (None: it agrees). 0 names
    no scale (a trainer that has not heard one yet): accepted, since the Grads replies are checked for agreement
    before any step is applied; an unscaled stage (fp32/bf16) holds 1."""
    if named == 0 or named == held:
        return None
    kind = "fp16 loss scale" if scaled else "no loss scaling (scale 1)"
    return f"loss_scale: the call names {named:g}, this stage holds {kind}{f' {held:g}' if scaled else ''}"


def step_mismatch(norm: float, skip: bool, found_inf: bool) -> str | None:
    """Why a Step must be refused (None: it may run): its skip flag must say whether its norm is finite, and a
    stage that found Inf/NaN in its own gradients takes no finite norm (the global norm cannot be finite)."""
    finite = math.isfinite(norm)
    if skip == finite:
        return f"skip={skip} disagrees with the global norm {norm}"
    if not skip and found_inf:
        return "this stage found Inf/NaN in its gradients: the global norm cannot be finite"
    if finite and norm < 0:
        return f"global_grad_norm: {norm} is negative"
    return None


def check_scale(named: float, worker: StageWorker) -> None:
    """Refuses (FAILED_PRECONDITION) a call naming another loss scale than `worker` holds; changes nothing."""
    why = scale_mismatch(named, worker.loss_scale, worker.scaler is not None)
    if why is not None:
        raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, why)


def check_step(request: StepOrder, worker: StageWorker) -> None:
    """Refuses a Step (not an abandon) whose skip flag, norm or scale disagree with each other or with this
    stage; changes nothing. A NaN or Inf norm is legitimate only as a skip."""
    check_scale(request.loss_scale, worker)
    why = step_mismatch(request.global_grad_norm, request.skip, worker.found_inf)
    if why is not None:
        raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, why)


def agreed_step(step: int, replies: dict[tuple[int, int], GradReport], counted: list[tuple[int, int]]):
    """The trainer's reading of a step's Grads replies (keyed (stage, replica)): (the loss scale every stage holds,
    the global norm over the replicas in `counted`, one per stage: a stage's replicas hold the same reduced
    gradients). Any replica's non-finite norm (+Inf: it found Inf/NaN in its fp16 gradients and sent zeros to
    its replicas' sum) makes the norm +Inf: the step is skipped everywhere. The replies were judged before
    (`swarm.runtime.suspects.Suspects.judge_grads`): a NaN, negative, absurd or implausible norm never gets here,
    it skips the step with a strike for its sender. Raises StageCallError
    (FAILED_PRECONDITION) when the stages hold different scales (one restarted without its scaler's state, or
    computes in another precision): no scale may then be trusted and the step must not be applied."""
    scales = {reply.loss_scale for reply in replies.values()}
    if len(scales) != 1:
        held = ", ".join(f"stage {s} replica {r}: {g.loss_scale:g}" for (s, r), g in sorted(replies.items()))
        raise StageCallError(
            f"step {step}: the stages' loss scales disagree ({held})", grpc.StatusCode.FAILED_PRECONDITION
        )
    if not all(math.isfinite(reply.grad_sq_norm) for reply in replies.values()):
        return scales.pop(), math.inf
    return scales.pop(), math.sqrt(sum(replies[key].grad_sq_norm for key in counted))
