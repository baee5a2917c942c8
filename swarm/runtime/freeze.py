"""PipeTransformer's layer freezing: the criterion, the frozen prefix on a stage, and the trainer's side.

Who decides: the trainer (`FreezingDriver`). It already gathers every stage's `Grads` each step, so it sees each
block's squared gradient norm (`GradReply.layer_sq_norms`) without another round trip, and its `Step` reaches
every stage of the step: the decision travels in `StepRequest.frozen_layers` and every stage applies it right
after that step's optimizer step, so all stages freeze at the same step boundary. A stage refuses a value that
would unfreeze, reaches past the model, or is not finite (`check_frozen`), and only a trainer may send Step.

The criterion (`FreezePolicy`) is PipeTransformer's on the gradient norm's change: every `interval` steps it
compares each active block's mean gradient norm over the window with the previous window's and freezes up to
the active block whose relative change is smallest (Algorithm 1's argmin), at most a fraction `alpha` of the
active layers per decision (at least one), and only once that change is below `tolerance` (the gradients have
settled); never past `max_fraction` of the model nor into the last `keep_last` layers, never back.

Frozen layers: their parameters get `requires_grad=False`, so autograd records nothing through them when
nothing before them trains, the optimizer skips them (no gradient), and a stage whose input needs no gradient
sends none upstream. A stage holding only frozen layers runs its forward under `no_grad`, keeps nothing, and
its schedule program has no backward turns: no Backward call is made into it. The input embeddings freeze
with the first block, and then the whole prefix stops.

Tied embeddings (the built-in GPT, a tied Hugging Face model): the token embedding is also the LM head, whose
gradient would keep it training, so a frozen prefix's input would still move every step. A cache of the frozen
blocks' outputs keyed by sample would then be invalidated at every step and never hit; and leaving the embedding
trainable keeps gradients flowing back through every frozen block to stage 0 (no backward saved, no stage
forward-only). So the tied pair freezes with the first block: stage 0's embedding and the last stage's copy as
the head, at the same Step on both ends (their copies are equal, and stay so: neither moves again). The head
layer's norm and the still active blocks keep training; the end stages stop summing the tied gradient
(`GradientAverager.tied_trained`). What it costs is the head's own adaptation during fine-tuning: measured by
`swarm experiment freezing --tied` (docs/reports/freezing.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch
from torch import nn

from swarm.net.stream import CallRefused
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.messages import GradReport, StepOrder
from swarm.runtime.worker import StageWorker

__all__ = [
    "FreezePolicy",
    "FreezingDriver",
    "MAX_LAYER_NORMS",
    "apply_frozen",
    "block_of",
    "cached_forward",
    "check_frozen",
    "grad_report",
    "layer_sq_norms",
    "set_frozen",
]

MAX_LAYER_NORMS = 4096
"""Most per-block norms one stage may report (a reply with more is ignored by the trainer)."""

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|h|layers)\.(\d+)\.")


def block_of(name: str) -> int | None:
    """The global block index a parameter name belongs to (`blocks.3.`, `transformer.h.3.`, `model.layers.3.`)."""
    match = _BLOCK.search(name)
    return None if match is None else int(match.group(1))


def _embeddings(module: nn.Module) -> set[int]:
    """ids of the input-embedding parameters (the first stage's nn.Embedding weights)."""
    if not getattr(module, "is_first", False):
        return set()
    return {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}


def _tied_copy(module: nn.Module) -> set[int]:
    """id of this stage's copy of a tied embedding / head (first and last stage of a tied model), if any."""
    param = module.tied_parameter()
    return set() if param is None else {id(param)}


def layer_sq_norms(worker: StageWorker) -> list[float]:
    """Squared gradient norm of each of the stage's blocks, in layer order (0 for a block without gradients)."""
    module = worker.module
    sums = {i: 0.0 for i in range(module.layer_start, module.layer_end)}
    for name, p in module.named_parameters():
        i = block_of(name)
        if i in sums and p.grad is not None:
            sums[i] += float(p.grad.detach().float().pow(2).sum())
    return [sums[i] for i in sorted(sums)]


def grad_report(worker: StageWorker) -> GradReport:
    """A stage's Grads report: its squared gradient norm, loss scale, and each block's squared norm."""
    return GradReport(worker.grad_sq_norm(), worker.loss_scale, tuple(layer_sq_norms(worker)))


def set_frozen(worker: StageWorker, frozen_layers: int) -> bool:
    """Freezes layers [0, frozen_layers) on this stage (only its own blocks change); never unfreezes.

    Sets `worker.input_grad` (whether anything before this stage still trains) and `worker.forward_only`
    (nothing here or before trains: no backward at all), and returns the latter. Call between steps."""
    if frozen_layers == worker.frozen_layers:
        return worker.forward_only
    if frozen_layers < worker.frozen_layers:
        raise ValueError(f"frozen layers never decrease ({worker.frozen_layers} -> {frozen_layers})")
    module = worker.module
    # the input embeddings freeze with the first block, and with them a tied embedding's copy as the head (the
    # tied pair; module doc): nothing before a frozen block trains any more
    embeddings = _embeddings(module) | _tied_copy(module) if frozen_layers > 0 else set()
    for name, p in module.named_parameters():
        i = block_of(name)
        if (i is not None and i < frozen_layers) or id(p) in embeddings:
            p.requires_grad_(False)
            p.grad = None
    worker.frozen_layers = frozen_layers
    worker.input_grad = not module.is_first and module.layer_start > frozen_layers
    trainable = any(p.requires_grad for p in module.parameters())
    was, worker.forward_only = worker.forward_only, not trainable and not worker.input_grad
    if not was:  # outputs computed before are stale: the cache starts empty (`cached_forward`); once forward
        worker.frozen_sent = {}  # only, a stage's outputs never change again, so a later change keeps it
    return worker.forward_only


def apply_frozen(host, frozen_layers: int) -> None:
    """Freezes layers [0, frozen_layers) on a host's stage (`set_frozen`), drops the backward turns of its
    schedule when nothing here or before trains, and reports the prefix in its metrics (`swarm_frozen_layers`,
    read from Status by the planner's repack, `swarm.daemon.repack.RepackWatch`). Call between steps."""
    host.gate.forward_only = set_frozen(host.worker, frozen_layers)
    host.averager.relayout()  # frozen parameters leave the replicas' sum (`swarm.runtime.average`)
    host.metrics.frozen_layers.set(host.worker.frozen_layers)


def cached_forward(
    worker: StageWorker,
    links: LinkEnds,
    address: str | None,
    mb: int,
    inputs,
    ids: list[int],
    targets,
    metrics=None,
) -> torch.Tensor:
    """A stage's forward of one micro-batch, answered from the frozen activation cache where it can be.

    On a stage that runs forward only (everything here and before is frozen) with AQ-SGD buffers on its
    outgoing boundary, the sender's buffer `m[sample]` is the receiver's copy. A sample's first forward after
    the freeze is computed and sent in full (its buffer is forgotten, so it travels as a first sight and both
    copies become the frozen output, in the buffer dtype); after that the stage skips the compute and sends
    `m` itself: a zero delta, which leaves the receiver's copy unchanged and costs almost no bytes. Those first
    sights travel raw whatever the codec's first-sight coding (`LinkState.exact_first_sights`): the default's
    subspace-coded ones are 0.2-0.5 off the output, which the cache would serve forever and every audit of the
    stage would find off its recomputation (a false liar). (Keeping AQ-SGD's last delta instead of a full resend
    left the receiver's copy 22% off the frozen output in the unit test after three epochs at 2 bits: cheaper, but
    an error the cache would then keep forever.)

    `address` is the next stage's of the call's route (None on the last stage); `links` the stage's ends; hits
    are counted in `worker.cache_hits` and in `metrics` (`swarm_frozen_cache_hits_total`, read from Status)."""
    if not worker.forward_only or address is None:
        return worker.forward(mb, inputs, torch.tensor(ids), targets)
    end = links.send_end("fw", address)
    store = end.buffers
    if store is None:  # no AQ-SGD buffers on this boundary: nothing to answer from
        return worker.forward(mb, inputs, torch.tensor(ids), targets)
    end.state.exact_first_sights = True  # what the cache serves is what both ends buffer: the output itself
    sent = worker.frozen_sent.setdefault(address, set())
    fresh = [i for i in ids if i not in sent or i not in store]
    if not fresh:
        worker.cache_hits += len(ids)
        if metrics is not None:
            metrics.cache_hits.inc(len(ids))
        return store.gather(store.lookup(ids)).float()
    out = worker.forward(mb, inputs, torch.tensor(ids), targets)
    links.forget(fresh, address)  # in full once more: the receiver's copy becomes the frozen output
    added = [i for i in fresh if i not in sent]
    sent.update(added)
    links.on_abandon(lambda: sent.difference_update(added))  # the forget is undone too: send it again
    return out


def check_frozen(request: StepOrder, worker: StageWorker, n_layers: int) -> int:
    """The prefix frozen after a Step: its `frozen_layers`, or the stage's own where that is larger (frozen layers
    never thaw: a trainer without --freeze, or one that has not seen another trainer's freeze yet, sends fewer and
    trains on, its Step not refused); refuses one that would reach the model's last layer. Changes nothing."""
    n = request.frozen_layers
    if n >= max(n_layers, 1):
        raise CallRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"frozen_layers: {n} reaches the model's last layer ({n_layers} layers)"
        )
    return max(n, worker.frozen_layers)


