"""How much a stage's training signal suffers when it computes in a lower precision (QSync's indicator, measured).

QSync (../shared/seeds/qsync.txt, section IV-A) ranks operators by the variance a low-precision kernel adds to
the weight gradient, relative to the gradient's norm: large added variance means large, unstable updates. Its
closed form needs per-operator depth, dimensions and norms; here the same quantity is measured where the stage
lives, on the stage's real weights and inputs: a forward and backward in fp32 and the same in the low precision
(torch autocast, fp32 master weights, as the stage trains), on a few micro-batches, and

    sensitivity(p) = mean over batches of ||g_p - g_fp32||^2 / ||g_fp32||^2

over all of the stage's parameter gradients: the added gradient variance relative to the squared norm (QSync's
indicator up to its constant). A stage is a unit of precision here (the plan names one precision per stage), so
the figure is per stage; `layer_sensitivities` gives it per layer for a finer look. The figure is unitless,
finite, and bounded (`MAX_SENSITIVITY`) before anyone plans with it. `measure_sensitivity` (the planner's own
figure, `stage_sensitivity`) drives the stage's output with a fixed random projection (seeded);
`gradient_sensitivity` (what a training stage measures of itself, `swarm.runtime.sensitivity_probe`) with the real
gradient its next stage sent back. Either way fp32 and the low precision are compared on the same signal.

`set_stage_precision` switches a live stage between precisions (a plan's `precisions`), between steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from swarm.peers.records import MAX_SENSITIVITY  # largest figure a planner accepts, one bound for the wire and here
from swarm.runtime.precision import PRECISIONS, LossScaler, autocast

__all__ = [
    "MAX_SENSITIVITY",
    "gradient_sensitivity",
    "layer_sensitivities",
    "measure_sensitivity",
    "relative_error",
    "set_stage_precision",
    "stage_sensitivity",
    "validate_sensitivity",
]


def _grads(
    module: nn.Module,
    x: torch.Tensor,
    precision: str,
    seed: int,
    device: str,
    targets: torch.Tensor | None = None,
    grad_out: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The stage's parameter gradients of one forward and backward in `precision`: of the real `grad_out` (the
    gradient the next stage sent, or the last stage's loss weight, with `targets`) when given, else of a seeded
    random projection of the output."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    last = targets is not None and getattr(module, "is_last", False)
    with autocast(precision, device):
        out = module(x, targets) if last else module(x)
    if grad_out is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        grad_out = torch.randn(out.shape, generator=gen).to(out.device)
    (out.float() * grad_out.float().reshape(out.shape)).sum().backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # handed over: no copy
    for p in params:
        p.grad = None
    return grads


def relative_error(low: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """||low - ref||^2 / ||ref||^2 over a stage's gradients (0 when both are zero)."""
    norm = sum(float(g.float().pow(2).sum()) for g in ref)
    err = sum(float((a.float() - b.float()).pow(2).sum()) for a, b in zip(low, ref, strict=True))
    return err / max(norm, 1e-30)


def gradient_sensitivity(
    module: nn.Module,
    inputs: torch.Tensor,
    grad_out: torch.Tensor,
    precisions: Sequence[str] = ("bf16",),
    targets: torch.Tensor | None = None,
    device: str = "cpu",
) -> dict[str, float]:
    """Each precision's relative squared gradient error against fp32 on one real micro-batch: `inputs` as the
    stage received them and `grad_out` as the next stage sent it back (the last stage: its `targets` and loss
    weight). What a training stage measures of itself (`swarm.runtime.sensitivity_probe`). The gradients held
    in the module's parameters are put back as they were (a step's accumulation goes on); non-finite figures
    (an overflow) read as MAX_SENSITIVITY."""
    for p in precisions:
        if p not in PRECISIONS or p == "fp32":
            raise ValueError(f"precisions: expected low precisions of {PRECISIONS}, got {p!r}")
    params = [p for p in module.parameters() if p.requires_grad]
    held = [p.grad for p in params]
    was_training = module.training
    module.train()
    try:
        x = inputs.detach()
        if x.is_floating_point():
            x = x.requires_grad_(False)
        ref = _grads(module, x, "fp32", 0, device, targets, grad_out)
        out = {}
        for p in precisions:
            figure = relative_error(_grads(module, x, p, 0, device, targets, grad_out), ref)
            out[p] = min(figure, MAX_SENSITIVITY) if math.isfinite(figure) else MAX_SENSITIVITY
        return out
    finally:
        for p, g in zip(params, held, strict=True):
            p.grad = g
        module.train(was_training)


