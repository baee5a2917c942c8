"""Held-out evaluation through the stages (`swarm.runtime.heldout`, `PipelineDriver.evaluate`): the unsplit model's
loss, no training state touched, refused to strangers, bad replies refused by name."""

import math

import pytest
import torch

from swarm.compression import CodecConfig, WireError
from swarm.model.data import SampleSet
from swarm.model.gpt import GPT, ModelConfig
from swarm.net.auth import CallSigner, Identity
from swarm.net.stream import StageCallError
from swarm.proto import stage_pb2
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.heldout import held_out_loss
from swarm.runtime.inprocess import LocalPipeline

torch.set_num_threads(1)

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=1)
AQSGD = CodecConfig.parse("aqsgd4")
GRADQ = CodecConfig.parse("gradq8")


def _windows(n: int, seed: int, first_id: int = 0) -> SampleSet:
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len_tokens + 1), generator=gen)
    return SampleSet(torch.arange(first_id, first_id + n), windows)


TRAIN, HELD = _windows(16, 0), _windows(10, 1, first_id=100)


def _weights(pipe: LocalPipeline) -> dict[str, torch.Tensor]:
    return {f"{h.role.stage}.{h.role.replica}.{k}": v for row in pipe.replica_hosts for h in row
            for k, v in h.worker.state_dict().items()}  # fmt: skip


@pytest.mark.parametrize("n_stages, replicas", [(1, 1), (3, 1), (2, (2, 1))])
def test_the_held_out_loss_is_the_unsplit_models(n_stages, replicas):
    pipe = LocalPipeline(CFG, n_stages, AQSGD, GRADQ, replicas=replicas)
    try:
        got = pipe.driver(2).evaluate(HELD, rows=3, step=0, hidden=CFG.hidden_dim)  # 3 + 3 + 3 + 1 windows
        with torch.no_grad():
            full = GPT(CFG)
            batch = HELD.batch(slice(0, len(HELD)))
            want = float(full(batch.tokens, batch.targets))
        assert got.samples == 10 and got.bytes > 0
        assert math.isclose(got.loss, want, rel_tol=1e-5)
        assert math.isclose(got.loss, pipe.evaluate(HELD, 4), rel_tol=1e-6)
    finally:
        pipe.close()


def test_evaluating_between_steps_leaves_training_bit_for_bit_as_it_was():
    """AQ-SGD buffers, rounding draws, optimizer moments and weights: a run that evaluates after every step
    trains exactly as one that never does (one replica per stage: replicas sum gradients in arrival order, so two
    runs with replicas differ in the last bits whatever they do)."""
    runs = []
    for evaluate in (False, True):
        pipe = LocalPipeline(CFG, 2, AQSGD, GRADQ)
        try:
            losses, held = [], []
            for step in range(4):
                batch = TRAIN.batch(slice((step % 2) * 8, (step % 2) * 8 + 8))  # samples seen again: buffers used
                losses.append(pipe.train_step(batch, 4).loss)
                if evaluate:
                    held.append(pipe.driver(4).evaluate(HELD, rows=2, step=step + 1, hidden=CFG.hidden_dim).loss)
            runs.append((losses, _weights(pipe), held))
        finally:
            pipe.close()
    (losses, weights, _), (losses_eval, weights_eval, held) = runs
    assert losses == losses_eval
    assert weights.keys() == weights_eval.keys()
    for name, w in weights.items():
        assert torch.equal(w, weights_eval[name]), name
    assert len(held) == 4 and all(math.isfinite(h) for h in held)


def test_a_stage_refuses_to_evaluate_a_step_it_applied_already():
    """The weights evaluated are named by the next step: asking for an old step is refused, not answered with
    newer weights."""
    pipe = LocalPipeline(CFG, 2)
    try:
        pipe.train_step(TRAIN.batch(slice(0, 8)), 2)
        with pytest.raises(StageCallError, match="applied here already"):
            pipe.driver(2).evaluate(HELD, rows=2, step=0, hidden=CFG.hidden_dim)
    finally:
        pipe.close()


def test_a_stranger_cannot_evaluate():
    pipe = LocalPipeline(CFG, 2)
    try:
        stranger = pipe.network.connector(CallSigner(Identity.generate()))
        driver = PipelineDriver(pipe.addresses, [row[0] for row in pipe.replica_peers], connector=stranger)
        with pytest.raises(StageCallError, match="PERMISSION_DENIED|not a trainer|trainer"):
            driver.evaluate(HELD, rows=2, step=0, hidden=CFG.hidden_dim)
        driver.close()
    finally:
        pipe.close()


def _lying_call(reply: stage_pb2.RecomputeReply):
    def call(stage, replica, method, request, timeout=None):
        assert method == "Recompute" and not request.backward  # forward only
        return reply

    return call


@pytest.mark.parametrize(
    "reply, match",
    [
        (stage_pb2.RecomputeReply(), "no activation"),
        (stage_pb2.RecomputeReply(loss=1.0), "no activation"),
    ],
)
def test_a_stage_without_an_activation_is_refused(reply, match):
    with pytest.raises(WireError, match=match):
        held_out_loss(_lying_call(reply), [0, 0], HELD, 2, 0, 0, CFG.hidden_dim)


def test_a_wrongly_shaped_or_non_finite_activation_or_loss_is_refused():
    from swarm.compression import make_codec

    codec = make_codec(CodecConfig.parse("fp32"))
    wrong = stage_pb2.RecomputeReply(output=codec.encode(torch.zeros(2, 16, 31)))
    with pytest.raises(WireError, match="shaped"):
        held_out_loss(_lying_call(wrong), [0, 0], HELD, 2, 0, 0, CFG.hidden_dim)
    nan = stage_pb2.RecomputeReply(output=codec.encode(torch.zeros(2, 16, 32)))
    nan.output.raw = torch.full((2, 16, 32), math.nan).numpy().tobytes()  # an encoder refuses NaN: a liar's bytes
    with pytest.raises(WireError):
        held_out_loss(_lying_call(nan), [0, 0], HELD, 2, 0, 0, CFG.hidden_dim)
    for loss in (math.nan, math.inf, -1.0):
        with pytest.raises(WireError, match="loss"):
            held_out_loss(_lying_call(stage_pb2.RecomputeReply(loss=loss)), [0], HELD, 2, 0, 0, CFG.hidden_dim)


def test_nothing_to_evaluate_is_a_clear_error():
    with pytest.raises(ValueError, match="rows"):
        held_out_loss(_lying_call(stage_pb2.RecomputeReply(loss=1.0)), [0], HELD, 0, 0, 0, CFG.hidden_dim)
