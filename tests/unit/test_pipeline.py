"""The swarm's runtime wired in one process: pipelined losses and gradients equal the unsplit model's; stage
steps; boundaries. The same hosts over gRPC are checked against this in tests/integration."""

import math

import pytest
import torch

from swarm.compression import CodecConfig
from swarm.model.data import Batch
from swarm.model.gpt import GPT, TIED_EMBEDDING, ModelConfig
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import OptimConfig, StageConfig, StageWorker, lr_at

torch.set_num_threads(1)

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=1)
FP32 = CodecConfig(name="fp32")


def _batch(n: int = 8, seed: int = 0, first_id: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len_tokens + 1), generator=gen)
    return Batch(torch.arange(first_id, first_id + n), windows[:, :-1], windows[:, 1:])


def _pipeline(n_stages: int, schedule: str = "1f1b", stage_cfg: StageConfig | None = None, fw=FP32, bw=FP32):
    return LocalPipeline(CFG, n_stages, fw, bw, schedule, stage_cfg)


def sync_tied_embedding(first: StageWorker, last: StageWorker) -> None:
    """What the driver's finish_step does to the two copies of the tied embedding: both get the sum."""
    if first is not last:
        total = first.tied_grad() + last.tied_grad()
        first.set_tied_grad(total)
        last.set_tied_grad(total)


def _grads(pipe: LocalPipeline) -> dict[str, torch.Tensor]:
    grads = {}
    for w in pipe.workers:
        for name, p in w.module.named_parameters():
            grads[name] = p.grad
    return grads


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n_stages", [2, 3])
def test_pipelined_loss_and_gradients_equal_the_unsplit_model(schedule, n_stages):
    batch = _batch()
    full = GPT(CFG)
    ref_loss = full(batch.tokens, batch.targets)
    ref_loss.backward()

    pipe = _pipeline(n_stages, schedule)
    loss = pipe.forward_backward(batch, n_micro=4)
    sync_tied_embedding(pipe.workers[0], pipe.workers[-1])

    torch.testing.assert_close(torch.tensor(loss), ref_loss.detach())
    grads = _grads(pipe)
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(grads["head_weight"], full.tok_emb.weight.grad)


def test_single_stage_pipeline_is_the_plain_model():
    batch = _batch()
    full = GPT(CFG)
    full(batch.tokens, batch.targets).backward()
    pipe = _pipeline(1)
    pipe.forward_backward(batch, n_micro=2)
    grads = _grads(pipe)
    assert "head_weight" not in grads
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