def measure_sensitivity(
    module: nn.Module,
    inputs: Iterable[torch.Tensor],
    precisions: Sequence[str] = ("bf16",),
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, float]:
    """Each precision's relative squared gradient error against fp32 on `inputs` (see the module docstring).

    Args:
        module: the stage (its weights fp32; their gradients are left as they were: None).
        inputs: a few micro-batches of what the stage receives (activations, or token ids for the first stage).
        precisions: the low precisions to rate (names in `PRECISIONS`, not fp32).
        device: the device type autocast runs on.
        seed: seed of the output projections (one per batch, the same for fp32 and the low precision).
    """
    for p in precisions:
        if p not in PRECISIONS or p == "fp32":
            raise ValueError(f"precisions: expected low precisions of {PRECISIONS}, got {p!r}")
    sums = dict.fromkeys(precisions, 0.0)
    n = 0
    was_training = module.training
    module.train()
    try:
        for i, x in enumerate(inputs):
            ref = _grads(module, x, "fp32", seed + i, device)
            for p in precisions:
                sums[p] += relative_error(_grads(module, x, p, seed + i, device), ref)
            n += 1
    finally:
        module.train(was_training)
    if n == 0:
        raise ValueError("measure_sensitivity: no inputs")
    return {p: min(sums[p] / n, MAX_SENSITIVITY) for p in precisions}


def layer_sensitivities(
    blocks: Sequence[nn.Module], x: torch.Tensor, precision: str = "bf16", device: str = "cpu", seed: int = 0
) -> list[float]:
    """Per-layer sensitivity of a stack of blocks: each block rated alone on the fp32 activation that reaches
    it (the others in fp32), as QSync rates one operator's precision at a time."""
    out = []
    h = x.detach()
    for i, block in enumerate(blocks):
        out.append(measure_sensitivity(block, [h], (precision,), device, seed + i)[precision])
        with torch.no_grad():
            h = block(h).detach()
    return out


def validate_sensitivity(value: Mapping[str, float] | Sequence[tuple[str, float]]) -> dict[str, float]:
    """A reported sensitivity (precision -> figure) checked whole before a planner uses it: low precisions of
    `PRECISIONS` only, each at most once, finite numbers in [0, MAX_SENSITIVITY]. Raises ValueError."""
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(pairs, (list, tuple)) or len(pairs) > len(PRECISIONS) - 1:
        raise ValueError(f"sensitivity: expected at most {len(PRECISIONS) - 1} (precision, figure) pairs")
    out: dict[str, float] = {}
    for entry in pairs:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise ValueError(f"sensitivity: expected (precision, figure) pairs, got {entry!r:.80}")
        name, fig = entry
        if name not in PRECISIONS or name == "fp32" or name in out:
            raise ValueError(f"sensitivity: {name!r:.40} is not a distinct low precision of {PRECISIONS}")
        if type(fig) not in (int, float) or not math.isfinite(fig) or not 0 <= fig <= MAX_SENSITIVITY:
            raise ValueError(f"sensitivity[{name}]: expected a finite number in [0, {MAX_SENSITIVITY:g}]")
        out[name] = float(fig)
    return out


def set_stage_precision(worker, precision: str) -> bool:
    """Switches a stage's compute precision (a plan's `precisions` entry) between steps; True if it changed.

    Only the autocast precision and the loss scaler change: master weights and optimizer state stay fp32 (they
    are never cast). Entering fp16 starts a fresh `LossScaler` (every stage enters fp16 under the same plan
    version, so they agree on its initial scale); leaving it drops the scaler. Refused (RuntimeError) while a
    micro-batch is in flight: a step never mixes precisions."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == worker.precision:
        return False
    if worker.in_flight:
        raise RuntimeError("set_stage_precision: micro-batches in flight; switch between steps")
    worker.precision = precision
    worker.scaler = LossScaler(worker.cfg.scaler) if precision == "fp16" else None
    return True


_STAGE_CACHE: dict[tuple, dict[str, float]] = {}


def stage_sensitivity(
    model, layer_start: int, layer_end: int, micro_batch_size: int = 2, batches: int = 2, seed: int = 0
) -> dict[str, float]:
    """A planner's estimate of a stage's bf16 sensitivity before anyone trains it: the stage built from the
    model's deterministic init (what every peer starts from), on synthetic inputs (random tokens for the first
    stage, layer-normed Gaussian activations for the others), `measure_sensitivity` over `batches` of them.
    Cached per (model, layers, size). Where a stage lives it can be measured on its real weights and inputs
    instead (the hetero experiment does)."""
    from swarm.model.spec import build_stage

    key = (repr(model), layer_start, layer_end, micro_batch_size, batches, seed)
    if key not in _STAGE_CACHE:
        first, last = layer_start == 0, layer_end == model.n_layers
        module = build_stage(model, layer_start, layer_end, first, last)
        gen = torch.Generator().manual_seed(seed)
        shape = (micro_batch_size, model.seq_len_tokens)
        if first:
            inputs = [torch.randint(0, model.vocab_size, shape, generator=gen) for _ in range(batches)]
        else:
            hidden = (*shape, model.boundary_dim)
            inputs = [nn.functional.layer_norm(torch.randn(hidden, generator=gen), hidden[-1:]) for _ in range(batches)]
        _STAGE_CACHE[key] = measure_sensitivity(module, inputs, ("bf16",), seed=seed)
    return dict(_STAGE_CACHE[key])
