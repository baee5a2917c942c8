"""Export to Hugging Face: the built-in GPT is GPT-2 exactly, the families are themselves, `transformers` loads the
directory and reproduces the pipeline's held-out loss, and the byte vocabulary's ids are byte values."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarm.model.export import (
    EXPORT_FILE,
    byte_tokenizer,
    hf_model_of,
    model_from_json,
    model_to_json,
    read_export_info,
    tied_pair,
    weight_shapes,
    write_hf_dir,
)
from swarm.model.gpt import TIED_EMBEDDING, TIED_HEAD, ModelConfig, build_stage, split_layers
from swarm.model.heldout import held_out_loss, held_out_windows

CFG = ModelConfig(vocab_size=256, seq_len_tokens=32, hidden_dim=32, n_layers=3, n_heads=4, init_seed=5)


def _trained_weights(cfg: ModelConfig = CFG, n_stages: int = 2, drift: float = 0.0) -> dict[str, torch.Tensor]:
    """The weights of an n-stage pipeline moved away from the init (biases and norms too), the last stage's head
    copy `drift` away from the embedding (a compressed tied sum)."""
    weights = {}
    gen = torch.Generator().manual_seed(1)
    for i, (start, end) in enumerate(split_layers(cfg.n_layers, n_stages)):
        stage = build_stage(cfg, start, end, i == 0, i == n_stages - 1)
        for k, v in stage.state_dict().items():
            weights[k] = v + 0.05 * torch.randn(v.shape, generator=gen)
    if TIED_HEAD in weights:
        weights[TIED_HEAD] = weights[TIED_EMBEDDING] + drift * torch.randn(weights[TIED_HEAD].shape, generator=gen)
    return weights


def _pipeline_logits(cfg, weights, tokens, n_stages=2):
    """The logits the swarm's stages compute with `weights`."""
    x = tokens
    for i, (start, end) in enumerate(split_layers(cfg.n_layers, n_stages)):
        stage = build_stage(cfg, start, end, i == 0, i == n_stages - 1)
        stage.load_state_dict({k: weights[k] for k in stage.state_dict()})
        x = stage(x)
    return x


@pytest.mark.parametrize("drift", [0.0, 1e-3])
def test_the_builtin_gpt_is_gpt2_exactly(drift):
    weights = _trained_weights(drift=drift)
    model = hf_model_of(CFG, weights)
    assert model.config.model_type == "gpt2" and model.config.activation_function == "gelu"
    assert model.config.tie_word_embeddings is (drift == 0.0)  # two different copies: both kept
    tokens = torch.randint(0, 256, (3, CFG.seq_len_tokens), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, _pipeline_logits(CFG, weights, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_a_hugging_face_family_exports_to_itself(preset):
    from swarm.model.hf import hf_model_config
    from swarm.model.spec import build_stage as build_any

    cfg = hf_model_config(preset)
    stage = build_any(cfg, 0, cfg.n_layers, True, True)
    model = hf_model_of(cfg, stage.state_dict())
    assert model.config.model_type == cfg.family
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, stage(tokens), rtol=1e-5, atol=1e-5)
    assert tied_pair(cfg) == (("lm_head.weight", "transformer.wte.weight") if preset == "gpt2-tiny" else None)


def test_a_missing_or_bad_weight_is_named():
    weights = _trained_weights()
    with pytest.raises(ValueError, match=r"blocks\.1\.ln1\.weight"):
        hf_model_of(CFG, {k: v for k, v in weights.items() if k != "blocks.1.ln1.weight"})
    with pytest.raises(ValueError, match=r"pos_emb\.weight has shape \[4, 32\]"):
        hf_model_of(CFG, {**weights, "pos_emb.weight": torch.zeros(4, 32)})
    with pytest.raises(ValueError, match="norm.weight is not finite"):
        hf_model_of(CFG, {**weights, "norm.weight": torch.full((32,), float("nan"))})


def test_transformers_loads_the_directory_and_reproduces_the_held_out_loss(tmp_path):
    """The issue's test: AutoModelForCausalLM.from_pretrained(DIR) gives the pipeline's held-out loss."""
    weights = _trained_weights(drift=1e-3)
    out = write_hf_dir(CFG, weights, tmp_path / "model", {"held_out": {"train_samples": 16, "eval_samples": 4}})
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", EXPORT_FILE} <= {
        p.name for p in out.iterdir()
    }
    windows = held_out_windows(None, CFG.seq_len_tokens, 16, 4)
    with torch.no_grad():
        swarm_loss = held_out_loss(lambda t: _pipeline_logits(CFG, weights, t), windows)
        loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        hf_loss = held_out_loss(lambda t: loaded(t).logits, windows)
    assert abs(hf_loss - swarm_loss) <= 1e-4 * swarm_loss
    info = read_export_info(out)
    assert model_from_json(info["model"]) == CFG and info["tokenizer"] == "bytes"
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer("def f():")["input_ids"] == list(b"def f():")


def test_the_byte_vocabulary_round_trips_every_byte():
    tok = byte_tokenizer()
    assert tok.get_vocab_size() == 256
    text = "def héllo\n\t\x00\x7f 日本"
    ids = tok.encode(text).ids
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(list(range(256))).encode("utf-8", "replace")  # any id sequence decodes


def test_model_configs_round_trip_as_json():
    from swarm.model.hf import hf_model_config

    for cfg in (CFG, hf_model_config("llama-tiny")):
        assert model_from_json(model_to_json(cfg)) == cfg
    for bad in ("{}", "[1]", "not json", json.dumps({"family": "gpt", "hidden_dim": 33, "n_heads": 4})):
        with pytest.raises(ValueError):
            model_from_json(bad)
    assert weight_shapes(CFG)["blocks.2.mlp.fc.weight"] == torch.Size([128, 32])