@dataclass
class FreezePolicy:
    """PipeTransformer's freezing criterion on per-block gradient norms (the trainer's; see the module doc)."""

    n_layers: int
    interval: int = 10
    """Steps per evaluation window (a decision compares two windows)."""
    tolerance: float = 0.1
    """A block has settled when its mean gradient norm changed by less than this fraction between windows."""
    max_fraction: float = 0.75
    """Never freeze more than this fraction of the layers."""
    keep_last: int = 1
    """Never freeze the last `keep_last` layers."""
    alpha: float = 0.2
    """PipeTransformer's alpha: one decision freezes at most this fraction of the active layers (at least 1)."""
    warmup_steps: int = 0
    """Steps observed before the first window starts (the learning-rate warm-up moves every gradient)."""
    frozen: int = 0
    history: list[tuple[int, int]] = field(default_factory=list)
    """(step, frozen layers) at every change."""
    changes: list[tuple[int, list[float]]] = field(default_factory=list)
    """(step, each layer's relative change of its mean gradient norm) at every decision, for reports"""
    _window: list[list[float]] = field(default_factory=list, repr=False)
    _previous: list[float] | None = field(default=None, repr=False)
    _last_step: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if self.n_layers < 1 or self.interval < 1 or not self.tolerance > 0 or self.keep_last < 1:
            raise ValueError("need n_layers >= 1, interval >= 1, tolerance > 0, keep_last >= 1")
        if not 0 <= self.max_fraction <= 1 or not 0 < self.alpha <= 1:
            raise ValueError("max_fraction must be in [0, 1] and alpha in (0, 1]")

    @property
    def cap(self) -> int:
        return max(0, min(math.floor(self.max_fraction * self.n_layers), self.n_layers - self.keep_last))

    def adopt(self, frozen_layers: int, step: int = -1) -> int:
        """Raises the frozen count to what the stages already apply (a plan's `frozen_layers`: this trainer
        started or restarted after they froze: a Step with fewer is refused), even past `cap`, never back; returns
        the frozen count."""
        settled = min(max(0, frozen_layers), self.n_layers - 1)
        if settled > self.frozen:
            self.frozen = settled
            self.history.append((step, settled))
            self._window, self._previous = [], None  # the windows start again over the still active layers
        return self.frozen

    def observe(self, step: int, sq_norms: Sequence[float]) -> int:
        """Feeds one step's per-layer squared gradient norms (all layers, in order); returns the frozen count.

        A malformed observation (wrong length, negative or non-finite) or a repeated step is ignored."""
        if step <= self._last_step or len(sq_norms) != self.n_layers:
            return self.frozen
        if not all(math.isfinite(v) and v >= 0 for v in sq_norms):
            return self.frozen
        self._last_step = step
        if step < self.warmup_steps:
            return self.frozen
        self._window.append([math.sqrt(v) for v in sq_norms])
        if len(self._window) < self.interval:
            return self.frozen
        mean = [sum(col) / len(col) for col in zip(*self._window, strict=True)]
        self._window = []
        previous, self._previous = self._previous, mean
        if previous is None:
            return self.frozen
        self.changes.append(
            (step, [abs(a - b) / b if b > 0 else math.inf for a, b in zip(mean, previous, strict=True)])
        )
        # PipeTransformer: freeze up to the active layer whose gradient norm changed least, at most a fraction
        # alpha of the active layers at once; here only once that layer's change is below the tolerance
        candidates = range(self.frozen, self.cap)
        if not candidates:
            return self.frozen
        best = min(candidates, key=lambda i: (self.changes[-1][1][i], -i))  # ties: the deeper layer
        if self.changes[-1][1][best] >= self.tolerance:
            return self.frozen
        pace = max(1, math.floor(self.alpha * (self.n_layers - self.frozen)))
        settled = min(best + 1, self.frozen + pace)
        if settled > self.frozen:
            self.frozen = settled
            self.history.append((step, settled))
        return self.frozen


