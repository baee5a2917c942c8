"""One pipeline stage of a Hugging Face model family, made of `transformers`' own blocks.

A stage holds layers [layer_start, layer_end) under the unsplit model's names (`transformer.h.3.*` for GPT-2,
`model.layers.3.*` for Llama), plus the embeddings on the first stage and the final norm, head and loss on the
last, so a checkpoint loads by name and gradients compare name by name. Llama-family stages compute their
rotary embeddings locally from the positions; attention is causal through sdpa with attention_mask None (no
padding: samples are full sequences). Without weights every parameter is initialised from a generator keyed by
(init seed, its unsplit name), so stages built in different processes hold the unsplit model's weights.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swarm.model.gpt import lm_loss, seed_for

if TYPE_CHECKING:
    from swarm.model.hf import HFModelConfig

__all__ = ["HFStage", "build_hf_stage", "embedding_name", "HEAD"]

HEAD = "lm_head.weight"
"""The head's name in every family (for a tied model, the last stage's own copy of the embedding)."""


def embedding_name(family: str) -> str:
    """The token embedding's name in the unsplit model."""
    return "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"


def _llama_parts(family: str) -> tuple[type, type, type]:
    if family == "llama":
        from transformers.models.llama import modeling_llama as m

        return m.LlamaDecoderLayer, m.LlamaRMSNorm, m.LlamaRotaryEmbedding
    if family == "mistral":
        from transformers.models.mistral import modeling_mistral as m

        return m.MistralDecoderLayer, m.MistralRMSNorm, m.MistralRotaryEmbedding
    if family == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m

        return m.Qwen2DecoderLayer, m.Qwen2RMSNorm, m.Qwen2RotaryEmbedding
    raise ValueError(f"no Llama-style blocks for family {family!r}")


class HFStage(nn.Module):
    """Layers [layer_start, layer_end) of a `transformers` causal LM, plus embeddings (first) or head (last).

    `forward(x)` takes token ids [B, T] on the first stage and the residual stream [B, T, D] elsewhere; the
    last stage returns the fp32 mean cross-entropy against `targets`, or the logits without them.
    """

    def __init__(self, cfg: HFModelConfig, layer_start: int, layer_end: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        hf = cfg.hf_config()
        self.family = cfg.family
        self.tied = cfg.tied_embeddings
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = is_first, is_last
        d, v = cfg.hidden_dim, cfg.vocab_size
        body = nn.Module()
        layers = range(layer_start, layer_end)
        if cfg.family == "gpt2":
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            if is_first:
                body.wte = nn.Embedding(v, d)
                body.wpe = nn.Embedding(hf.n_positions, d)
            # Keyed by the global layer index so that names match the unsplit model's.
            body.h = nn.ModuleDict({str(i): GPT2Block(hf, layer_idx=i) for i in layers})
            if is_last:
                body.ln_f = nn.LayerNorm(d, eps=hf.layer_norm_epsilon)
            self.transformer = body
        else:
            block, norm, rotary = _llama_parts(cfg.family)
            if is_first:
                body.embed_tokens = nn.Embedding(v, d, padding_idx=hf.pad_token_id)
            body.layers = nn.ModuleDict({str(i): block(hf, layer_idx=i) for i in layers})
            if is_last:
                body.norm = norm(d, eps=hf.rms_norm_eps)
            body.rotary_emb = rotary(config=hf)  # buffers only: recomputed here, never shipped
            self.model = body
        if is_last and not (is_first and self.tied):
            self.lm_head = nn.Linear(d, v, bias=False)

    def _embedding(self) -> nn.Embedding:
        return self.transformer.wte if self.family == "gpt2" else self.model.embed_tokens

    def tied_parameter(self) -> nn.Parameter | None:
        """This stage's copy of the tied embedding / head (tied models' end stages only), else None."""
        if not self.tied:
            return None
        if self.is_first:
            return self._embedding().weight
        return self.lm_head.weight if self.is_last else None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.family == "gpt2":
            body = self.transformer
            if self.is_first:
                x = body.wte(x) + body.wpe(torch.arange(x.size(1), device=x.device))
            for block in body.h.values():
                x = block(x)
                x = x[0] if isinstance(x, tuple) else x  # transformers 4 returns a tuple, 5 the tensor
            if self.is_last:
                x = body.ln_f(x)
        else:
            body = self.model
            if self.is_first:
                x = body.embed_tokens(x)
            if len(body.layers):
                positions = torch.arange(x.size(1), device=x.device).unsqueeze(0)
                rope = body.rotary_emb(x, positions)
                for layer in body.layers.values():
                    x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
            if self.is_last:
                x = body.norm(x)
        if not self.is_last:
            return x
        head = self._embedding().weight if self.is_first and self.tied else self.lm_head.weight
        logits = F.linear(x, head)
        if targets is None:
            return logits
        return lm_loss(logits, targets)


def unsplit_name(cfg: HFModelConfig, name: str) -> str:
    """The name whose weights `name` holds in the unsplit model (the tied head copy is the embedding)."""
    return embedding_name(cfg.family) if name == HEAD and cfg.tied_embeddings else name


@torch.no_grad()
def init_parameters(stage: nn.Module, cfg: HFModelConfig) -> None:
    """The family's init, drawn per parameter from a generator keyed by (init seed, unsplit name).

    transformers' `_init_weights`: normal(initializer_range) for linear and embedding weights, norms 1,
    biases 0, GPT-2's residual projections (`c_proj`) scaled by 1/sqrt(2 * n_layers), the pad row zero.
    """
    hf = cfg.hf_config()
    std = float(hf.initializer_range)
    pad = getattr(hf, "pad_token_id", None) if cfg.family != "gpt2" else None
    for local, param in stage.named_parameters():
        name = unsplit_name(cfg, local)
        if name.endswith("bias"):
            param.zero_()
        elif param.ndim == 1:
            param.fill_(1.0)
        else:
            residual = cfg.family == "gpt2" and name.endswith("c_proj.weight")
            scale = std / math.sqrt(2 * cfg.n_layers) if residual else std
            gen = torch.Generator().manual_seed(seed_for(cfg.init_seed, name, namespace="hf:"))
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * scale)
            if name == embedding_name(cfg.family) and pad is not None and 0 <= pad < param.shape[0]:
                param[pad].zero_()


def build_hf_stage(cfg: HFModelConfig, layer_start: int, layer_end: int, is_first: bool, is_last: bool) -> HFStage:
    """One pipeline stage of `cfg`'s model, with exactly the weights of that slice of the unsplit model.

    Args:
        cfg: the model shared by every stage; `cfg.weights_dir` (local safetensors) or `cfg.init_seed` fixes
            the weights.
        layer_start: first decoder layer held, inclusive.
        layer_end: last decoder layer held, exclusive; may equal `layer_start` (embeddings- or head-only).
        is_first: holds the token (and GPT-2's position) embeddings and takes token ids.
        is_last: holds the final norm and the head and computes the loss.
    """
    if not 0 <= layer_start <= layer_end <= cfg.n_layers:
        raise ValueError(f"bad layer range [{layer_start}, {layer_end}) for {cfg.n_layers} layers")
    stage = HFStage(cfg, layer_start, layer_end, is_first, is_last)
    if cfg.weights_dir is None:
        init_parameters(stage, cfg)
    else:
        from swarm.model.hf_weights import load_stage_weights

        load_stage_weights(stage, cfg)
    return stage
