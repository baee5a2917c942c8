"""The in-process pipeline runtime: interprets a schedule over stage workers joined by codec boundaries.

Compute lives in `StageWorker` (swarm.runtime.worker), schedules in swarm.runtime.schedules, codecs in
swarm.compression;
this module is where they meet. Each boundary between stage k and k+1 is a `Boundary`: the forward
activation goes through it to become what stage k+1 computes on, and the activation gradient comes back
through it to become what stage k backpropagates. `CodecBoundary` runs the real codecs and framing
(encode -> frame -> unframe -> decode), so its byte counts are what the network will carry; the gRPC
runtime swaps it for a transport that does the same across processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from swarm.compression import CodecConfig, LinkState, frame, make_codec, unframe
from swarm.model.data import Batch, SampleSet
from swarm.model.gpt import ModelConfig, build_stage, split_layers
from swarm.runtime.schedules import SCHEDULES, Action, Kind, Programs, linearize, validate
from swarm.runtime.worker import StageConfig, StageWorker

__all__ = [
    "Boundary",
    "CodecBoundary",
    "Pipeline",
    "StepResult",
    "build_workers",
    "sync_tied_embedding",
    "global_grad_norm",
]


class Boundary(Protocol):
    """One link between consecutive stages, both directions, as the runtime sees it."""

    forward_bytes: int
    """Bytes sent forward (activations) so far."""
    backward_bytes: int
    """Bytes sent backward (activation gradients) so far."""

    def send_activation(self, mb: int, tensor: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
        """Carry the sender's activation; returns the tensor the receiver computes on."""
        ...

    def send_gradient(self, mb: int, grad: torch.Tensor) -> torch.Tensor:
        """Carry the receiver's input gradient back; returns the gradient the sender backpropagates."""
        ...

    def end_step(self) -> None:
        """Called once after every optimizer step."""
        ...


class CodecBoundary:
    """Both ends of one link in one process: a codec and a sender and receiver `LinkState` per direction.

    Args:
        forward: codec of the activations (e.g. aqsgd 2 bits).
        backward: codec of the activation gradients (e.g. gradq 4 bits with error feedback).
    """

    def __init__(self, forward: CodecConfig, backward: CodecConfig) -> None:
        self.forward_cfg, self.backward_cfg = forward, backward
        self._fw_codec, self._bw_codec = make_codec(forward), make_codec(backward)
        self._fw_send, self._fw_recv = LinkState(forward), LinkState(forward)
        self._bw_send, self._bw_recv = LinkState(backward), LinkState(backward)
        self.forward_bytes = 0
        self.backward_bytes = 0

    def send_activation(self, mb: int, tensor: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
        ids = [int(s) for s in sample_ids]
        # sender: encode (AQ-SGD updates the sender's message buffers here) and frame with zstd
        msg = self._fw_codec.encode(tensor, sample_ids=ids, state=self._fw_send)
        chunks = list(frame(msg, zstd_level=self.forward_cfg.zstd_level))
        # communication: the chunks are what the gRPC stream carries
        self.forward_bytes += sum(c.ByteSize() for c in chunks)
        # receiver: unframe and decode (AQ-SGD: the receiver's buffer m for these samples)
        return self._fw_codec.decode(unframe(chunks), state=self._fw_recv)

    def send_gradient(self, mb: int, grad: torch.Tensor) -> torch.Tensor:
        # receiver of the activation is the sender of its gradient (gradq keeps the error feedback here)
        msg = self._bw_codec.encode(grad, state=self._bw_send)
        chunks = list(frame(msg, zstd_level=self.backward_cfg.zstd_level))
        # communication: the gradient travels back on the same link
        self.backward_bytes += sum(c.ByteSize() for c in chunks)
        return self._bw_codec.decode(unframe(chunks), state=self._bw_recv)

    def end_step(self) -> None:
        for state in (self._fw_send, self._fw_recv, self._bw_send, self._bw_recv):
            state.end_step()


def sync_tied_embedding(first: StageWorker, last: StageWorker) -> None:
    """Give both copies of the tied embedding the sum of their gradients (Optimus-CC's fused sync).

    Stage 0 uses the embedding to look tokens up and the last stage uses its copy as the LM head; the
    unsplit model's gradient of the shared weight is the sum of both uses, so applying that sum to both
    copies keeps them equal step after step. With data-parallel replicas, each replica first sums its own
    two copies and the replicas then average the summed gradient like any other parameter, which is the
    same as averaging each copy's gradient first (the sum and the mean commute).
    """
    if first is last:
        return  # one stage: an ordinary tied weight, autograd already summed both uses
    # communication: one embedding-sized exchange between the first and the last stage per step
    total = first.tied_grad() + last.tied_grad()
    first.set_tied_grad(total)
    last.set_tied_grad(total)


def global_grad_norm(workers: list[StageWorker]) -> float:
    """The gradient norm of the whole model, from each stage's sum of squares (one number per stage)."""
    return math.sqrt(sum(w.grad_sq_norm() for w in workers))


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    loss: float
    """Mean training loss of the mini-batch, as the last stage computed it (on decoded activations)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used."""
    forward_bytes: int
    """Bytes of activations sent across all boundaries during the step."""
    backward_bytes: int
    """Bytes of activation gradients sent across all boundaries during the step."""


@dataclass
class _StepState:
    """Tensors in transit during one step, keyed by (receiving stage, micro-batch)."""

    micro: list[Batch]
    activations: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    gradients: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)

    def weight(self, mb: int) -> float:
        return len(self.micro[mb].sample_ids) / sum(len(m.sample_ids) for m in self.micro)


