"""Local checkpoints: saved with save_pretrained, loaded stage by stage, each stage reading only its tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from swarm.model.hf import build_hf_stage, hf_model_config, save_checkpoint
from swarm.model.hf_weights import INDEX, unsplit_model


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))


def _chain(cfg, ranges):
    n = len(ranges)
    return [build_hf_stage(cfg, a, b, i == 0, i == n - 1) for i, (a, b) in enumerate(ranges)]


def _run(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_sharded_checkpoint_loads_stage_by_stage(name: str, tmp_path: Path) -> None:
    source = hf_model_config(name, init_seed=7)
    out = save_checkpoint(source, tmp_path / "ckpt", max_shard_size="20KB")
    index = json.loads((out / INDEX).read_text())
    assert len(set(index["weight_map"].values())) >= 3  # really sharded

    cfg = hf_model_config(str(out))  # weights from the directory itself; init_seed 0 is not used
    assert cfg.weights_dir == str(out.resolve()) and cfg.init_seed == 0
    stages = _chain(cfg, [(0, 1), (1, 2), (2, 3)])
    tokens = _tokens(cfg.vocab_size)
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    with torch.no_grad():
        got = _run(stages, tokens)
        torch.testing.assert_close(got, pretrained(tokens).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, _run(_chain(source, [(0, 3)]), tokens), rtol=1e-5, atol=1e-5)
    if cfg.tied_embeddings:  # the last stage's head comes from the embedding (save_pretrained drops lm_head)
        assert "lm_head.weight" not in index["weight_map"]
        torch.testing.assert_close(stages[2].lm_head.weight, stages[0].transformer.wte.weight)


def test_preset_with_weights_dir_equals_the_directory(tmp_path: Path) -> None:
    out = save_checkpoint(hf_model_config("llama-tiny", init_seed=5), tmp_path / "ckpt")
    by_preset = hf_model_config("llama-tiny", weights=str(out))
    by_dir = hf_model_config(str(out))
    assert by_preset.weights_dir == by_dir.weights_dir
    a, b = build_hf_stage(by_preset, 1, 3, False, True), build_hf_stage(by_dir, 1, 3, False, True)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


class _Spy:
    """Records the files `safe_open` opens and the tensors read from them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[str] = []
        self.tensors: list[str] = []
        real = safetensors.safe_open
        spy = self

        class Handle:
            def __init__(self, path, framework, device="cpu"):
                spy.files.append(Path(path).name)
                self._h = real(path, framework=framework, device=device)

            def __enter__(self):
                self._h.__enter__()
                return self

            def __exit__(self, *exc):
                return self._h.__exit__(*exc)

            def keys(self):
                return self._h.keys()

            def get_tensor(self, key):
                spy.tensors.append(key)
                return self._h.get_tensor(key)

        monkeypatch.setattr(safetensors, "safe_open", Handle)


@pytest.mark.parametrize("name, layer", [("gpt2-tiny", "transformer.h.1."), ("llama-tiny", "model.layers.1.")])
def test_middle_stage_reads_only_its_own_tensors(name: str, layer: str, tmp_path, monkeypatch) -> None:
    out = save_checkpoint(hf_model_config(name), tmp_path / "ckpt", max_shard_size="10KB")
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    cfg = hf_model_config(str(out))
    spy = _Spy(monkeypatch)
    stage = build_hf_stage(cfg, 1, 2, False, False)
    assert spy.tensors and all(t.startswith(layer) for t in spy.tensors), spy.tensors
    assert sorted(spy.tensors) == sorted(n for n, _ in stage.named_parameters())
    mine = {weight_map[t] for t in spy.tensors}
    assert set(spy.files) == mine and len(spy.files) == len(mine)  # each of its shards opened once, no other
    assert len(mine) < len(set(weight_map.values()))


def test_checkpoint_without_base_prefix_loads(tmp_path: Path) -> None:
    """GPT-2's own checkpoints are saved from GPT2Model: `h.0.attn.c_attn.weight`, `wte.weight`, no head."""
    cfg = hf_model_config("gpt2-tiny", init_seed=4)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in unsplit_model(cfg).state_dict().items()}
    state.pop("lm_head.weight")
    out = tmp_path / "base"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    loaded = build_hf_stage(hf_model_config("gpt2-tiny", weights=str(out)), 2, 3, False, True)
    want = dict(build_hf_stage(cfg, 2, 3, False, True).named_parameters())
    for n, p in loaded.named_parameters():
        assert torch.equal(p, want[n]), n


def _single(tmp_path: Path, edit) -> str:
    state = {k: v.clone().contiguous() for k, v in unsplit_model(hf_model_config("llama-tiny")).state_dict().items()}
    edit(state)
    out = tmp_path / "edited"
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    return str(out)


def test_missing_wrong_shape_and_nonfinite_tensors_are_named(tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    missing = _single(tmp_path / "a", lambda s: s.pop(name))
    cfg = hf_model_config("llama-tiny", weights=missing)
    build_hf_stage(cfg, 0, 1, True, False)  # a stage that does not need it still builds
    with pytest.raises(ValueError, match=r"no tensor for model\.layers\.1\.mlp\.up_proj\.weight"):
        build_hf_stage(cfg, 1, 2, False, False)
    wrong = _single(tmp_path / "b", lambda s: s.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(ValueError, match=r"up_proj\.weight has shape \(3, 3\)"):
        build_hf_stage(hf_model_config("llama-tiny", weights=wrong), 1, 2, False, False)
    nan = _single(tmp_path / "c", lambda s: s[name].view(-1).__setitem__(0, float("nan")))
    with pytest.raises(ValueError, match=r"up_proj\.weight is not finite"):
        build_hf_stage(hf_model_config("llama-tiny", weights=nan), 1, 2, False, False)
    untied_head = _single(tmp_path / "d", lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"no tensor for lm_head\.weight"):
        build_hf_stage(hf_model_config("llama-tiny", weights=untied_head), 3, 3, False, True)


def test_bad_weights_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        hf_model_config("llama-tiny", weights=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no model.safetensors"):
        hf_model_config("llama-tiny", weights=str(tmp_path))
    for weight_map, match in [({"a": "../model.safetensors"}, "bad shard file name"), ({"a": "gone.st"}, "missing")]:
        (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ValueError, match=match):
            hf_model_config("llama-tiny", weights=str(tmp_path))
    (tmp_path / INDEX).write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        hf_model_config("llama-tiny", weights=str(tmp_path))


def test_weights_of_another_model_are_refused_early(tmp_path: Path) -> None:
    out = save_checkpoint(hf_model_config("mistral-tiny"), tmp_path / "mistral")
    with pytest.raises(ValueError, match="of another model.*model_type: 'llama' vs 'mistral'"):
        hf_model_config("llama-tiny", weights=str(out))


def test_bf16_checkpoint_loads_into_fp32_master_weights(tmp_path: Path) -> None:
    half = _single(tmp_path, lambda s: s.update({k: v.to(torch.bfloat16) for k, v in s.items()}))
    stage = build_hf_stage(hf_model_config("llama-tiny", weights=half), 0, 1, True, False)
    want = dict(build_hf_stage(hf_model_config("llama-tiny"), 0, 1, True, False).named_parameters())
    for n, p in stage.named_parameters():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, want[n].to(torch.bfloat16).float(), rtol=0, atol=0)
