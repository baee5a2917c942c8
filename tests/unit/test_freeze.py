"""PipeTransformer's freezing (swarm.runtime.freeze): the criterion, frozen stages, and the trainer's decision."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from swarm.compression import DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.model.hf import hf_model_config
from swarm.net.auth import CallSigner, Identity
from swarm.net.stream import StageCallError
from swarm.proto import stage_pb2
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.freeze import FreezePolicy, block_of, set_frozen
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import OptimConfig, StageConfig

GPT = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=1)
LLAMA = hf_model_config("llama-tiny", seq_len_tokens=16)  # untied, 3 layers
FP32 = CodecConfig(name="fp32")
NO_CLIP = StageConfig(OptimConfig(warmup_steps=2, total_steps=50, grad_clip_norm=None))


def _batch(vocab: int, seq: int, step: int, n: int = 8) -> Batch:
    gen = torch.Generator().manual_seed(step % 3)
    windows = torch.randint(0, vocab, (n, seq + 1), generator=gen)
    first = (step % 3) * n
    return Batch(torch.arange(first, first + n), windows[:, :-1], windows[:, 1:])


def _params(pipe: LocalPipeline) -> dict[str, torch.Tensor]:
    return {f"{s}:{k}": v.detach().clone() for s, w in enumerate(pipe.workers) for k, v in w.module.named_parameters()}


# ---- the criterion ----------------------------------------------------------------------------------------


def _settling(step: int, n_layers: int, settled_by: list[int]) -> list[float]:
    """Squared norms: layer i changes until step settled_by[i], then stays constant."""
    return [(1.0 + max(settled_by[i] - step, 0)) ** 2 for i in range(n_layers)]


def test_policy_freezes_bottom_up_never_unfreezes_and_respects_caps():
    policy = FreezePolicy(n_layers=8, interval=5, tolerance=0.05, max_fraction=0.5)
    settled_by = [10, 20, 30, 40, 50, 60, 70, 80]  # the bottom layers settle first
    seen = []
    for step in range(120):
        seen.append(policy.observe(step, _settling(step, 8, settled_by)))
    assert seen == sorted(seen)  # never unfreezes
    assert seen[-1] == 4  # capped at half the layers, though every layer settled by step 80
    steps = dict((n, s) for s, n in policy.history)
    assert steps[1] >= 15 and all(steps[n] >= settled_by[n - 1] for n in steps)  # never before the layer settled
    # while every layer still moves by more than the tolerance nothing freezes, whatever the step count
    policy = FreezePolicy(n_layers=4, interval=5, tolerance=0.05, max_fraction=1.0)
    for step in range(200):
        policy.observe(step, [1.1 ** (2 * step)] * 4)  # the norm grows 10% a step
    assert policy.frozen == 0
    # PipeTransformer's argmin: up to the layer that moved least, at most alpha of the active layers at once
    policy = FreezePolicy(n_layers=10, interval=1, tolerance=0.5, max_fraction=1.0, alpha=0.2)
    policy.observe(0, [1.0] * 10)
    assert policy.observe(1, [1.2, 1.2, 1.2, 1.2, 1.0, 1.2, 1.2, 1.2, 1.2, 1.2]) == 2  # argmin 4, paced to 2
    assert policy.observe(2, [1.2, 1.2, 1.2, 1.2, 1.0, 1.2, 1.2, 1.2, 1.2, 1.2]) == 3  # argmin 3 (ties: deeper)
    assert policy.observe(3, [1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2]) == 4
    assert policy.observe(4, [1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]) == 4  # active layers moved: hold
    assert policy.cap == 9 and [n for _, n in policy.history] == [2, 3, 4]


def test_policy_ignores_malformed_and_repeated_observations():
    policy = FreezePolicy(n_layers=3, interval=1, tolerance=0.5)
    for step, norms in enumerate([[1.0, 1.0], [math.nan, 1.0, 1.0], [-1.0, 1.0, 1.0], [math.inf, 1, 1]]):
        assert policy.observe(step, norms) == 0
    assert policy.observe(10, [1.0, 1.0, 1.0]) == 0  # first window: nothing to compare with
    assert policy.observe(10, [1.0, 1.0, 1.0]) == 0  # the same step again is not a second window
    assert policy.observe(11, [1.0, 1.0, 1.0]) == 1  # one layer a decision (alpha)
    with pytest.raises(ValueError):
        FreezePolicy(n_layers=0)


def test_block_names_of_every_family():
    assert block_of("blocks.3.attn.qkv.weight") == 3
    assert block_of("transformer.h.12.mlp.c_fc.weight") == 12
    assert block_of("model.layers.0.self_attn.q_proj.weight") == 0
    assert block_of("tok_emb.weight") is None and block_of("model.embed_tokens.weight") is None


# ---- frozen stages -----------------------------------------------------------------------------------------


def _run(model, n_stages: int, steps: int, freeze_at: int | None, frozen: int, reference: bool = False):
    """Losses of `steps` steps; the policy is told to freeze `frozen` layers in the Step of step `freeze_at`
    (applied from the next step on); `reference` instead trains unfrozen and restores those layers' weights
    after every later step (what freezing must equal)."""
    pipe = LocalPipeline(model, n_stages, FP32, FP32, stage_cfg=NO_CLIP)
    pipe.freeze = FreezePolicy(n_layers=model.n_layers, tolerance=1e-12, max_fraction=1.0)
    losses, results, kept = [], [], None
    for step in range(steps):
        if step == freeze_at and not reference:
            pipe.freeze.frozen = frozen
        result = pipe.train_step(_batch(model.vocab_size, model.seq_len_tokens, step), 2)
        losses.append(result.loss)
        results.append(result)
        if reference and freeze_at is not None and step >= freeze_at:
            if kept is None:
                kept = {
                    (s, k): p.detach().clone()
                    for s, w in enumerate(pipe.workers)
                    for k, p in w.module.named_parameters()
                    if _frozen_name(k, frozen, w.module, model)
                }
            for s, w in enumerate(pipe.workers):
                for k, p in w.module.named_parameters():
                    if (s, k) in kept:
                        p.data.copy_(kept[(s, k)])
    return pipe, losses, results


def _frozen_name(name: str, frozen: int, module, model) -> bool:
    block = block_of(name)
    if block is not None:
        return block < frozen
    embedding = module.is_first and ("emb" in name or "wte" in name or "wpe" in name)
    tied_head = model.tied_embeddings and name in ("head_weight", "lm_head.weight")  # the tied pair freezes too
    return frozen > 0 and (embedding or tied_head)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-tied", "llama-untied"])
def test_freezing_at_step_k_equals_a_run_that_stops_updating_those_layers(model):
    frozen = 2
    pipe, losses, _ = _run(model, 2, 6, freeze_at=2, frozen=frozen)
    ref, ref_losses, _ = _run(model, 2, 6, freeze_at=2, frozen=frozen, reference=True)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for a, b in zip(_params(pipe).items(), _params(ref).items(), strict=True):
        torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6, msg=a[0])
    assert all(w.frozen_layers == frozen for w in pipe.workers)


def test_frozen_parameters_stay_while_the_others_move_and_a_frozen_stage_gets_no_backward():
    pipe = LocalPipeline(LLAMA, 2, FP32, FP32, stage_cfg=NO_CLIP)  # stage 0: embedding + layers 0, 1
    pipe.freeze = FreezePolicy(n_layers=3, tolerance=1e-12, max_fraction=1.0)
    calls = {"Backward": 0}
    servicer = pipe.switches[0][0].target
    backward = servicer.Backward

    def counting(request_iterator, context):
        calls["Backward"] += 1
        return backward(request_iterator, context)

    servicer.Backward = counting
    pipe.train_step(_batch(256, 16, 0), 2)
    pipe.freeze.frozen = 2
    result = pipe.train_step(_batch(256, 16, 1), 2)  # its Step freezes layers 0-1: stage 0 entirely
    assert result.traffic.sent.get((0, "backward"), 0) > 0 and calls["Backward"] == 4  # 2 steps x 2 micro-batches
    before = _params(pipe)
    results = [pipe.train_step(_batch(256, 16, step), 2) for step in range(2, 5)]
    after = _params(pipe)
    assert pipe.workers[0].forward_only and not pipe.workers[1].input_grad
    assert calls["Backward"] == 4  # no Backward call into the frozen stage any more
    assert all(r.traffic.sent.get((0, "backward"), 0) == 0 for r in results)
    assert all(r.traffic.sent.get((0, "forward"), 0) > 0 for r in results)
    for name, value in before.items():
        moved = not torch.equal(value, after[name])
        assert moved == name.startswith("1:"), name  # stage 0 frozen, stage 1 (layer 2, norm, head) trains
    assert pipe.workers[0].in_flight == 0 and pipe.workers[0].peak_in_flight <= 2


def test_a_step_that_would_freeze_everything_is_refused_and_changes_nothing():
    # (one with fewer frozen layers than the stage's keeps the stage's: test_a_trainer_without_freeze_trains_on_...)
    pipe = LocalPipeline(GPT, 2, FP32, FP32, stage_cfg=NO_CLIP)
    pipe.freeze = FreezePolicy(n_layers=4, tolerance=1e-12)
    pipe.freeze.frozen = 2
    pipe.train_step(_batch(64, 16, 0), 2)
    for bad in (4, 5, 2**31):
        pipe.freeze.frozen = bad
        before = _params(pipe)
        with pytest.raises(StageCallError, match="frozen_layers"):
            pipe.train_step(_batch(64, 16, 1), 2)
        pipe.abandon_step()
        after = _params(pipe)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(w.frozen_layers == 2 for w in pipe.workers)
    with pytest.raises(ValueError):
        set_frozen(pipe.workers[0], 1)


@pytest.mark.parametrize("forward", ["aqsgd2", "acsgd2+ch+nr+fsl8+s20", DEFAULT_FORWARD_CODEC])
def test_a_frozen_boundary_sends_almost_nothing_after_first_sight_and_the_receiver_holds_the_frozen_output(forward):
    """Whatever the codec's first-sight coding (the default's subspace-coded ones are 0.2-0.5 off), the cache's
    first sights travel exact: the receiver holds the frozen output itself, and so does what the cache serves."""
    fw, bw = CodecConfig.parse(forward), CodecConfig.parse("gradq4+ef")
    pipe = LocalPipeline(LLAMA, 2, fw, bw, stage_cfg=NO_CLIP)
    pipe.freeze = FreezePolicy(n_layers=3, tolerance=1e-12, max_fraction=1.0)
    batches = [_batch(256, 16, step) for step in range(3)]  # an epoch of 3 batches, 24 samples
    for step in range(3):
        pipe.train_step(batches[step], 2)
    pipe.freeze.frozen = 2  # the next Step freezes stage 0 entirely
    pipe.train_step(batches[0], 2)
    sent = [pipe.train_step(batches[step % 3], 2).traffic.sent[(0, "forward")] for step in range(1, 10)]
    first, later = sent[:3], sent[3:]
    assert pipe.workers[0].cache_hits == 2 * 24  # two epochs answered from the cache, no compute
    assert max(later) * 15 < min(first)  # after first sight: a zero delta (414 B against 8008 B, envelope included)
    receiver = pipe.hosts[1].links.forward_recv.buffers
    for batch in batches:
        exact = pipe.workers[0].infer(batch.tokens)  # what the frozen stage computes for these samples
        held = torch.stack([receiver.get(int(i)).float() for i in batch.sample_ids])
        torch.testing.assert_close(held, exact, rtol=1e-2, atol=1e-3)  # the buffer dtype's rounding only


def test_a_stranger_or_a_stage_cannot_freeze_layers():
    pipe = LocalPipeline(GPT, 2, FP32, FP32, stage_cfg=NO_CLIP)
    pipe.freeze = FreezePolicy(n_layers=4, tolerance=1e-12)
    pipe.forward_backward(_batch(64, 16, 0), 2)  # step 0 open on both stages, waiting for its Step
    request = stage_pb2.StepRequest(step=0, global_grad_norm=1.0, frozen_layers=2)
    stranger = pipe.network.connector(CallSigner(Identity.generate()))
    neighbour = pipe.hosts[1].outbox.connector  # stage 1, signed with its own key: a plan peer, not a trainer
    for connector in (stranger, neighbour):
        with pytest.raises(grpc.RpcError) as err:
            connector.stage(pipe.addresses[0], pipe.replica_peers[0][0]).Step(request)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert pipe.workers[0].frozen_layers == 0 and all(p.requires_grad for p in pipe.workers[0].module.parameters())
    pipe.abandon_step()
    pipe.train_step(_batch(64, 16, 1), 2)  # the trainer's own Step still goes through


def test_a_trainer_without_freeze_trains_on_after_another_froze_layers_and_nothing_thaws():
    """Two trainers of one run: one froze layers 0-1 with its Step; the other (no --freeze, its plan says 0) sends
    Steps with frozen_layers 0, which were refused ("frozen layers never thaw") until the planner's repack. Now the
    stages keep their prefix and apply its steps; a Step reaching the last layer is still refused."""
    pipe = LocalPipeline(GPT, 2, FP32, FP32, stage_cfg=NO_CLIP)
    pipe.freeze = FreezePolicy(n_layers=GPT.n_layers, tolerance=1e-12, max_fraction=1.0)
    pipe.train_step(_batch(64, 16, 0), 2)
    pipe.freeze.frozen = 2
    pipe.train_step(_batch(64, 16, 1), 2)  # the freezing trainer's Step freezes layers 0-1
    frozen = {k: v.clone() for k, v in pipe.workers[0].module.state_dict().items() if block_of(k) in (0, 1)}
    trained = {k: v.clone() for k, v in pipe.workers[1].module.state_dict().items() if block_of(k) == 3}
    assert frozen and trained
    pipe.freeze = None
    plain = pipe.driver(4)  # another trainer: a plain driver, every Step with frozen_layers 0
    assert type(plain) is PipelineDriver
    for step in range(2, 4):
        assert not pipe.train_step(_batch(64, 16, step), 4).skipped
    assert [w.frozen_layers for w in pipe.workers] == [2, 2] and [h.steps_done for h in pipe.hosts] == [4, 4]
    after = pipe.workers[0].module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # nothing thawed
    later = pipe.workers[1].module.state_dict()
    assert any(not torch.equal(later[k], v) for k, v in trained.items())  # the rest trained on
    pipe.forward_backward(_batch(64, 16, 4), 4)
    with pytest.raises(StageCallError, match="reaches the model's last layer"):
        plain._call(0, 0, "Step", stage_pb2.StepRequest(step=4, global_grad_norm=1.0, frozen_layers=GPT.n_layers))
    assert [w.frozen_layers for w in pipe.workers] == [2, 2]


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt-tied", "llama-untied"])
def test_replicas_freeze_together_and_stay_equal(model):
    fw, bw = CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4+ef")
    pipe = LocalPipeline(model, 2, fw, bw, stage_cfg=NO_CLIP, replicas=2)
    pipe.freeze = FreezePolicy(n_layers=model.n_layers, tolerance=1e-12, max_fraction=1.0)
    pipe.train_step(_batch(model.vocab_size, 16, 0), 2)
    pipe.freeze.frozen = 2
    pipe.train_step(_batch(model.vocab_size, 16, 1), 4)  # its Step freezes layers 0-1 on every replica
    before = pipe.replica_hosts[0][0].worker.module.state_dict()
    before = {k: v.clone() for k, v in before.items() if block_of(k) == 0}
    for step in range(2, 5):
        pipe.train_step(_batch(model.vocab_size, 16, step), 4)
    assert [h.worker.frozen_layers for row in pipe.replica_hosts for h in row] == [2] * 4
    for s in range(2):
        a, b = (h.worker.module.state_dict() for h in pipe.replica_hosts[s])
        assert all(torch.equal(a[k], b[k]) for k in a)  # the replicas' averaging still keeps them equal
    after = pipe.replica_hosts[0][0].worker.module.state_dict()
    assert before and all(torch.equal(v, after[k]) for k, v in before.items())  # block 0 stays frozen


def test_a_tied_model_freezes_the_tied_pair_and_its_frozen_stage_answers_from_the_cache():
    fw, bw = CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4+ef")
    pipe = LocalPipeline(GPT, 2, fw, bw, stage_cfg=NO_CLIP)  # tied: stage 0 embeds, stage 1's head is a copy
    pipe.freeze = FreezePolicy(n_layers=4, tolerance=1e-12, max_fraction=1.0)
    batches = [_batch(64, 16, step) for step in range(3)]
    tied = [pipe.train_step(batches[step], 2).traffic.sent.get(("tied", "tied"), 0) for step in range(3)]
    assert min(tied) > 0  # both copies train and sum their gradients before the freeze
    pipe.freeze.frozen = 2  # the next Step freezes stage 0 entirely, and the tied pair on both end stages
    pipe.train_step(batches[0], 2)
    emb, head = pipe.workers[0].module.tied_parameter(), pipe.workers[1].module.tied_parameter()
    kept = emb.detach().clone()
    assert torch.equal(emb, head) and not emb.requires_grad and not head.requires_grad
    assert pipe.workers[0].forward_only and not pipe.workers[1].input_grad
    results = [pipe.train_step(batches[step % 3], 2) for step in range(1, 10)]
    assert pipe.workers[0].cache_hits == 2 * 24  # two epochs answered from the cache, no compute
    assert all(r.traffic.sent.get(("tied", "tied"), 0) == 0 for r in results)  # nothing left to sum
    assert all(r.traffic.sent.get((0, "backward"), 0) == 0 for r in results)
    assert torch.equal(emb, kept) and torch.equal(head, kept)  # neither copy moved (no AdamW drift either)
    assert all(math.isfinite(r.loss) for r in results)
