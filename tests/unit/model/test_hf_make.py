"""`python -m swarm.model.hf_make`: a local model directory (config, shards, tokenizer) that --model DIR reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from swarm.model.hf import build_hf_stage, hf_model_config
from swarm.model.hf_make import main
from swarm.model.spec import model_identity


def test_make_model_dir_round_trips(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a small local corpus for a byte-level tokenizer, nothing downloaded\n" * 40)
    out = tmp_path / "llama"
    args = ["--model", "llama-tiny", "--out", str(out), "--init-seed", "3", "--max-shard-size", "20KB"]
    assert main([*args, "--tokenizer-vocab", "256", "--data", str(corpus), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shards"] >= 2 and summary["tokenizer_vocab"] == 256
    cfg = hf_model_config(str(out))
    assert cfg.tokenizer_path == str(out / "tokenizer.json") and cfg.weights_dir == str(out.resolve())
    assert model_identity(cfg) == model_identity(hf_model_config("llama-tiny"))  # same shapes, seq 128 both
    seeded = dict(build_hf_stage(hf_model_config("llama-tiny", init_seed=3), 2, 3, False, True).named_parameters())
    for n, p in build_hf_stage(cfg, 2, 3, False, True).named_parameters():
        assert torch.equal(p, seeded[n]), n


def test_make_model_dir_errors_are_reported(tmp_path: Path, capsys) -> None:
    assert main(["--model", "llama-tiny", "--out", str(tmp_path), "--tokenizer-vocab", "999"]) == 2
    assert "exceeds the model's 256" in capsys.readouterr().err
    assert main(["--model", "nope", "--out", str(tmp_path)]) == 2
