"""The compression-aware GPT (`ModelConfig.subspace_dim`): the residual stream kept in a fixed subspace, so a stage
boundary carries `subspace_dim` numbers a token and the next stage rebuilds the stream exactly; any split computes
the unsplit model; the plain GPT is unchanged; the runtime checks boundaries at the new width; no export."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, WireError
from swarm.model.data import Batch
from swarm.model.export import hf_config_of, model_to_json
from swarm.model.gpt import GPT, ModelConfig, build_stage, split_layers, subspace_basis
from swarm.model.spec import model_identity
from swarm.runtime.inprocess import LocalPipeline

torch.set_num_threads(1)

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=3, subspace_dim=8)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, CFG.seq_len_tokens), generator=torch.Generator().manual_seed(seed))


def _stages(cfg: ModelConfig, n_stages: int):
    ranges = split_layers(cfg.n_layers, n_stages)
    return [build_stage(cfg, a, b, i == 0, i == n_stages - 1) for i, (a, b) in enumerate(ranges)]


def test_the_basis_is_orthonormal_the_same_in_every_build_and_depends_on_the_seed():
    a, b = subspace_basis(CFG), subspace_basis(CFG)
    assert a.shape == (32, 8) and torch.equal(a, b)
    torch.testing.assert_close(a.t() @ a, torch.eye(8), atol=1e-5, rtol=0)
    assert not torch.allclose(a, subspace_basis(ModelConfig(**{**CFG.__dict__, "init_seed": 4})))
    assert subspace_basis(ModelConfig()) is None


@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_any_split_sends_subspace_dim_numbers_a_token_and_computes_the_unsplit_model(n_stages):
    tokens = _tokens()
    targets = tokens.roll(-1, dims=1)
    full, stages = GPT(CFG), _stages(CFG, n_stages)
    x = tokens
    for stage in stages[:-1]:
        x = stage(x)
        assert x.shape == (2, CFG.seq_len_tokens, CFG.boundary_dim) and CFG.boundary_dim == 8
    torch.testing.assert_close(stages[-1](x), full(tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stages[-1](x, targets), full(tokens, targets), atol=1e-5, rtol=1e-5)


def test_the_stream_stays_in_the_subspace_so_the_boundary_loses_nothing():
    stage = build_stage(CFG, 0, 2, True, False)
    coefficients = stage(_tokens())
    basis = subspace_basis(CFG)
    stream = coefficients @ basis.t()  # what the next stage rebuilds
    # the sender's stream before its projection to coefficients equals the rebuilt one: nothing is cut at the cut
    with torch.no_grad():
        pos = torch.arange(CFG.seq_len_tokens)
        x = stage.subspace.project(stage.tok_emb(_tokens()) + stage.pos_emb(pos))
        for block in stage.blocks.values():
            x = stage.subspace.project(block(x))
    torch.testing.assert_close(stream, x, atol=1e-5, rtol=1e-5)
    # and a stream off the subspace would not survive: the projection is what makes the boundary exact
    off = torch.randn(2, CFG.seq_len_tokens, CFG.hidden_dim)
    assert not torch.allclose(stage.subspace.coefficients(off) @ basis.t(), off, atol=1e-2)


def test_the_plain_gpt_is_unchanged_by_the_field():
    plain = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=3)
    assert plain.boundary_dim == 32 and "subspace_dim" not in model_to_json(plain)
    assert model_identity(plain) != model_identity(CFG)
    stage = build_stage(plain, 0, 2, True, False)
    assert stage(_tokens()).shape == (2, 16, 32)
    assert not any("basis" in k for k in stage.state_dict()), "the basis is rebuilt, never stored"
    assert not any("basis" in k for k in build_stage(CFG, 0, 2, True, False).state_dict())


def test_a_subspace_wider_than_the_model_is_refused():
    with pytest.raises(ValueError, match="subspace_dim"):
        ModelConfig(hidden_dim=32, n_heads=4, subspace_dim=33)


def test_it_cannot_be_exported_to_transformers():
    with pytest.raises(ValueError, match="not a GPT-2"):
        hf_config_of(CFG)


def test_a_pipeline_trains_it_over_the_codecs_and_checks_boundaries_at_its_width():
    pipe = LocalPipeline(CFG, 2, CodecConfig.parse("acsgd2+ch+nr"), CodecConfig.parse("gradq2+ef+rot+nr+cs"))
    try:
        tokens = _tokens(1)
        batch = Batch(torch.arange(2), tokens, tokens.roll(-1, dims=1))
        first = pipe.train_step(batch, n_micro=2).loss
        for _ in range(4):
            last = pipe.train_step(batch, n_micro=2).loss
        assert last < first  # it learns through 8-number boundaries
        host = pipe.hosts[1]
        with pytest.raises(WireError, match=r"\[batch, seq, 8\]"):  # a full-width activation is not this model's
            host.check_recompute(torch.randn(2, CFG.seq_len_tokens, CFG.hidden_dim), batch.targets, None)
        host.check_recompute(torch.randn(2, CFG.seq_len_tokens, CFG.boundary_dim), batch.targets, None)
    finally:
        pipe.close()
