"""`swarm eval`: the held-out loss of an exported model, loaded by `transformers`, with no swarm.

By default on the held-out windows of the run it was exported from (`swarm_export.json`'s `held_out`: the same
data, sequence length, sample counts and tokenizer, so the number compares with the run's own `held_out_loss`);
`--data` and the counts override them. The loss is `swarm.model.heldout.held_out_loss`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from swarm.flags import Flags, flag

__all__ = ["EvalConfig", "load_exported", "evaluate_dir", "add_arguments", "run"]


@dataclass(frozen=True)
class EvalConfig:
    """`swarm eval`: which model, on which held-out windows."""

    model: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """a Hugging Face directory (as `swarm export` or `--save-model` writes it); required"""
    data: str | None = field(default=None, metadata=flag(metavar="PATH"))
    """text to take the held-out windows from (none: the run's, as recorded in the directory, else the default
    corpus)"""
    train_samples: int | None = None
    """training windows before the held-out ones (none: the run's; a directory without a record: the data
    set's default)"""
    eval_samples: int | None = None
    """held-out windows (none: the run's, else the data set's default)"""
    batch_size: int = 16
    """windows per forward"""


@cache
def eval_flags() -> Flags[EvalConfig]:
    return Flags(EvalConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    eval_flags().add_to(parser)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def load_exported(directory: str | Path):
    """(the `transformers` causal LM in `directory`, in eval mode, fp32; the directory's export record or {}).
    Local files only: nothing is downloaded."""
    from transformers import AutoModelForCausalLM

    from swarm.model.export import read_export_info

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory}: no config.json (not a Hugging Face model directory)")
    info = read_export_info(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    return model.eval(), info


def evaluate_dir(cfg: EvalConfig) -> dict[str, Any]:
    """The held-out loss of `cfg.model` and the windows it was measured on."""
    from swarm.model.data import DataConfig
    from swarm.model.heldout import held_out_loss, held_out_windows

    model, info = load_exported(cfg.model)
    held = info.get("held_out", {})
    recorded = bool(held)
    own = Path(cfg.model) / "tokenizer.json"  # the directory's copy, not a path on the machine that trained
    if recorded:
        tokenizer = None if info.get("tokenizer") == "bytes" else str(own)
    else:
        tokenizer = str(own) if own.is_file() else None
    data = cfg.data if cfg.data is not None else held.get("data")
    train_samples = held.get("train_samples", DataConfig.train_samples)
    train_samples = cfg.train_samples if cfg.train_samples is not None else train_samples
    eval_samples = cfg.eval_samples if cfg.eval_samples is not None else held.get("eval_samples")
    eval_samples = eval_samples if eval_samples is not None else DataConfig.eval_samples
    seq_len = int(held.get("seq_len_tokens") or model.config.max_position_embeddings)
    windows = held_out_windows(data, seq_len, train_samples, eval_samples, tokenizer)
    loss = held_out_loss(lambda tokens: model(tokens).logits, windows, cfg.batch_size)
    return {
        "held_out_loss": loss, "model": str(cfg.model), "family": model.config.model_type, "data": data,
        "eval_samples": len(windows), "eval_tokens": windows.n_tokens, "train_samples": train_samples,
        "seq_len_tokens": seq_len, "tokenizer": "bytes" if tokenizer is None else "tokenizer.json",
        "windows": "the run's (recorded)" if recorded and cfg.data is None else "as given",
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        cfg = eval_flags().from_args(args)
        if cfg.model is None:
            raise ValueError("--model DIR is required")
        with torch.inference_mode():
            result = evaluate_dir(cfg)
    except (ValueError, OSError) as e:
        print(f"swarm eval: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"held-out loss {result['held_out_loss']:.4f} on {result['eval_samples']} windows "
              f"({result['eval_tokens']:,} tokens, {result['windows']}) of {cfg.model}")  # fmt: skip
    return 0