class FreezingDriver(PipelineDriver):
    """A `PipelineDriver` whose trainer runs a `FreezePolicy`: it reads each stage's per-block gradient norms
    from the Reduce replies (Grads where one carried none) and sends the decision in every Step
    (`StepRequest.frozen_layers`)."""

    def __init__(self, *args, policy: FreezePolicy, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        self._norms: dict[int, list[float]] = {}

    def _call(self, stage: int, replica: int, method: str, request, timeout: float | None = None):
        if method == "Step" and not request.abandon:
            request.frozen_layers = self.policy.frozen
        reply = super()._call(stage, replica, method, request, timeout)
        report = None  # the stage's gradient report, where the reply is (or carries) one
        if method == "Grads":
            report = reply
        elif method == "Reduce" and reply.HasField("grads"):
            report = reply.grads
        if report is not None and len(report.layer_sq_norms) <= MAX_LAYER_NORMS:
            self._norms.setdefault(stage, list(report.layer_sq_norms))  # replicas hold the same reduced gradients
        return reply

    def _send_reduces(self, step, routes, piped=None):
        # the attempt's reports, from its Reduce replies (which may come back before the pipeline's last reply
        # where they left with it), or Grads where one carried none
        self._norms = {}
        return super()._send_reduces(step, routes, piped)

    def _grads(self, step, routes, wake) -> float:
        norm = super()._grads(step, routes, wake)
        if math.isfinite(norm) and sorted(self._norms) == list(range(self.n_stages)):
            self.policy.observe(step, [v for s in range(self.n_stages) for v in self._norms[s]])
        return norm