def test_training_steps_match_the_single_stage_run_and_keep_tied_copies_equal():
    stage_cfg = StageConfig(OptimConfig(lr_peak=1e-2, warmup_steps=2, total_steps=6, grad_clip_norm=0.5))
    split, whole = _pipeline(3, "1f1b", stage_cfg), _pipeline(1, "gpipe", stage_cfg)
    for step in range(4):
        a = split.train_step(_batch(seed=step), n_micro=4)
        b = whole.train_step(_batch(seed=step), n_micro=2)
        assert a.lr == b.lr == lr_at(stage_cfg.optim, step)
        assert math.isclose(a.loss, b.loss, rel_tol=1e-5) and math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-4)
    assert a.grad_norm > 0.5  # clipping was active
    params = {n: p for w in split.workers for n, p in w.module.named_parameters()}
    for name, p in whole.workers[0].module.named_parameters():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(params["head_weight"], params[TIED_EMBEDDING], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activations_in_flight_follow_the_schedule(schedule):
    pipe = _pipeline(3, schedule)
    pipe.forward_backward(_batch(), n_micro=8)
    peaks = [w.peak_in_flight for w in pipe.workers]
    assert peaks == ([3, 2, 1] if schedule == "1f1b" else [8, 8, 8])
    assert all(w.in_flight == 0 for w in pipe.workers)


def test_fp32_boundary_counts_the_framed_bytes():
    pipe = _pipeline(2, fw=CodecConfig(name="fp32", zstd_level=0), bw=CodecConfig(name="fp32", zstd_level=0))
    result = pipe.train_step(_batch(), n_micro=2)
    numel = 8 * CFG.seq_len_tokens * CFG.hidden_dim
    assert 4 * numel < result.forward_bytes < 4 * numel + 400
    assert 4 * numel < result.backward_bytes < 4 * numel + 400


def test_aqsgd_receiver_computes_on_the_message_buffer_and_pays_less_on_second_sight():
    aq = CodecConfig(name="aqsgd", bits=2)
    pipe = _pipeline(2, fw=aq, bw=CodecConfig(name="gradq", bits=4))
    batch = _batch(n=4)
    first = pipe.train_step(batch, n_micro=1)
    second = pipe.train_step(batch, n_micro=1)  # the same samples again: deltas against the buffers
    assert second.forward_bytes < first.forward_bytes / 4
    [send_end] = pipe.hosts[0].links.send_ends("fw")
    send, recv = send_end.buffers, pipe.hosts[1].links.forward_recv.buffers
    assert sorted(send.ids()) == sorted(recv.ids()) == list(range(4))
    for sample in send.ids():  # both ends hold bit-identical message buffers
        assert torch.equal(send.get(sample), recv.get(sample))
    # the receiver computes on m, which tracks the sender's true activation to within a few 2-bit steps
    x = pipe.workers[0].infer(batch.tokens)
    m = torch.stack([recv.get(int(s)) for s in batch.sample_ids]).float()
    assert not torch.equal(m, x)
    assert (m - x).abs().max() < 0.25 * x.abs().max()


def test_quantized_codecs_train():
    pipe = _pipeline(2, fw=CodecConfig(name="aqsgd", bits=2), bw=CodecConfig(name="gradq", bits=4))
    losses = [pipe.train_step(_batch(seed=0), n_micro=2).loss for _ in range(5)]
    assert losses[-1] < losses[0]


def test_bf16_autocast_runs_close_to_fp32():
    fp32 = _pipeline(2).forward_backward(_batch(), n_micro=2)
    bf16 = _pipeline(2, stage_cfg=StageConfig(autocast_bf16=True)).forward_backward(_batch(), n_micro=2)
    assert math.isclose(fp32, bf16, rel_tol=2e-2)


def test_lr_schedule_warms_up_then_decays_to_the_minimum():
    cfg = OptimConfig(lr_peak=1.0, lr_min_ratio=0.1, warmup_steps=4, total_steps=14)
    lrs = [lr_at(cfg, s) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert math.isclose(lrs[14], 0.1) and math.isclose(lrs[19], 0.1)


def test_evaluate_matches_the_unsplit_model():
    from swarm.model.data import SampleSet

    windows = torch.randint(0, CFG.vocab_size, (6, CFG.seq_len_tokens + 1), generator=torch.Generator())
    data = SampleSet(torch.arange(6), windows)
    ref = GPT(CFG)(windows[:, :-1], windows[:, 1:]).item()
    assert math.isclose(_pipeline(3).evaluate(data, batch_size=4), ref, rel_tol=1e-5)


def test_stage_worker_guards():
    pipe = _pipeline(2)
    worker = pipe.workers[1]
    x = torch.zeros(2, CFG.seq_len_tokens, CFG.hidden_dim)
    worker.forward(0, x, targets=torch.zeros(2, CFG.seq_len_tokens, dtype=torch.long))
    with pytest.raises(RuntimeError, match="already in flight"):
        worker.forward(0, x)
    with pytest.raises(RuntimeError, match="in flight"):
        worker.step()
    with pytest.raises(ValueError, match="schedule"):
        LocalPipeline(CFG, 2, schedule="nope")
    with pytest.raises(ValueError, match="at least one stage"):
        LocalPipeline(CFG, 0)
