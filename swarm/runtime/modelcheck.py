"""Peers and trainers agree on the model: each stage reports `model_identity` in its Status, and whoever
meets a stage of another model refuses it with an error naming both.

The identity is `swarm.model.spec.model_identity`: a digest of what fixes the weights' shapes and init (never
local paths), so two peers that load the same checkpoint from different directories agree. A peer reports
its own identity, so this catches mistakes (a peer started with another `--model`), not liars.
"""

from __future__ import annotations

__all__ = ["ModelMismatch", "model_label", "check_status"]


class ModelMismatch(RuntimeError):
    """A stage serves a slice of another model than the caller's."""


def model_label(cfg) -> str:
    """A short human description of an `AnyModelConfig`: family, layers, width, vocabulary, sequence length."""
    family = getattr(cfg, "family", "gpt")
    return (
        f"{family} {cfg.n_layers} layers x {cfg.hidden_dim} wide, vocab {cfg.vocab_size}, "
        f"seq {cfg.seq_len_tokens}, {'tied' if cfg.tied_embeddings else 'untied'} head"
    )


def check_status(reply, identity: str, label: str, where: str) -> None:
    """Raises `ModelMismatch` unless the StatusReply `reply` reports `identity` (a stage of an older swarm
    reports none: also refused, it cannot say which model it serves)."""
    theirs = reply.model_identity
    if theirs != identity:
        mine = f"{identity[:16]}" + (f" ({label})" if label else "")
        raise ModelMismatch(
            f"{where} serves model {theirs[:16] or '(unknown)'} but this one trains/serves model {mine}: "
            "start every peer and the trainer with the same --model/--seq-len/--model-seed"
        )
