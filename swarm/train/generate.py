"""`swarm generate`: text from an exported model, with `transformers`' `generate`, with no swarm.

The directory's tokenizer encodes the prompt and decodes the continuation (the built-in byte-level vocabulary
decodes ids to bytes, invalid UTF-8 shown as U+FFFD). It samples by default, at temperature 0.8 from the 40
likeliest tokens (llama.cpp's defaults), from `--seed`, so the same command prints the same text: greedy decoding
(`--temperature 0`) of a small or briefly trained model repeats its likeliest token, and `swarm demo`'s 2-epoch
model answered "def " with 64 spaces. Prompt and continuation share the model's positions: a long prompt keeps its
end, and the continuation is at most the positions less one token of prompt.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from functools import cache

import torch

from swarm.flags import Flags, flag

__all__ = ["GenerateConfig", "generate_text", "add_arguments", "run"]


@dataclass(frozen=True)
class GenerateConfig:
    """`swarm generate`: the model, the prompt and how to continue it."""

    model: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """a Hugging Face directory (as `swarm export` or `--save-model` writes it); required"""
    prompt: str = ""
    """the text to continue"""
    max_new_tokens: int = 64
    """tokens to generate (capped by the model's positions)"""
    temperature: float = 0.8
    """sampling temperature (0: greedy, which a small model fills with its likeliest token, e.g. spaces)"""
    top_k: int = 40
    """sample from the k likeliest tokens only (0: all)"""
    seed: int = 0
    """seed of the sampling"""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0:
            raise ValueError("--max-new-tokens must be >= 1, --temperature and --top-k >= 0")


@cache
def generate_flags() -> Flags[GenerateConfig]:
    return Flags(GenerateConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    generate_flags().add_to(parser)


def generate_text(cfg: GenerateConfig) -> str:
    """The prompt's continuation (the new text only)."""
    from transformers import AutoTokenizer

    from swarm.model.export import byte_tokenizer
    from swarm.train.evaluate import load_exported

    model, _ = load_exported(cfg.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, local_files_only=True)
        encode, decode = (lambda s: tokenizer(s)["input_ids"]), tokenizer.decode
    except (OSError, ValueError):  # a directory without tokenizer files: the byte-level vocabulary
        tok = byte_tokenizer()
        encode, decode = (lambda s: tok.encode(s).ids), tok.decode
    positions = int(getattr(model.config, "n_positions", None) or model.config.max_position_embeddings)
    ids = encode(cfg.prompt) or [0]  # an empty prompt starts from byte/token 0
    ids = ids[-max(1, positions - cfg.max_new_tokens) :]  # the prompt's end, leaving room for the new tokens
    new = min(cfg.max_new_tokens, positions - len(ids))
    torch.manual_seed(cfg.seed)
    sample = cfg.temperature > 0
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=new,
        do_sample=sample, temperature=cfg.temperature if sample else None, top_k=cfg.top_k if sample else None,
        top_p=None, pad_token_id=0,
    )  # fmt: skip
    return decode(out[0, len(ids) :].tolist())


def run(args: argparse.Namespace) -> int:
    try:
        cfg = generate_flags().from_args(args)
        if cfg.model is None:
            raise ValueError("--model DIR is required")
        with torch.inference_mode():
            text = generate_text(cfg)
    except (ValueError, OSError) as e:
        print(f"swarm generate: {e}", file=sys.stderr)
        return 2
    print(cfg.prompt + text)
    return 0
