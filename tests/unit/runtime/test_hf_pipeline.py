"""Hugging Face families through the swarm's runtime: a 2- or 3-stage in-process pipeline (`LocalPipeline`:
hosts, servicers, the driver, fp32 codecs) of `llama-tiny` (untied: no tied group in Reduce) and of
`gpt2-tiny` (tied: the end stages sum the head's gradient) trains exactly as the same model in one stage,
losses and weights after 2 steps."""

from __future__ import annotations

import pytest
import torch

from swarm.model.data import Batch
from swarm.model.spec import resolve_model
from swarm.runtime.inprocess import LocalPipeline

torch.set_num_threads(1)

SEQ = 16


def _batches(vocab: int, n: int = 2) -> list[Batch]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        windows = torch.randint(0, vocab, (8, SEQ + 1), generator=gen)
        out.append(Batch(torch.arange(8 * i, 8 * i + 8), windows[:, :-1], windows[:, 1:]))
    return out


def _train(model, n_stages: int) -> tuple[list[float], dict[str, torch.Tensor], list]:
    pipe = LocalPipeline(model, n_stages)
    losses, results = [], []
    for batch in _batches(model.vocab_size):
        result = pipe.train_step(batch, n_micro=4)
        losses.append(result.loss)
        results.append(result)
    weights = {n: p.detach().clone() for w in pipe.workers for n, p in w.module.named_parameters()}
    return losses, weights, results


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("n_stages", [2, 3])
def test_a_split_hf_model_trains_as_the_unsplit_one(name, n_stages):
    model = resolve_model(name, seq_len_tokens=SEQ, init_seed=2)
    ref_losses, ref_weights, _ = _train(model, 1)
    losses, weights, results = _train(model, n_stages)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert ref_losses[1] != ref_losses[0]  # the first step moved the weights
    # the last stage's head copy of a tied model is the same weight as stage 0's embedding, named differently
    assert set(weights) - set(ref_weights) <= {"lm_head.weight"}
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    tied_bytes = sum(r.sync_bytes for r in results)
    assert (tied_bytes > 0) == model.tied_embeddings  # Llama's untied head: no tied group, nothing sent for it


def test_an_untied_models_end_stages_refuse_a_tied_group_by_name():
    """A driver told the model ties its head (wrong for Llama) gets the end stages' refusal, not a hang."""
    from swarm.net.stream import StageCallError

    model = resolve_model("llama-tiny", seq_len_tokens=SEQ)
    pipe = LocalPipeline(model, 2)
    with pytest.raises(StageCallError, match="holds no tied weight"):
        pipe.driver(4, tied=True).train_step(0, _batches(model.vocab_size, 1)[0])


def test_wire_limits_follow_the_models_attributes():
    """A message may be a full micro-batch of fp32 activations, or (tied models only) the embedding's gradient:
    an untied Llama with a large vocabulary does not open its stages to vocabulary-sized messages."""
    from swarm.runtime.budget import StageBudget

    budget = StageBudget()
    llama, gpt2 = resolve_model("llama-100m", seq_len_tokens=8), resolve_model("gpt2-small", seq_len_tokens=8)
    activation = budget.max_batch * 8 * 768
    assert budget.wire_limits(llama).max_numel == activation < llama.vocab_size * 768
    assert budget.wire_limits(gpt2).max_numel == max(activation, gpt2.vocab_size * 768)
