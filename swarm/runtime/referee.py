"""The trainer as the third opinion on a dispute between two replicas of a stage (`swarm.runtime.verify`).

Two replicas that recompute one input differently, each consistently with itself (a worker whose module itself
lies, also when asked to recompute), cannot be told apart by each other. The trainer then recomputes that
micro-batch itself: it fetches the stage's weights (`GetState`, the `model.*` tensors only: the call is cancelled
at the first optimizer tensor) from one of the two, checks them against the sampled digest both replicas reported
after the last applied step (so the weights are the ones both claim to hold, whoever sent them), builds the
stage's module from the run's model config and recomputes from the reported input. The replica whose number
disagrees with the trainer's is the liar (the verifier decides; this module only recomputes).

Cost: one fetch per dispute, of the stage's weights (4 bytes a parameter, plus framing), and one forward and
input-gradient backward of one micro-batch on the trainer. Disputes happen only under attack (honest runs: 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from swarm.compression import CodecConfig, Unframer, WireError, make_codec
from swarm.model.spec import AnyModelConfig, build_stage
from swarm.runtime.audit import Recomputed, recompute
from swarm.runtime.average import sampled_digest
from swarm.runtime.worker import StageConfig, StageWorker

__all__ = ["RefereeFailed", "StageReferee", "weights_from_items"]

FRAMING_SLACK = 1 << 16
"""Bytes of framing a fetched weight tensor may add over its 4 bytes an element."""


class RefereeFailed(Exception):
    """The trainer could not recompute with trusted weights (fetch refused or cut, digest mismatch, another
    stage's names): the dispute stays a dispute, nobody is evicted."""


def weights_from_items(items: Iterator, expected: dict[str, torch.Size], source: str) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of a GetState stream, bounded by `expected` (name -> shape): a name outside it, a
    repeat, or more bytes than its shape holds is refused; the stream is cancelled at the first non-weight item
    (the optimizer's moments are never read)."""
    fp32 = make_codec(CodecConfig("fp32"))
    tensors: dict[str, torch.Tensor] = {}
    unframers: dict[str, Unframer] = {}
    sizes: dict[str, int] = {}
    try:
        for item in items:
            if not item.name.startswith("model."):
                break  # the weights come first (`handover_tensors`): the rest is optimizer state, not wanted
            name = item.name[len("model.") :]
            if name not in expected or name in tensors:
                raise RefereeFailed(f"{source} sent weight {name[:64]!r} twice or not of this stage")
            sizes[name] = sizes.get(name, 0) + len(item.chunk.data)
            if sizes[name] > 4 * expected[name].numel() + FRAMING_SLACK:
                raise RefereeFailed(f"{source} sent more bytes for {name[:64]!r} than its shape holds")
            msg = unframers.setdefault(name, Unframer()).feed(item.chunk)
            if msg is not None:
                tensors[name] = fp32.decode(msg)
    except WireError as e:
        raise RefereeFailed(f"{source} sent malformed weights: {e}") from e
    finally:
        for close in (getattr(items, "cancel", None), getattr(items, "close", None)):
            if close is not None:
                close()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise RefereeFailed(f"{source} sent no {missing[:4]} ({len(missing)} weights missing)")
    return tensors


class StageReferee:
    """Recomputes one stage's micro-batch on the trainer, with weights fetched from a replica and checked
    against the replicas' digest.

    Args:
        model: the run's model config (every stage is a slice of it).
        layers: each stage's [start, end) layers, as the plan splits them.
        stage_cfg: the stages' precision (recomputed on this machine's CPU: fp16 falls back as a CPU worker's does).
    """

    def __init__(self, model: AnyModelConfig, layers: Sequence[tuple[int, int]], stage_cfg: StageConfig | None = None):
        self.model, self.layers = model, [tuple(r) for r in layers]
        self.stage_cfg = stage_cfg or StageConfig()
        self.fetched_bytes = 0
        """bytes of weights fetched so far (every dispute's)"""

    def __call__(
        self,
        stage: int,
        fetch: Callable[[], Iterator],
        source: str,
        digest: tuple[int, int, str],
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        grad: torch.Tensor | None,
    ) -> Recomputed:
        """Stage `stage`'s recomputation of `inputs` (and, with `grad`, the input gradient) with the weights
        `fetch()` streams (GetState items from `source`), after checking that their sampled digest under
        `digest` (stride, seed, expected) is the one the replicas reported. Raises RefereeFailed."""
        n = len(self.layers)
        start, end = self.layers[stage]
        module = build_stage(self.model, start, end, stage == 0, stage == n - 1)
        expected = {k: v.shape for k, v in module.state_dict().items()}
        try:
            items = fetch()
        except Exception as e:  # noqa: BLE001 - any failure to fetch leaves the dispute a dispute
            raise RefereeFailed(f"GetState from {source} failed: {e}") from e
        try:
            tensors = weights_from_items(items, expected, source)
        except RefereeFailed:
            raise
        except Exception as e:  # noqa: BLE001 - a stream cut halfway, a refusal mid-stream
            raise RefereeFailed(f"GetState from {source} failed: {e}") from e
        self.fetched_bytes += sum(4 * t.numel() for t in tensors.values())
        try:
            module.load_state_dict({k: t.reshape(expected[k]) for k, t in tensors.items()}, strict=True)
        except (RuntimeError, ValueError) as e:
            raise RefereeFailed(f"{source}'s weights do not fit stage {stage}: {e}") from e
        stride, seed, want = digest
        got = sampled_digest(sorted(module.named_parameters()), stride, seed)
        if got != want:
            raise RefereeFailed(f"{source}'s weights are not the ones both replicas reported (digest {got[:12]})")
        worker = StageWorker(module, dataclasses.replace(self.stage_cfg, device="cpu"))
        return recompute(worker, inputs, targets, grad)
