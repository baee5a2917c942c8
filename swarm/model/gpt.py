"""A small GPT-style decoder and its split into pipeline stages by contiguous layer ranges.

Every parameter is initialised from its own generator, seeded by the model seed and the parameter's
name in the unsplit model. A stage built in another process from the same config therefore holds exactly
the weights of the same slice of the full model, without anyone shipping a checkpoint around. Stage
modules name their parameters as the full model does (`blocks.2.attn.qkv.weight`), so state dicts and
gradients can be compared name by name.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelConfig", "GPT", "Stage", "Subspace", "build_stage", "config_fields", "split_layers", "subspace_basis",
    "TIED_EMBEDDING", "TIED_HEAD",
]  # fmt: skip

TIED_EMBEDDING = "tok_emb.weight"
"""Name of the token embedding, owned by the first stage (and by the unsplit model)."""
TIED_HEAD = "head_weight"
"""Name of the last stage's copy of the token embedding, used as the LM head when it is not stage 0."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and initialisation of the decoder; the defaults train in minutes on 2 CPU cores."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256: byte-level)."""
    seq_len_tokens: int = 128
    """Longest sequence the position embedding covers, in tokens."""
    hidden_dim: int = 128
    """Width of the residual stream (the size of one token's activation at a stage boundary)."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide `hidden_dim`."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of `hidden_dim`."""
    init_std: float = 0.02
    """Standard deviation of the normal init of embeddings and linear weights (GPT-2's)."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    init_seed: int = 0
    """Seed of the deterministic per-parameter init."""
    subspace_dim: int = 0
    """A compression-aware architecture for training from scratch (issue 29; Protocol Models' shared subspace,
    fixed rather than learned): the residual stream is kept in a `subspace_dim`-dimensional subspace of the
    hidden width, projected onto it after the embeddings and after every block, so a stage boundary carries
    `subspace_dim` coefficients a token (`boundary_dim`) and the next stage rebuilds the stream from them exactly.
    The subspace is a random orthonormal basis drawn from `init_seed` (`subspace_basis`), the same in every
    process and never trained, so no stage has to agree on it with another at run time. 0: off (the plain GPT)."""

    @property
    def family(self) -> str:
        """The model family ("gpt": this built-in model; Hugging Face families are in `swarm.model.hf`)."""
        return "gpt"

    @property
    def tied_embeddings(self) -> bool:
        """The LM head is the token embedding (its two copies are summed by the end stages' tied group)."""
        return True

    @property
    def boundary_dim(self) -> int:
        """Width of one token's activation at a stage boundary: `subspace_dim` where the stream is kept in a
        subspace, else `hidden_dim`."""
        return self.subspace_dim or self.hidden_dim

    def __post_init__(self) -> None:
        if self.hidden_dim % self.n_heads:
            raise ValueError(f"hidden_dim {self.hidden_dim} is not divisible by n_heads {self.n_heads}")
        for name in ("vocab_size", "seq_len_tokens", "hidden_dim", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.subspace_dim <= self.hidden_dim:
            raise ValueError(f"subspace_dim must be in 0..hidden_dim ({self.hidden_dim}), got {self.subspace_dim}")


def config_fields(cfg: ModelConfig) -> dict:
    """The config as a dict for identities and records: `subspace_dim` only where it is on, so a plain GPT's
    identity and records are what they were before the field existed (older checkpoints still match)."""
    d = asdict(cfg)
    if not d["subspace_dim"]:
        del d["subspace_dim"]
    return d


def subspace_basis(cfg: ModelConfig) -> torch.Tensor | None:
    """The orthonormal basis [hidden_dim, subspace_dim] of the stream's subspace (`ModelConfig.subspace_dim`),
    drawn from `init_seed` alone: every stage of every process holds the same one. None without a subspace."""
    if not cfg.subspace_dim:
        return None
    gen = torch.Generator().manual_seed(seed_for(cfg.init_seed, "subspace_basis"))
    q, r = torch.linalg.qr(torch.randn(cfg.hidden_dim, cfg.subspace_dim, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()  # signs fixed: one basis whatever the QR's convention


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.hidden_dim, 3 * cfg.hidden_dim, bias=False)
        self.proj = nn.Linear(cfg.hidden_dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_dim, cfg.mlp_ratio * cfg.hidden_dim, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.hidden_dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _blocks(cfg: ModelConfig, layer_start: int, layer_end: int) -> nn.ModuleDict:
    # Keyed by the global layer index so that parameter names match the unsplit model's.
    return nn.ModuleDict({str(i): Block(cfg) for i in range(layer_start, layer_end)})


def seed_for(seed: int, name: str, namespace: str = "") -> int:
    """The generator seed of parameter `name` (its name in the unsplit model) under the model seed: stable
    across processes, so every stage draws its slice of the unsplit model's weights. `namespace` keeps
    families apart (Hugging Face stages use "hf:")."""
    digest = hashlib.sha256(f"{namespace}{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def _init_parameters(module: nn.Module, cfg: ModelConfig, rename: dict[str, str] | None = None) -> None:
    """Initialise every parameter from a generator keyed by (seed, its name in the unsplit model).

    Residual output projections get GPT-2's 1/sqrt(2 * n_layers) scaling so the residual stream does not
    grow with depth.

    Parameters on the meta device (shapes only, `swarm.scheduler.sizes.layer_shapes`) hold no values and are
    left as they are: a seeded draw there runs torch's Python reference for `normal_`, whose first call imports
    `torch._dynamo` (1-1.5 CPU-s in every peer that prices a plan, the compiler stack `swarm.daemon.lean` keeps
    out of peers).
    """
    rename = rename or {}
    for local_name, param in module.named_parameters():
        if param.is_meta:
            continue
        name = rename.get(local_name, local_name)
        if name.endswith(("ln1.weight", "ln2.weight", "norm.weight")):
            param.fill_(1.0)
        elif name.endswith(("ln1.bias", "ln2.bias", "norm.bias")):
            param.zero_()
        else:
            std = cfg.init_std
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                std /= math.sqrt(2 * cfg.n_layers)
            gen = torch.Generator().manual_seed(seed_for(cfg.init_seed, name))
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPT(nn.Module):
    """The unsplit model: the single-process reference that every pipeline must reproduce."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_dim)
        self.pos_emb = nn.Embedding(cfg.seq_len_tokens, cfg.hidden_dim)
        self.blocks = _blocks(cfg, 0, cfg.n_layers)
        self.norm = nn.LayerNorm(cfg.hidden_dim, eps=cfg.norm_eps)
        _init_parameters(self, cfg)
        self.subspace = Subspace(cfg)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab], or the mean next-token cross-entropy when `targets` is given."""
        pos = torch.arange(tokens.size(1), device=tokens.device)
        x = self.subspace.project(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = self.subspace.project(block(x))
        logits = self.norm(x) @ self.tok_emb.weight.t()
        return logits if targets is None else lm_loss(logits, targets)


class Subspace(nn.Module):
    """The stream's fixed subspace (`ModelConfig.subspace_dim`): projects the stream onto it, and turns it into
    the boundary's coefficients and back. Without a subspace every method returns its input. The basis is a
    non-persistent buffer: rebuilt from the config, never in a checkpoint or a state dict, never trained."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        basis = subspace_basis(cfg)
        self.on = basis is not None
        self.register_buffer("basis", basis if basis is not None else torch.empty(0), persistent=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return x
        basis = self.basis.to(x.dtype)
        return (x @ basis) @ basis.t()

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] in the subspace -> [B, T, subspace_dim]: what crosses a stage boundary."""
        return x @ self.basis.to(x.dtype) if self.on else x

    def expand(self, c: torch.Tensor) -> torch.Tensor:
        """The boundary's coefficients -> the stream (exact for a stream in the subspace)."""
        return c @ self.basis.to(c.dtype).t() if self.on else c


class Stage(nn.Module):
    """Layers [layer_start, layer_end) of the model, plus the embeddings (first) or norm, head, loss (last).

    Input is token ids [B, T] on the first stage and the residual stream [B, T, D] elsewhere (its
    `boundary_dim` coefficients where the model keeps the stream in a subspace); output is the same, or on the
    last stage the loss (with targets) or logits (without).
    """

    def __init__(self, cfg: ModelConfig, layer_start: int, layer_end: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_dim)
            self.pos_emb = nn.Embedding(cfg.seq_len_tokens, cfg.hidden_dim)
        self.blocks = _blocks(cfg, layer_start, layer_end)
        if is_last:
            self.norm = nn.LayerNorm(cfg.hidden_dim, eps=cfg.norm_eps)
            if not is_first:
                # The last stage's own copy of the tied embedding; kept equal to stage 0's by summing
                # the two gradients every step (see `tied_parameter`).
                self.head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_dim))
        _init_parameters(self, cfg, rename={TIED_HEAD: TIED_EMBEDDING})
        self.subspace = Subspace(cfg)

    def tied_parameter(self) -> nn.Parameter | None:
        """This stage's copy of the tied token embedding / LM head, if it holds one."""
        if self.is_first:
            return self.tok_emb.weight
        return self.head_weight if self.is_last else None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.subspace.project(self.tok_emb(x) + self.pos_emb(pos))
        else:
            x = self.subspace.expand(x)  # the previous stage's coefficients (or the stream itself) -> the stream
        for block in self.blocks.values():
            x = self.subspace.project(block(x))
        if not self.is_last:
            return self.subspace.coefficients(x)
        head = self.tok_emb.weight if self.is_first else self.head_weight
        logits = self.norm(x) @ head.t()
        return logits if targets is None else lm_loss(logits, targets)


def build_stage(cfg: ModelConfig, layer_start: int, layer_end: int, is_first: bool, is_last: bool) -> Stage:
    """One pipeline stage, with exactly the weights of that slice of `GPT(cfg)`.

    Args:
        cfg: the model config shared by every stage (its `init_seed` fixes the weights).
        layer_start: first transformer block held, inclusive.
        layer_end: last transformer block held, exclusive; may equal `layer_start` for an
            embeddings-only or head-only stage.
        is_first: holds the token and position embeddings and takes token ids.
        is_last: holds the final norm and the (tied) LM head and computes the loss.
    """
    if not 0 <= layer_start <= layer_end <= cfg.n_layers:
        raise ValueError(f"bad layer range [{layer_start}, {layer_end}) for {cfg.n_layers} layers")
    return Stage(cfg, layer_start, layer_end, is_first, is_last)


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous, as-even-as-possible layer ranges, earlier stages taking the remainder.

    The first stage also runs the embeddings and the last the head, which for small models cost about
    as much as a block; an even split keeps this helper predictable, and the scheduler can do better.
    """
    if not 1 <= n_stages <= max(n_layers, 1):
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
