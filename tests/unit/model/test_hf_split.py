"""Stages of a Hugging Face family chained by hand equal the unsplit `transformers` model: logits, loss, grads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from swarm.model.hf import HFModelConfig, build_hf_stage, hf_model_config
from swarm.model.hf_stage import HEAD, embedding_name
from swarm.model.hf_weights import unsplit_model
from swarm.model.spec import StageModule, build_stage

FAMILIES = ["gpt2-tiny", "llama-tiny", "mistral-tiny", "qwen2-tiny"]
SPLITS = {
    "three": [(0, 1), (1, 2), (2, 3)],
    "ends-only": [(0, 0), (0, 3), (3, 3)],  # an embeddings-only first stage and a head-only last stage
}


def _stages(cfg: HFModelConfig, ranges: list[tuple[int, int]]) -> list[torch.nn.Module]:
    n = len(ranges)
    return [build_stage(cfg, a, b, i == 0, i == n - 1) for i, (a, b) in enumerate(ranges)]


def _batch(cfg: HFModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    return tokens, torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)


def _tied_llama(tmp_path) -> str:
    config = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3)
    config.update(num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("name", [*FAMILIES, "tied-llama"])
def test_split_equals_unsplit_transformers_model(name: str, split: str, tmp_path) -> None:
    cfg = hf_model_config(_tied_llama(tmp_path) if name == "tied-llama" else name, seq_len_tokens=32)
    if name == "tied-llama":
        assert cfg.tied_embeddings
    ref = unsplit_model(cfg).train()
    stages = _stages(cfg, SPLITS[split])
    tokens, targets = _batch(cfg)

    want_logits = ref(tokens).logits
    want_loss = F.cross_entropy(want_logits.float().reshape(-1, cfg.vocab_size), targets.reshape(-1))
    want_loss.backward()

    # Forward stage by stage, each taking a detached copy of the previous boundary, as in the pipeline.
    inputs, outputs, x = [], [], tokens
    for i, stage in enumerate(stages):
        inputs.append(x)
        outputs.append(stage(x, targets) if i == len(stages) - 1 else stage(x))
        x = outputs[-1].detach().requires_grad_(True)
    loss = outputs[-1]
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(stages[-1](inputs[-1]), want_logits, rtol=1e-5, atol=1e-5)

    # Backward through the boundaries, last stage first.
    loss.backward()
    for i in reversed(range(len(stages) - 1)):
        outputs[i].backward(inputs[i + 1].grad)

    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for stage in stages:
        for n, p in stage.named_parameters():
            key = embedding_name(cfg.family) if n == HEAD and cfg.tied_embeddings else n
            got[key] = p.grad.clone() if key not in got else got[key] + p.grad  # the tied pair sums
    assert set(got) == set(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=f"gradient of {n}")


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_single_stage_is_the_unsplit_model_by_name(name: str) -> None:
    cfg = hf_model_config(name)
    stage = build_hf_stage(cfg, 0, cfg.n_layers, True, True)
    ref = unsplit_model(cfg)
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert isinstance(stage, StageModule)
    tokens, _ = _batch(cfg)
    torch.testing.assert_close(stage(tokens), ref(tokens).logits)
    if cfg.tied_embeddings:
        assert stage.tied_parameter() is stage.transformer.wte.weight
    else:
        assert stage.tied_parameter() is None


def test_tied_parameters_gpt2_ends_only_and_llama_none() -> None:
    gpt2 = _stages(hf_model_config("gpt2-tiny"), SPLITS["three"])
    assert gpt2[0].tied_parameter() is gpt2[0].transformer.wte.weight
    assert gpt2[1].tied_parameter() is None
    assert gpt2[2].tied_parameter() is gpt2[2].lm_head.weight
    torch.testing.assert_close(gpt2[2].lm_head.weight, gpt2[0].transformer.wte.weight)  # same init: one weight
    assert all(s.tied_parameter() is None for s in _stages(hf_model_config("llama-tiny"), SPLITS["three"]))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_attention_is_causal(name: str) -> None:
    cfg = hf_model_config(name)
    stage = build_hf_stage(cfg, 0, cfg.n_layers, True, True)
    tokens, _ = _batch(cfg)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % cfg.vocab_size
    a, b = stage(tokens), stage(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_init_is_deterministic_per_name_and_seed(name: str) -> None:
    cfg = hf_model_config(name)
    full = dict(build_hf_stage(cfg, 0, 3, True, True).named_parameters())
    again = build_hf_stage(cfg, 1, 2, False, False)
    for n, p in again.named_parameters():
        torch.testing.assert_close(p, full[n], rtol=0, atol=0)
    other = dict(build_hf_stage(hf_model_config(name, init_seed=1), 1, 2, False, False).named_parameters())
    assert any(not torch.equal(p, other[n]) for n, p in again.named_parameters() if p.ndim == 2)


def test_gpt2_init_follows_the_family() -> None:
    cfg = hf_model_config("gpt2-tiny")
    params = dict(build_hf_stage(cfg, 0, 3, True, True).named_parameters())
    assert torch.equal(params["transformer.h.1.ln_1.weight"], torch.ones(cfg.hidden_dim))
    assert not params["transformer.h.1.attn.c_attn.bias"].any()
    std = cfg.hf_config().initializer_range
    assert params["transformer.h.0.mlp.c_fc.weight"].std().item() == pytest.approx(std, rel=0.15)
    # GPT-2's residual projections are scaled by 1/sqrt(2 * n_layers).
    scaled = torch.cat([params[f"transformer.h.{i}.mlp.c_proj.weight"].flatten() for i in range(3)])
    assert scaled.std().item() == pytest.approx(std / (2 * cfg.n_layers) ** 0.5, rel=0.15)


def test_bad_layer_range_is_refused() -> None:
    cfg = hf_model_config("llama-tiny")
    with pytest.raises(ValueError, match="bad layer range"):
        build_hf_stage(cfg, 2, 4, False, True)
    with pytest.raises(ValueError, match="bad layer range"):
        build_hf_stage(cfg, 2, 1, False, False)


_DIGESTS = """
import hashlib, sys, torch
torch.set_num_threads(1)
from swarm.model.hf import build_hf_stage, hf_model_config
for name in sys.argv[1:]:
    h = hashlib.sha256()
    for n, p in build_hf_stage(hf_model_config(name), 1, 2, False, False).named_parameters():
        h.update(n.encode() + p.detach().numpy().tobytes())
    print(h.hexdigest())
"""


def test_stages_built_in_another_process_hold_the_same_weights() -> None:
    import hashlib
    import subprocess
    import sys

    names = ["gpt2-tiny", "llama-tiny"]
    child = subprocess.run([sys.executable, "-c", _DIGESTS, *names], capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr
    want = []
    for name in names:
        full = dict(build_hf_stage(hf_model_config(name), 0, 3, True, True).named_parameters())
        h = hashlib.sha256()
        for n, _ in build_hf_stage(hf_model_config(name), 1, 2, False, False).named_parameters():
            h.update(n.encode() + full[n].detach().numpy().tobytes())
        want.append(h.hexdigest())
    assert child.stdout.split() == want