class Pipeline:
    """Runs a schedule over stage workers in one process, with a boundary between each consecutive pair.

    Args:
        workers: the stages in order; the first takes token ids, the last computes the loss.
        boundaries: `len(workers) - 1` boundaries; boundaries[k] joins stage k to stage k + 1.
        schedule: a name in `swarm.runtime.schedules.SCHEDULES` or a builder `(n_stages, n_micro) -> Programs`.
    """

    def __init__(
        self,
        workers: list[StageWorker],
        boundaries: list[Boundary],
        schedule: str | Callable[[int, int], Programs] = "1f1b",
    ) -> None:
        if len(boundaries) != len(workers) - 1:
            raise ValueError(f"{len(workers)} stages need {len(workers) - 1} boundaries, got {len(boundaries)}")
        self.workers, self.boundaries = workers, boundaries
        self.schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule

    def forward_backward(self, batch: Batch, n_micro: int) -> float:
        """Run every micro-batch's forward and backward in schedule order; gradients accumulate.

        Each micro-batch's loss is weighted by its share of the batch, so the accumulated gradients are
        those of the mini-batch's mean loss. Returns that mean loss.
        """
        plan = self.schedule(len(self.workers), n_micro)
        validate(plan, n_micro)
        step = _StepState(batch.split(n_micro))
        for tick in linearize(plan):
            for action in tick:
                self._run(action, step)
        return float(sum(step.losses[m] * step.weight(m) for m in range(n_micro)))

    def _run(self, action: Action, step: _StepState) -> None:
        """One action of the schedule, with the boundary data path on either side of the compute."""
        s, mb, last = action.stage, action.mb, len(self.workers) - 1
        worker, data = self.workers[s], step.micro[mb]
        if action.kind is Kind.FORWARD:
            inputs = data.tokens if s == 0 else step.activations.pop((s, mb))
            out = worker.forward(mb, inputs, data.sample_ids, data.targets if s == last else None)
            if s == last:
                step.losses[mb] = out
            else:
                # communication: activation to stage s+1, which computes on what the codec delivers
                step.activations[(s + 1, mb)] = self.boundaries[s].send_activation(mb, out, data.sample_ids)
        else:
            # the last stage's output is its loss: d(step loss)/d(micro-batch loss) is the batch share
            grad_out = torch.tensor(step.weight(mb)) if s == last else step.gradients.pop((s, mb))
            grad_in = worker.backward(mb, grad_out)
            if s > 0:
                # communication: gradient back to stage s-1, which backpropagates the decoded gradient
                step.gradients[(s - 1, mb)] = self.boundaries[s - 1].send_gradient(mb, grad_in)

    def finish_step(self) -> tuple[float, float]:
        """Sync the tied embedding, clip by the global norm, step every stage. Returns (grad_norm, lr)."""
        sync_tied_embedding(self.workers[0], self.workers[-1])
        norm = global_grad_norm(self.workers)
        lrs = [w.step(norm) for w in self.workers]
        for boundary in self.boundaries:
            boundary.end_step()
        return norm, lrs[0]

    def train_step(self, batch: Batch, n_micro: int) -> StepResult:
        """One optimizer step on `batch` split into `n_micro` micro-batches."""
        fw0 = sum(b.forward_bytes for b in self.boundaries)
        bw0 = sum(b.backward_bytes for b in self.boundaries)
        loss = self.forward_backward(batch, n_micro)
        norm, lr = self.finish_step()
        fw = sum(b.forward_bytes for b in self.boundaries) - fw0
        bw = sum(b.backward_bytes for b in self.boundaries) - bw0
        return StepResult(loss, norm, lr, fw, bw)

    @torch.no_grad()
    def evaluate(self, data: SampleSet, batch_size: int) -> float:
        """Mean loss over `data` through the stages' exact forward (no codecs, nothing kept).

        Held-out samples have no AQ-SGD buffers and evaluation should measure the weights, not the link,
        so this bypasses the boundaries.
        """
        total, count = 0.0, 0
        for start in range(0, len(data), batch_size):
            batch = data.batch(slice(start, start + batch_size))
            x = batch.tokens
            for worker in self.workers[:-1]:
                x = worker.infer(x)
            total += float(self.workers[-1].infer(x, batch.targets)) * len(batch.sample_ids)
            count += len(batch.sample_ids)
        return total / max(count, 1)


def build_workers(model_cfg: ModelConfig, n_stages: int, stage_cfg: StageConfig | None = None) -> list[StageWorker]:
    """`n_stages` workers holding contiguous, even layer ranges of the model (see `split_layers`)."""
    ranges = split_layers(model_cfg.n_layers, n_stages)
    return [
        StageWorker(build_stage(model_cfg, a, b, i == 0, i == n_stages - 1), stage_cfg)
        for i, (a, b) in enumerate(ranges)
    ]
