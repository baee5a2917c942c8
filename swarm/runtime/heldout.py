"""Held-out loss over a swarm: each batch of held-out windows runs forward through one live route, stage by stage.

The forward-only call is `Stage.Recompute` without a gradient (the audit's call, `swarm.runtime.audit.recompute`):
the stage's exact forward with its current weights, in its precision, served to trainers only and changing no
state: no link end, no AQ-SGD message buffer, no saved activation, no gradient, no optimizer step. Activations go
to the trainer and on to the next stage in fp32 (held-out windows have no message buffers, and evaluation
measures the weights, not the link), so the loss is the one the unsplit model gives, as
`LocalPipeline.evaluate` computes it in one process.

    trainer                      stage 0            stage k             last stage
    tokens --Recompute---------> x = embed+blocks
           <--------------------- x (fp32)
           x ---Recompute-------------------------> x = blocks(x)
           <------------------------------------- x (fp32)
           x, labels ---Recompute---------------------------------------> loss = CE(head(x), labels)
           <------------------------------------------------------------- loss
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from swarm.compression import CodecConfig, WireError, make_codec
from swarm.model.data import SampleSet
from swarm.net.stream import tokens_to_wire
from swarm.proto import stage_pb2

__all__ = ["HeldOutLoss", "held_out_loss"]

Call = Callable[..., object]
"""`call(stage, replica, method, request, timeout=...) -> reply`: the driver's `_call`, which names a failed call's
stage and peer (`StageCallError`)."""


@dataclass(frozen=True)
class HeldOutLoss:
    """One evaluation's result."""

    loss: float
    """mean loss per token over the held-out windows"""
    samples: int
    """held-out windows evaluated"""
    bytes: int
    """serialized bytes of its calls, requests and replies (outside the steps' byte counts)"""
    seconds: float
    """wall-clock seconds it took"""


def held_out_loss(
    call: Call,
    replicas: Sequence[int],
    data: SampleSet,
    rows: int,
    step: int,
    plan_version: int,
    hidden: int,
    timeout_s: float = 60.0,
) -> HeldOutLoss:
    """The mean loss of the stages' current weights on `data`, `rows` windows per call, through replica
    `replicas[s]` of each stage s.

    Args:
        call: how a stage is called (`PipelineDriver._call`).
        replicas: the replica of each stage, in pipeline order (one live route).
        data: the held-out windows.
        rows: windows per call (at most the stages' micro-batch budget).
        step: the next step to run: a stage refuses a Recompute of a step it applied already, so the weights are
            those after step `step - 1`.
        plan_version: the plan the stages follow (a stage on another refuses, naming it).
        hidden: the model's width: every activation a stage returns must be [rows, seq, hidden].
        timeout_s: longest one call may take.

    Raises:
        StageCallError: a stage refused or failed (from `call`).
        WireError: a stage's reply is not an activation of this batch, or its loss is not finite.
    """
    if rows < 1 or not len(data):
        raise ValueError(f"held-out evaluation needs rows >= 1 and windows, got rows={rows}, {len(data)} windows")
    codec = make_codec(CodecConfig.parse("fp32"))
    started, nbytes, total, n = time.perf_counter(), 0, 0.0, len(replicas)
    for begin in range(0, len(data), rows):
        batch = data.batch(slice(begin, begin + rows))
        x: torch.Tensor | None = None
        for s, r in enumerate(replicas):
            request = stage_pb2.RecomputeRequest(step=step, plan_version=plan_version, stage=s)
            if s == 0:
                request.tokens.CopyFrom(tokens_to_wire(batch.tokens))
            else:
                request.input.CopyFrom(codec.encode(x))
            if s == n - 1:
                request.targets.CopyFrom(tokens_to_wire(batch.targets))
            reply = call(s, r, "Recompute", request, timeout=timeout_s)
            nbytes += request.ByteSize() + reply.ByteSize()
            if s < n - 1:
                x = _activation(codec, reply, s, (*batch.tokens.shape, hidden))
            elif not math.isfinite(reply.loss) or reply.loss < 0:
                raise WireError("loss", f"stage {s} returned a held-out loss of {reply.loss}")
            else:
                total += reply.loss * len(batch.sample_ids)
    return HeldOutLoss(total / len(data), len(data), nbytes, time.perf_counter() - started)


def _activation(codec, reply, stage: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The activation of a Recompute reply, checked: [rows, seq, hidden] and finite."""
    if not reply.HasField("output"):
        raise WireError("output", f"stage {stage} returned no activation")
    x = codec.decode(reply.output)
    if tuple(x.shape) != shape:
        raise WireError("output", f"stage {stage} returned an activation shaped {list(x.shape)}, not {list(shape)}")
    if not torch.isfinite(x).all():
        raise WireError("output", f"stage {stage} returned a non-finite activation")
    return x.float()
