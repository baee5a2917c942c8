"""The replicas' default sum over compressed links (`SUM_CODEC`: each weight matrix as rank-16 factors in 4-bit codes,
error feedback, in AdamW's units) and the 2-bit rung above it (`QUANTIZED_SUM_CODEC`, quantized in AdamW's units):
replicas stay bit-identical step after step (the verification's digests and the AQ-SGD routes depend on it), a
plan's 2-bit rung is taken as it is, not raised to `min_bits`, and the error feedback and warm starts are each
replica's own."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, make_codec
from swarm.compression.state import LinkState
from swarm.net.connect import LocalRpcError
from swarm.proto import stage_pb2
from swarm.runtime.average import QUANTIZED_SUM_CODEC, SUM_CODEC, GradientAverager, flatten_grads
from tests.unit.runtime.test_average import flat
from tests.unit.runtime.test_replica_host import FP32, GRADQ, Replicas


def digests(pipe: Replicas) -> set[str]:
    return {pipe.client(r).Status(stage_pb2.Empty()).weights_digest for r in range(len(pipe.hosts))}


def identical_steps(pipe: Replicas, steps: int):
    """Trains `steps` steps on every replica, each one's batch split over them; yields each step's Reduce replies once
    every replica holds the same summed gradient and, after its Step, the same weights."""
    n = len(pipe.hosts)
    for step in range(steps):
        pipe.split_step(step, rows=6, seed=step)
        replies = pipe.reduce(step)
        assert all(torch.equal(flat(pipe, 0), flat(pipe, r)) for r in range(1, n)), f"sums differ at step {step}"
        for r in range(n):
            pipe.step(r, step)
        assert len(digests(pipe)) == 1, f"replicas' weights differ after step {step}"
        yield replies


@pytest.mark.parametrize("in_adamw_units", [False, True])
def test_the_default_sum_keeps_replicas_bit_identical_step_after_step_at_its_factors_bytes(monkeypatch, in_adamw_units):
    """In AdamW's units (`precondition_ranked`, the default since s58) or as they are: the same bits on every
    replica, each one's residual and warm start its own."""
    monkeypatch.setattr(GradientAverager, "precondition_ranked", in_adamw_units)
    pipe = Replicas(3, backward=GRADQ)  # three replicas: every member adds three decoded messages in group order
    config = pipe.hosts[0].averager._config(0, 0)
    assert config.label == CodecConfig.parse(SUM_CODEC).label
    assert config.layout == tuple(tuple(p.shape) for p in pipe.hosts[0].averager.trained)  # coded per parameter
    assert pipe.hosts[0].averager._preconditioned(config, False) is in_adamw_units
    payload = make_codec(config).payload_nbytes(pipe.hosts[0].averager.numel)
    for replies in identical_steps(pipe, 8):
        # what each member sent its two others: the factors' codes and scales, framing and envelope aside
        assert all(2 * payload < reply.wire_bytes < 2 * payload * 1.1 + 2048 for reply in replies)
        # rank 16 in 4 bits at this hidden size (32) codes 10.1x fewer bytes than fp32 (rank 12: 12.7x)
        assert all(reply.wire_bytes < reply.fp32_wire_bytes / 9.5 for reply in replies)
    residuals = [h.averager.residual for h in pipe.hosts]
    assert all(r is not None for r in residuals) and not torch.equal(residuals[0], residuals[1])  # each its own
    warm = [h.averager.groups[False].warm for h in pipe.hosts]
    assert all(isinstance(w, tuple) for w in warm)
    k = next(i for i, q in enumerate(warm[0]) if q is not None)  # the first factored matrix (None: sent whole)
    assert not torch.equal(warm[0][k], warm[1][k])  # encoder-local
    if in_adamw_units:  # the same scale on every replica, from the optimizer state they share
        scales = [h.averager._preconditioner() for h in pipe.hosts]
        assert scales[0] is not None and all(torch.equal(scales[0], s) for s in scales[1:])


def test_the_2_bit_rung_keeps_replicas_bit_identical_at_a_sixteenth_of_fp32(monkeypatch):
    monkeypatch.setattr(GradientAverager, "sum_codec", QUANTIZED_SUM_CODEC)
    pipe = Replicas(3, backward=GRADQ)
    for replies in identical_steps(pipe, 8):
        # 2 bits and a 16-bit scale per group of 1024 against 32 bits, framing aside
        assert all(0 < reply.wire_bytes < reply.fp32_wire_bytes / 12 for reply in replies)
    scales = [h.averager._preconditioner() for h in pipe.hosts]  # AdamW's units: the same on every replica
    assert scales[0] is not None and all(torch.equal(scales[0], s) for s in scales[1:])
    residuals = [h.averager.residual for h in pipe.hosts]
    assert all(r is not None for r in residuals) and not torch.equal(residuals[0], residuals[1])  # each its own


