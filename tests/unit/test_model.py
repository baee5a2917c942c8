"""The decoder and its stage split: deterministic init, slices equal to the full model, tied head."""

import pytest
import torch

from swarm.model.gpt import GPT, TIED_EMBEDDING, ModelConfig, build_stage, split_layers

torch.set_num_threads(1)

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=3)


def _stages(cfg: ModelConfig, n_stages: int):
    ranges = split_layers(cfg.n_layers, n_stages)
    return [build_stage(cfg, a, b, i == 0, i == n_stages - 1) for i, (a, b) in enumerate(ranges)]


def test_split_layers_is_contiguous_and_even():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_layers(5, 1) == [(0, 5)]
    with pytest.raises(ValueError):
        split_layers(2, 3)


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_stage_weights_equal_the_same_slice_of_the_full_model(n_stages):
    full = dict(GPT(CFG).named_parameters())
    seen = set()
    for stage in _stages(CFG, n_stages):
        for name, p in stage.named_parameters():
            ref = full[TIED_EMBEDDING] if name == "head_weight" else full[name]
            torch.testing.assert_close(p, ref, rtol=0, atol=0)
            seen.add(name)
    assert set(full) <= seen


def test_init_is_deterministic_and_depends_on_the_seed():
    a, b = GPT(CFG).state_dict(), GPT(CFG).state_dict()
    other = GPT(ModelConfig(**{**CFG.__dict__, "init_seed": 4})).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], other["blocks.0.attn.qkv.weight"])


@pytest.mark.parametrize("n_stages", [2, 3])
def test_chained_stages_compute_the_full_model(n_stages):
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len_tokens), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, dims=1)
    full = GPT(CFG)
    stages = _stages(CFG, n_stages)
    x = tokens
    for stage in stages[:-1]:
        x = stage(x)
        assert x.shape == (2, CFG.seq_len_tokens, CFG.hidden_dim)
    torch.testing.assert_close(stages[-1](x), full(tokens))
    torch.testing.assert_close(stages[-1](x, targets), full(tokens, targets))


def test_tied_parameter_per_stage():
    first, middle, last = _stages(CFG, 3)
    assert first.tied_parameter() is first.tok_emb.weight
    assert middle.tied_parameter() is None
    assert last.tied_parameter() is last.head_weight
    (only,) = _stages(CFG, 1)
    assert only.tied_parameter() is only.tok_emb.weight
    assert not hasattr(only, "head_weight")


def test_loss_starts_near_uniform():
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len_tokens), generator=torch.Generator().manual_seed(1))
    loss = GPT(CFG)(tokens, tokens.roll(-1, dims=1))
    assert abs(loss.item() - torch.log(torch.tensor(CFG.vocab_size)).item()) < 0.2


def test_config_and_range_validation():
    with pytest.raises(ValueError):
        ModelConfig(hidden_dim=30, n_heads=4)
    with pytest.raises(ValueError):
        build_stage(CFG, 3, 2, False, False)
    with pytest.raises(ValueError):
        build_stage(CFG, 0, 5, True, True)
