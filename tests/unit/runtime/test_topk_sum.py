"""The replicas' sum sparsified (topk with error feedback, quantized in AdamW's units): replicas stay bit-identical
step after step, a joiner's empty residual changes nothing of that, each replica's error feedback is its own, and a
liar's huge or NaN message is refused by name before anything is summed."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, make_codec
from swarm.compression.codec_topk import SPARSE_SUM_CODEC
from swarm.compression.state import LinkState
from swarm.net.connect import LocalRpcError
from swarm.net.stream import tensor_items
from swarm.proto import stage_pb2
from swarm.runtime.average import GradientAverager, flatten_grads
from tests.unit.runtime.test_average import flat, pipe_identity
from tests.unit.runtime.test_replica_host import GRADQ, Replicas


@pytest.fixture(autouse=True)
def sparse_sum(monkeypatch):
    """Every replica sums with the sparsified codec (opt-in), preconditioned (as every sum of at most 2 bits)."""
    monkeypatch.setattr(GradientAverager, "sum_codec", SPARSE_SUM_CODEC)


def digests(pipe: Replicas) -> set[str]:
    return {pipe.client(r).Status(stage_pb2.Empty()).weights_digest for r in range(len(pipe.hosts))}


def train_steps(pipe: Replicas, steps: range) -> list:
    replies = []
    for step in steps:
        pipe.split_step(step, seed=step)
        replies.append(pipe.reduce(step))
        assert torch.equal(flat(pipe, 0), flat(pipe, 1))  # the same decoded sum on both, bit for bit
        for r in range(len(pipe.hosts)):
            pipe.step(r, step)
        assert len(digests(pipe)) == 1, f"replicas' weights differ after step {step}"
    return replies


def test_topk_sum_keeps_two_replicas_bit_identical_over_many_steps_at_a_fraction_of_the_bytes():
    pipe = Replicas(2, backward=GRADQ)  # a compressed backward codec: the sum is GradientAverager.sum_codec's
    replies = train_steps(pipe, range(12))
    for reply in (r for step in replies for r in step):
        assert reply.group_size == 2 and reply.wire_bytes < reply.fp32_wire_bytes / 40
    residuals = [h.averager.residual for h in pipe.hosts]
    assert all(r is not None for r in residuals) and not torch.equal(residuals[0], residuals[1])  # each its own


def test_each_replica_sends_its_gradient_plus_its_residual_and_keeps_what_it_left_out():
    pipe = Replicas(2, backward=GRADQ)
    train_steps(pipe, range(2))
    host = pipe.hosts[0]
    old = host.averager.residual.clone()
    pipe.split_step(2, seed=2)
    scale = host.averager._preconditioner()  # AdamW's units: the same on both replicas
    assert scale is not None and torch.equal(scale, pipe.hosts[1].averager._preconditioner())
    own = flatten_grads(host.averager.trained) * scale
    config = host.averager._config(2, 0)
    assert config.label == CodecConfig.parse(SPARSE_SUM_CODEC).label
    state = LinkState(config)
    state.residual = old * scale  # kept in gradient units, sent in this step's AdamW units
    sent = make_codec(config).encode(own, state=state)
    pipe.reduce(2)
    pending = host.averager.groups[False].pending
    assert torch.equal(pending, state.residual / scale)  # this replica's alone: no other member's message
    decoded = make_codec(config).decode(sent)
    torch.testing.assert_close(pending * scale + decoded, own + old * scale, rtol=1e-6, atol=1e-5)  # fp32 rounding


def test_a_joiner_starts_with_an_empty_residual_and_the_replicas_stay_identical():
    pipe = Replicas(2, backward=GRADQ)
    train_steps(pipe, range(4))
    # replica 1 is replaced by a joiner: its weights come from its sibling (the same bits, as the digests say) and
    # its error feedback starts at zero; the sibling keeps its own
    pipe.hosts[1].averager.groups[False].residual = None
    train_steps(pipe, range(4, 8))
    assert pipe.hosts[1].averager.residual is not None


def liar_items(pipe: Replicas, step: int, edit) -> list[bytes]:
    """Replica 1's Average stream of `step` as a liar sends it: a topk message tampered by `edit`."""
    config = CodecConfig.parse(SPARSE_SUM_CODEC, zstd_level=0)
    msg = make_codec(config).encode(torch.randn(pipe.hosts[0].averager.numel))
    edit(msg)
    info = stage_pb2.CallInfo(step=step, stage=0, micro_batch=1, num_micro_batches=2)
    return list(tensor_items(info, msg, 0, None))


def refused_sum(pipe: Replicas, edit, words: str) -> None:
    train_steps(pipe, range(2))
    residual = pipe.hosts[0].averager.residual.clone()
    pipe.split_step(2, seed=2)
    before = flat(pipe, 0)
    pipe.client(0, pipe_identity(pipe, 1)).Average(iter(liar_items(pipe, 2, edit)))
    (result,) = pipe.reduce(2, members=[0], deadline_s=10)
    assert isinstance(result, LocalRpcError) and result.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pipe.peers[1] in result.details() and words in result.details(), result.details()
    averager = pipe.hosts[0].averager
    assert torch.equal(flat(pipe, 0), before) and averager.groups[False].pending is None  # nothing summed
    assert torch.equal(averager.residual, residual)  # the honest replica's error feedback is untouched


def test_a_liars_huge_message_fails_the_sum_by_name_and_poisons_nothing():
    def huge(msg):
        msg.sparse.hi = (torch.frombuffer(bytearray(msg.sparse.hi), dtype=torch.float32) * 1e6).numpy().tobytes()

    refused_sum(Replicas(2, backward=GRADQ), huge, "more than 64x")


def test_a_liars_nan_message_fails_the_sum_by_name_and_poisons_nothing():
    def nan(msg):
        lo = torch.frombuffer(bytearray(msg.sparse.lo), dtype=torch.float32).clone()
        lo[0] = float("nan")
        msg.sparse.lo = lo.numpy().tobytes()

    refused_sum(Replicas(2, backward=GRADQ), nan, "sparse.lo")
