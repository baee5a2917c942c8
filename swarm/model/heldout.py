"""The held-out loss: the windows a run holds out of training and a model's mean next-token loss on them.

One definition for every place that reports it (`swarm eval`, the export's check, the trainer), so the numbers
compare: the windows are `build_datasets`' held-out slice for the run's data, sequence length, held-out sample
count and tokenizer (and, for a `--data` text, its training sample count: its held-out windows follow what was
read), and the loss is the mean cross-entropy over every target token, accumulated in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from swarm.model.data import DataConfig, SampleSet, build_datasets

__all__ = ["DEFAULT_EVAL_SAMPLES", "held_out_windows", "held_out_loss"]

DEFAULT_EVAL_SAMPLES = DataConfig.eval_samples
"""Held-out windows when a run does not say (the data set's default)."""


def held_out_windows(
    data: str | None,
    seq_len_tokens: int,
    train_samples: int | None,
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
    tokenizer: str | None = None,
) -> SampleSet:
    """The held-out windows of a run that trained on `train_samples` windows of `data` (None: the default corpus),
    `seq_len_tokens` tokens each, tokenized by `tokenizer` (None: bytes).

    Raises:
        ValueError: the corpus is too small, or `eval_samples` < 1.
    """
    if eval_samples < 1:
        raise ValueError(f"need at least one held-out window, got eval_samples={eval_samples}")
    cfg = DataConfig(
        path=data, seq_len_tokens=seq_len_tokens, train_samples=train_samples, eval_samples=eval_samples,
        tokenizer=tokenizer,
    )  # fmt: skip
    return build_datasets(cfg)[1]


@torch.no_grad()
def held_out_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], windows: SampleSet, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy of `logits_of(tokens [B, T]) -> logits [B, T, V]` over every target token of
    `windows` (fp32 logits, float64 sum), batch by batch."""
    if len(windows) == 0:
        raise ValueError("no held-out windows")
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows.batch(slice(start, start + batch_size))
        logits = logits_of(batch.tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch.targets.reshape(-1), reduction="sum")
        total += float(loss.double())
        count += batch.targets.numel()
    return total / count
