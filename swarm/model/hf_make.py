"""Make a local Hugging Face model directory (config, sharded safetensors, tokenizer) from a preset, offline.

`python -m swarm.model.hf_make --model llama-100m --out runs/llama100m` writes what `--model DIR` reads: the
preset's config.json, its deterministic init as a sharded checkpoint (the writer holds the whole model once;
peers then load only their layers), and a byte-level BPE tokenizer trained on the local corpus (the same
default corpus as the data set). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from swarm.model.data import load_corpus
from swarm.model.hf import hf_model_config, save_checkpoint, train_tokenizer
from swarm.model.hf_weights import INDEX

__all__ = ["make_model_dir", "main"]


def make_model_dir(
    model: str,
    out_dir: str | Path,
    *,
    init_seed: int = 0,
    max_shard_size: str = "200MB",
    tokenizer_vocab: int | None = None,
    data: str | None = None,
    max_corpus_bytes: int = 8_000_000,
) -> dict:
    """Write `model`'s config, init weights and (unless `tokenizer_vocab` is 0) a tokenizer to `out_dir`.

    Args:
        model: a preset name or a local directory (see `hf_model_config`).
        out_dir: where to write; `hf_model_config(out_dir)` reads it back.
        init_seed: seed of the weights written.
        max_shard_size: `save_pretrained`'s shard limit.
        tokenizer_vocab: BPE vocabulary to train (None: the model's vocab; 0: no tokenizer).
        data: the tokenizer's training text (a file or folder; None: the data set's default corpus).
        max_corpus_bytes: read at most this much of it.

    Returns:
        A summary (paths, parameter count, shards, times) for printing.
    """
    cfg = hf_model_config(model, init_seed=init_seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"model": model, "out": str(out), "family": cfg.family, "vocab_size": cfg.vocab_size}
    vocab = cfg.vocab_size if tokenizer_vocab is None else tokenizer_vocab
    tokenizer = None
    if vocab:
        if vocab > cfg.vocab_size:
            raise ValueError(f"tokenizer vocab {vocab} exceeds the model's {cfg.vocab_size}")
        corpus, source = load_corpus(data, max_corpus_bytes)
        t0 = time.perf_counter()
        lines = corpus.decode("utf-8", "replace").splitlines(keepends=True)
        tok = train_tokenizer(lines, vocab, out / "tokenizer.json")
        tokenizer = str(out / "tokenizer.json")
        summary.update(tokenizer=tokenizer, tokenizer_vocab=tok.get_vocab_size(), corpus=source)
        summary["tokenizer_train_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    save_checkpoint(cfg, out, max_shard_size=max_shard_size, tokenizer=None)
    summary["save_s"] = round(time.perf_counter() - t0, 2)
    index = out / INDEX
    if index.is_file():
        meta = json.loads(index.read_text())
        summary["shards"] = len(set(meta["weight_map"].values()))
        summary["checkpoint_bytes"] = meta.get("metadata", {}).get("total_size")
    back = hf_model_config(str(out), tokenizer=tokenizer)
    summary["n_layers"], summary["weights_dir"] = back.n_layers, back.weights_dir
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.model.hf_make", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="preset name (e.g. llama-100m) or a local model directory")
    parser.add_argument("--out", required=True, help="directory to write config.json, safetensors and tokenizer.json")
    parser.add_argument("--init-seed", type=int, default=0, help="seed of the deterministic init written (default 0)")
    parser.add_argument("--max-shard-size", default="200MB", help="largest safetensors shard (default 200MB)")
    parser.add_argument(
        "--tokenizer-vocab", type=int, default=None, help="BPE vocabulary to train (default: the model's; 0: none)"
    )
    parser.add_argument("--data", default=None, help="tokenizer training text, file or folder (default: stdlib docs)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        summary = make_model_dir(
            args.model,
            args.out,
            init_seed=args.init_seed,
            max_shard_size=args.max_shard_size,
            tokenizer_vocab=args.tokenizer_vocab,
            data=args.data,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        for key, value in summary.items():
            print(f"{key:>18}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
