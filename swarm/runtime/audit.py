"""A stage's side of verified stage work: its records of the open step's micro-batches, and recomputation.

Every micro-batch a stage runs leaves a record until the step ends (applied or abandoned): the input it
computed on (as decoded) and the output it computed, and after the backward the output gradient it received
(as decoded) and the input gradient it computed. The records are references to tensors the step made anyway
(the decoded input is copied once), so keeping them costs memory, not time: at most the step's boundary tensors
(`StageBudget.max_micro_batches` micro-batches of [batch, seq, hidden], four per micro-batch). The trainer asks
for one (`Stage.Audit`) after the micro-batch's backward and before `Step`; a stage cannot know which, since
the trainer draws them with a secret seed. `recompute` is what a sibling replica runs on the audited stage's
reported input (`Stage.Recompute`): the same module, no state touched. The trainer's side, which compares and
decides, is `swarm.runtime.verify`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from swarm.compression.codecs import REGISTRY
from swarm.runtime.precision import autocast
from swarm.runtime.worker import StageWorker

__all__ = ["AuditRecord", "AuditTrail", "Recomputed", "recompute", "stateless"]


def stateless(message) -> bool:
    """Whether a tensor message decodes from itself alone (its codec keeps no receiver state: no AQ-SGD buffers)."""
    codec = REGISTRY.get(message.codec)
    return codec is not None and not codec.uses_buffers


@dataclass
class AuditRecord:
    """What a stage did with one micro-batch of the open step (None where it has not done that part)."""

    inputs: torch.Tensor | None = None
    """the input it computed on: token ids on stage 0, else the decoded activation"""
    output: torch.Tensor | None = None
    """the activation it computed (the last stage: the loss, a scalar)"""
    grad_received: torch.Tensor | None = None
    """the gradient of its output it received, as decoded (the last stage: its loss weight)"""
    grad_sent: torch.Tensor | None = None
    """the gradient of its input it computed (None on stage 0)"""
    grad_message: object | None = None
    """the received gradient's message as it came, where its codec keeps no receiver state (`stateless`): a sibling
    that recomputes this micro-batch for a direct audit decodes it to the same values"""


class AuditTrail:
    """The open step's records by local micro-batch; dropped when the step ends (`clear`).

    Args:
        max_records: most micro-batches recorded (the budget's micro-batches per step bounds it already).
    """

    def __init__(self, max_records: int):
        self.max_records = max_records
        self._lock = threading.Lock()
        self._step: int | None = None
        self._records: dict[int, AuditRecord] = {}

    def _record(self, step: int, mb: int) -> AuditRecord | None:
        if self._step != step:
            self._step, self._records = step, {}
        if mb not in self._records and len(self._records) >= self.max_records:
            return None  # refused by the budget before this point; never grows past it
        return self._records.setdefault(mb, AuditRecord())

    def forward(self, step: int, mb: int, inputs: torch.Tensor, output: torch.Tensor) -> None:
        with self._lock:
            record = self._record(step, mb)
            if record is not None:
                record.inputs, record.output = inputs, output
                record.grad_received = record.grad_sent = record.grad_message = None

    def backward(
        self, step: int, mb: int, grad_received: torch.Tensor, grad_sent: torch.Tensor | None, message=None
    ) -> None:
        """The backward's part of the record; `message`: the gradient's wire message, kept where `stateless`."""
        with self._lock:
            record = self._record(step, mb)
            if record is not None:
                record.grad_received, record.grad_sent = grad_received, grad_sent
                record.grad_message = message if message is not None and stateless(message) else None

    def get(self, step: int, mb: int) -> AuditRecord | None:
        with self._lock:
            return self._records.get(mb) if self._step == step else None

    def clear(self) -> None:
        with self._lock:
            self._step, self._records = None, {}


@dataclass
class Recomputed:
    output: torch.Tensor | None
    """the activation (None on the last stage)"""
    loss: float = 0.0
    """the last stage's loss"""
    grad_in: torch.Tensor | None = None
    """with a gradient: the gradient of the input"""


def recompute(
    worker: StageWorker,
    inputs: torch.Tensor,
    targets: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
) -> Recomputed:
    """The stage's forward of `inputs` (token ids on stage 0) and, with `grad` (the output's gradient; the last
    stage: its loss weight), the input's gradient; with the worker's module and precision, leaving its
    parameters' gradients, its saved activations and its optimizer as they were. Call holding the host's compute
    lock (the module is shared with the step's own work)."""
    module, device = worker.module, worker.cfg.device
    backward = grad is not None and not module.is_first
    x = inputs.to(device)
    if backward:
        x = x.detach().float().requires_grad_(True)
    with autocast(worker.precision, device), torch.set_grad_enabled(backward):
        out = module(x, targets.to(device)) if module.is_last else module(x)
    grad_in = None
    if backward:
        weight = grad.to(device, out.dtype).reshape(out.shape)
        (grad_in,) = torch.autograd.grad(out, x, weight, allow_unused=True)
        grad_in = torch.zeros_like(x) if grad_in is None else grad_in.detach()
    out = out.detach().float()
    if module.is_last:
        return Recomputed(None, float(out), grad_in)
    return Recomputed(out, 0.0, grad_in)
