"""Frozen parameters leave the replicas' sum (swarm.runtime.average): the Step that freezes orders the change on
every replica, the next sums carry only the trained parameters (bytes counted), the residual keeps their
slices, and members whose frozen prefixes differ are refused by name, with nothing summed."""

from __future__ import annotations

import grpc
import torch

from swarm.net.connect import LocalRpcError
from swarm.proto import stage_pb2
from swarm.runtime.average import flatten_grads
from tests.unit.runtime.test_replica_host import GRADQ, Replicas


def _step(pipe: Replicas, r: int, step: int, frozen: int) -> None:
    pipe.client(r).Step(stage_pb2.StepRequest(step=step, global_grad_norm=0.5, frozen_layers=frozen))


def _frozen_numel(pipe: Replicas, r: int = 0) -> int:
    return sum(p.numel() for p in pipe.hosts[r].averager.params if not p.requires_grad)


def test_frozen_parameters_leave_the_sum_and_their_bytes_are_saved():
    pipe = Replicas(2)
    pipe.split_step(0)
    full = pipe.reduce(0)
    for r in range(2):
        _step(pipe, r, 0, frozen=1)  # the Step that freezes layer 0 on every replica orders the change
    frozen, everything = _frozen_numel(pipe), sum(p.numel() for p in pipe.hosts[0].averager.params)
    assert 0 < frozen < everything and all(h.averager.numel == everything - frozen for h in pipe.hosts)
    pipe.split_step(1)
    own = [flatten_grads(h.averager.trained) for h in pipe.hosts]
    replies = pipe.reduce(1)
    assert all(isinstance(r, stage_pb2.ReduceReply) for r in replies), replies
    for r, h in enumerate(pipe.hosts):
        assert torch.equal(flatten_grads(h.averager.trained), own[0] + own[1])  # exact fp32 sum, trained only
        assert all(p.grad is None for p in h.averager.params if not p.requires_grad)  # frozen: no gradient at all
        assert replies[r].fp32_wire_bytes == 4 * (everything - frozen)
    saved = full[0].wire_bytes - replies[0].wire_bytes  # the fp32 codec zstd-compresses: about 4 B an element
    print(f"average bytes per member: {full[0].wire_bytes} all active, {replies[0].wire_bytes} layer 0 frozen")
    assert saved >= 0.85 * 4 * frozen, f"{saved} bytes saved of {4 * frozen} frozen fp32 bytes"
    for r in range(2):
        _step(pipe, r, 1, frozen=1)
    digests = {pipe.client(r).Status(stage_pb2.Empty()).weights_digest for r in range(2)}
    assert len(digests) == 1, "the replicas stay equal"


def test_relayout_slices_the_committed_residual():
    pipe = Replicas(2, backward=GRADQ)
    pipe.split_step(0)
    pipe.reduce(0)
    for r in range(2):
        pipe.step(r, 0)
    averager = pipe.hosts[0].averager
    before = averager.residual.clone()
    assert before.numel() == averager.numel and float(before.abs().sum()) > 0
    from swarm.runtime.freeze import apply_frozen

    apply_frozen(pipe.hosts[0], 1)
    keep = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in averager.params])
    assert not bool(keep.all())
    assert torch.equal(averager.residual, before[keep]) and averager.numel == int(keep.sum())


def test_members_with_different_frozen_prefixes_are_refused_and_nothing_is_summed():
    pipe = Replicas(2)
    pipe.split_step(0)
    pipe.reduce(0)
    _step(pipe, 0, 0, frozen=1)
    _step(pipe, 1, 0, frozen=0)  # a replica that missed the freeze (it cannot: the Step orders it; a bug would)
    pipe.split_step(1)
    before = [flatten_grads(h.averager.params) for h in pipe.hosts]
    results = pipe.reduce(1, deadline_s=2.0)
    assert all(isinstance(e, LocalRpcError) for e in results), results
    assert any(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "frozen" in e.details() for e in results)
    for h, was in zip(pipe.hosts, before, strict=True):
        assert torch.equal(flatten_grads(h.averager.params), was), "nothing was summed"
        assert h.averager.groups[False].pending is None