def test_a_replica_s_message_is_its_gradient_and_residual_in_adamw_units_less_what_it_keeps(monkeypatch):
    """The residual is kept in gradient units and put in this step's AdamW units when it is sent: kept in the units
    of the step that left it, a growing second moment amplified it in gradient units step after step."""
    monkeypatch.setattr(GradientAverager, "sum_codec", QUANTIZED_SUM_CODEC)
    pipe = Replicas(2, backward=GRADQ)
    for step in range(2):
        pipe.split_step(step, seed=step)
        pipe.reduce(step)
        for r in range(2):
            pipe.step(r, step)
    host = pipe.hosts[0]
    old = host.averager.residual.clone()
    pipe.split_step(2, seed=2)
    scale = host.averager._preconditioner()
    own = flatten_grads(host.averager.trained) * scale
    config = host.averager._config(2, 0)
    state = LinkState(config)
    state.residual = old * scale
    sent = make_codec(config).encode(own, state=state)  # what replica 0 sends for step 2 (its draws are seeded)
    pipe.reduce(2)
    pending = host.averager.groups[False].pending
    assert torch.equal(pending, state.residual / scale)  # kept in gradient units
    torch.testing.assert_close(pending * scale + make_codec(config).decode(sent), own + old * scale, rtol=0, atol=1e-5)


def test_the_sum_codec_follows_the_plan_then_the_links():
    pipe = Replicas(2, backward=GRADQ)
    averager = pipe.hosts[0].averager
    assert averager._config(0, 0).name == "mlowrank"  # compressed links, no plan: SUM_CODEC
    averager.set_codecs(CodecConfig.parse(QUANTIZED_SUM_CODEC), None)
    assert averager._config(0, 0).bits == 2  # the plan's 2-bit rung as it is, not raised to min_bits
    assert averager._preconditioned(averager._config(0, 0), False)
    averager.set_codecs(CodecConfig.parse("gradq8+ef+rot+nr+cs+g1024"), None)
    assert averager._config(0, 0).bits == 8
    assert not averager._preconditioned(averager._config(0, 0), False)  # 8 bits: as before, unscaled
    assert not averager._preconditioned(CodecConfig.parse(QUANTIZED_SUM_CODEC), True)  # the tied group's ends differ
    assert averager._preconditioned(CodecConfig.parse(SUM_CODEC), False)  # factored: in AdamW's units too
    averager.set_codecs(CodecConfig.parse(SUM_CODEC), CodecConfig.parse(SUM_CODEC))
    assert averager._config(0, 0).layout == tuple(tuple(p.shape) for p in averager.trained)
    exact = Replicas(2, backward=FP32).hosts[0].averager  # fp32 links: exact sums, whatever sum_codec says
    assert exact._config(0, 0).name == "fp32"


def test_without_the_sum_codec_the_backward_codec_sums_at_min_bits(monkeypatch):
    monkeypatch.setattr(GradientAverager, "sum_codec", None)
    pipe = Replicas(2, backward=GRADQ)
    assert pipe.hosts[0].averager._config(0, 0).bits == GradientAverager.min_bits == 8


def test_a_member_whose_factors_follow_another_layout_is_refused_by_name_and_nothing_is_summed():
    """A liar (or a peer on another model) codes its sum with the same element count in another parameter order:
    every message decodes against the receiver's own layout, so the Reduce fails naming it, nothing summed."""
    pipe = Replicas(2, backward=GRADQ)
    liar = pipe.hosts[1].averager
    honest_config = liar._config

    def reordered(step, index, tied=False):
        config = honest_config(step, index, tied)
        return replace(config, layout=tuple(reversed(config.layout)))

    liar._config = reordered
    pipe.split_step(0, seed=0)
    before = flat(pipe, 0)
    result = pipe.reduce(0)[0]
    assert isinstance(result, LocalRpcError) and result.code() == grpc.StatusCode.INVALID_ARGUMENT, result
    details = result.details()
    assert pipe.peers[1] in details and "factors" in details and "nothing summed" in details, details
    assert torch.equal(flat(pipe, 0), before)
    assert pipe.hosts[0].averager.groups[False].pending is None  # no residual of the failed sum to commit
