"""HFModelConfig: presets, local directories, clear errors, identity, tokenizers."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from swarm.model.hf import PRESETS, HFModelConfig, hf_model_config, load_tokenizer, save_checkpoint, train_tokenizer
from swarm.model.spec import model_identity, resolve_model


def test_presets_shapes_and_ties() -> None:
    assert {"gpt2-tiny", "llama-tiny", "llama-100m", "gpt2-small"} <= set(PRESETS)
    g = hf_model_config("gpt2-tiny")
    shape = (g.family, g.vocab_size, g.hidden_dim, g.n_layers, g.n_heads, g.tied_embeddings)
    assert shape == ("gpt2", 256, 32, 3, 4, True)
    ll = hf_model_config("llama-tiny")
    shape = (ll.family, ll.vocab_size, ll.n_layers, ll.tied_embeddings, ll.seq_len_tokens)
    assert shape == ("llama", 256, 3, False, 128)
    small = hf_model_config("gpt2-small")
    assert (small.vocab_size, small.hidden_dim, small.n_layers, small.n_heads) == (50257, 768, 12, 12)
    assert resolve_model("llama-tiny", seq_len_tokens=64) == hf_model_config("llama-tiny", seq_len_tokens=64)


@pytest.mark.parametrize("name, low, high", [("llama-100m", 100e6, 130e6), ("gpt2-small", 124e6, 125e6)])
def test_parameter_counts(name: str, low: float, high: float) -> None:
    from transformers import AutoModelForCausalLM

    cfg = hf_model_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg.hf_config())
    n = sum(p.numel() for p in model.parameters())
    assert low <= n <= high, n


def test_config_is_plain_hashable_and_rebuilds_from_its_fields() -> None:
    cfg = hf_model_config("llama-tiny", seq_len_tokens=64, init_seed=3)
    assert all(isinstance(v, (str, int, type(None))) for v in asdict(cfg).values())
    again = HFModelConfig(**asdict(cfg))
    assert again == cfg and hash(again) == hash(cfg)
    with pytest.raises(AttributeError):
        cfg.init_seed = 4  # type: ignore[misc]
    assert json.loads(cfg.config_json)["attention_dropout"] == 0.0


def test_identity_equal_for_equal_models_different_otherwise(tmp_path: Path) -> None:
    base = hf_model_config("llama-tiny")
    assert model_identity(base) == model_identity(hf_model_config("llama-tiny"))
    saved = hf_model_config(str(save_checkpoint(base, tmp_path / "ckpt")))
    assert model_identity(saved) == model_identity(base)  # a saved preset is the same model; paths do not count
    others = [
        hf_model_config("llama-tiny", seq_len_tokens=64),
        hf_model_config("llama-tiny", init_seed=1),
        hf_model_config("mistral-tiny"),
        hf_model_config("gpt2-tiny"),
    ]
    ids = {model_identity(c) for c in [base, *others]}
    assert len(ids) == 5
    assert str(tmp_path) not in saved.identity_blob()


def _write_config(directory: Path, **config) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_directory_config_dropout_forced_off_and_default_seq(tmp_path: Path) -> None:
    d = _write_config(tmp_path / "m", model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=300,
                      resid_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
    cfg = hf_model_config(d)
    assert cfg.weights_dir is None and cfg.seq_len_tokens == 64 and cfg.vocab_size == 300
    hf = cfg.hf_config()
    assert (hf.resid_pdrop, hf.attn_pdrop, hf.embd_pdrop) == (0.0, 0.0, 0.0)


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model 'llama-7b'.*gpt2-tiny.*llama-100m.*llama-tiny"):
        hf_model_config("llama-7b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        hf_model_config(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        hf_model_config(_write_config(tmp_path / "bert", model_type="bert"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        hf_model_config(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"seq_len_tokens 129 is outside \[1, 128\]"):
        hf_model_config("llama-tiny", seq_len_tokens=129)
    with pytest.raises(ValueError, match="outside"):
        hf_model_config("gpt2-tiny", seq_len_tokens=0)
    windowed = _write_config(tmp_path / "w", model_type="mistral", hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                             max_position_embeddings=128, vocab_size=256)  # fmt: skip
    with pytest.raises(ValueError, match="sliding-window"):
        hf_model_config(windowed, seq_len_tokens=64)
    assert hf_model_config(windowed, seq_len_tokens=16).seq_len_tokens == 16
    with pytest.raises(ValueError, match="unsupported model family"):
        HFModelConfig("bert", "{}", 8)


TEXTS = ["the quick brown fox jumps over the lazy dog\n", "pack my box with five dozen liquor jugs\n"] * 50


def test_train_and_load_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "tok" / "tokenizer.json"
    trained = train_tokenizer(TEXTS, 300, path)
    tok = load_tokenizer(path)
    assert tok.get_vocab_size() == trained.get_vocab_size() <= 300
    text = "the lazy fox packs jugs ✓"  # bytes unseen in training still encode (byte-level)
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text


def test_tokenizer_errors_and_discovery(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    big = tmp_path / "big.json"
    train_tokenizer(TEXTS, 400, big)
    with pytest.raises(ValueError, match="more than the model's vocab 256"):
        hf_model_config("llama-tiny", tokenizer=str(big))
    small = tmp_path / "small.json"
    train_tokenizer(TEXTS, 256, small)
    out = save_checkpoint(hf_model_config("llama-tiny", tokenizer=str(small)), tmp_path / "ckpt")
    assert hf_model_config(str(out)).tokenizer_path == str(out / "tokenizer.json")


def test_import_swarm_model_hf_does_not_load_transformers() -> None:
    code = "import sys, swarm.model.hf; print({'transformers', 'tokenizers'} & set(sys.modules) or '')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""


def test_config_json_from_a_string_is_validated() -> None:
    cfg = hf_model_config("gpt2-tiny")
    with pytest.raises(ValueError, match="not a llama config"):
        HFModelConfig("llama", cfg.config_json, 8)
    with pytest.raises(ValueError, match="not a gpt2 config"):
        HFModelConfig("gpt2", "[1]", 8)
    with pytest.raises(ValueError, match="longer than"):
        HFModelConfig("gpt2", " " * (2 << 20), 8)
