"""What the runtime needs of a model, whichever family builds it.

Two kinds of model config exist: `swarm.model.gpt.ModelConfig` (the built-in byte-level GPT) and
`swarm.model.hf.HFModelConfig` (a Hugging Face `transformers` family: GPT-2, Llama). Both expose the same
read-only shape attributes (`vocab_size`, `seq_len_tokens`, `hidden_dim`, `boundary_dim` (a token's activation
at a stage boundary), `n_layers`, `n_heads`, `init_seed`, `tied_embeddings`, `family`), and `build_stage` builds
either's stage with the same interface (`StageModule`), so the runtime, the budget and the scheduler never ask
which family they run.

Every peer and the trainer must build the same model: `model_identity` is a digest of everything that fixes
the weights' shapes and init (not of local paths), which peers compare.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, Union, runtime_checkable

import torch
from torch import nn

from swarm.model.gpt import ModelConfig, config_fields
from swarm.model.gpt import build_stage as build_gpt_stage

if TYPE_CHECKING:
    from swarm.model.hf import HFModelConfig

__all__ = [
    "AnyModelConfig",
    "StageModule",
    "build_stage",
    "resolve_model",
    "model_identity",
    "parameter_count",
    "BUILTIN",
    "BUILTIN_PRESETS",
    "builtin_preset",
]

AnyModelConfig = Union[ModelConfig, "HFModelConfig"]

BUILTIN = "gpt"
"""`--model` value of the built-in byte-level GPT (the default)."""

BUILTIN_PRESETS: dict[str, dict[str, int]] = {
    "gpt-mid": {"hidden_dim": 256, "n_layers": 4, "n_heads": 8},
}
"""Named shapes of the built-in GPT, `--model NAME` (they set hidden, layers and heads; --seq-len and the seed
still apply). `gpt-mid`: twice the default's width (256, heads of 32 like the default's), 3,248,640 parameters
against the default's 837,888 at 128 tokens: codec decisions measured on it are not an artefact of hidden 128."""


def builtin_preset(name: str, base: ModelConfig | None = None) -> ModelConfig:
    """The built-in GPT preset `name` (a key of `BUILTIN_PRESETS`) over `base`'s other fields (sequence length,
    seed; None: the defaults). Raises KeyError naming the presets for another name."""
    if name not in BUILTIN_PRESETS:
        raise KeyError(f"{name!r} is not a built-in preset ({', '.join(BUILTIN_PRESETS)})")
    return replace(base if base is not None else ModelConfig(), **BUILTIN_PRESETS[name])


@runtime_checkable
class StageModule(Protocol):
    """One pipeline stage: layers [layer_start, layer_end), plus embeddings (first) or norm and head (last).

    `forward(x)` takes token ids [B, T] on the first stage and the residual stream [B, T, D] elsewhere, and
    returns the residual stream [B, T, D] (D: the config's `boundary_dim`); on the last stage
    `forward(x, targets)` returns the mean next-token cross-entropy (a scalar, fp32) and `forward(x)` the
    logits [B, T, vocab].
    `tied_parameter()` is this stage's copy of a tied embedding/head (first or last stage of a model with
    `tied_embeddings`), else None: a model without tied embeddings has no tied group in Reduce.
    Parameter names equal the unsplit model's (so state dicts compare name by name)."""

    is_first: bool
    is_last: bool
    layer_start: int
    layer_end: int

    def tied_parameter(self) -> nn.Parameter | None: ...

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor: ...


def build_stage(cfg: AnyModelConfig, layer_start: int, layer_end: int, is_first: bool, is_last: bool) -> nn.Module:
    """The stage [layer_start, layer_end) of `cfg`'s model, of whichever family (a `StageModule`)."""
    if isinstance(cfg, ModelConfig):
        return build_gpt_stage(cfg, layer_start, layer_end, is_first, is_last)
    from swarm.model.hf import HFModelConfig, build_hf_stage

    if isinstance(cfg, HFModelConfig):
        return build_hf_stage(cfg, layer_start, layer_end, is_first, is_last)
    raise TypeError(f"not a model config: {type(cfg).__name__}")


def resolve_model(
    name: str,
    *,
    seq_len_tokens: int | None = None,
    init_seed: int = 0,
    weights: str | None = None,
    builtin: ModelConfig | None = None,
) -> AnyModelConfig:
    """The model a `--model` value names.

    Args:
        name: "gpt" (the built-in model, shaped by `builtin`), a built-in preset of `BUILTIN_PRESETS`
            ("gpt-mid": `builtin`'s sequence length and seed), a preset of `swarm.model.hf.PRESETS` ("gpt2-tiny",
            "llama-tiny", ...), or a local directory holding a Hugging Face config.json.
        seq_len_tokens: tokens per sample (None: the built-in's, or the preset's default).
        init_seed: seed of the deterministic init when no weights are given.
        weights: a local Hugging Face checkpoint directory (safetensors, sharded with an index or not);
            each stage loads only its own layers from it. For a directory `name`, None means "the directory's
            own weights when it has any".
        builtin: the built-in model's shape (from `--layers/--hidden/...`); required for "gpt".
    """
    if name == BUILTIN:
        if weights is not None:
            raise ValueError("--weights needs a Hugging Face model (--model PRESET or a directory), not the built-in")
        return builtin if builtin is not None else ModelConfig(init_seed=init_seed)
    if name in BUILTIN_PRESETS:
        if weights is not None:
            raise ValueError(f"--weights needs a Hugging Face model (--model PRESET or a directory), not {name}")
        return builtin_preset(name, builtin if builtin is not None else ModelConfig(init_seed=init_seed))
    from swarm.model.hf import hf_model_config

    return hf_model_config(name, seq_len_tokens=seq_len_tokens, init_seed=init_seed, weights=weights)


def model_identity(cfg: AnyModelConfig) -> str:
    """Hex SHA-256 of what fixes the model's shapes and init: equal on every peer that builds the same model."""
    if isinstance(cfg, ModelConfig):
        blob = json.dumps({"family": BUILTIN, **config_fields(cfg)}, sort_keys=True)
    else:
        blob = cfg.identity_blob()
    return hashlib.sha256(blob.encode()).hexdigest()


def parameter_count(cfg: AnyModelConfig) -> int:
    """Parameters of the whole model (a tied embedding and head counted once), from a model built on the CPU."""
    model = build_stage(cfg, 0, cfg.n_layers, True, True)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
