"""The tied embedding's gradient summed between the end stages (their Reduce's tied group): every copy of the
weight gets the same bits, the bytes are counted on link "tied" and in the step's totals, and every stranger's,
middle stage's, duplicate, malformed or never-arriving message is refused by name with nothing applied."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, make_codec
from swarm.net.auth import CallSigner, Identity
from swarm.net.connect import LocalRpcError
from swarm.net.stream import tensor_items
from swarm.proto import stage_pb2
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.runtime.test_replicas import CFG, FP32, batch

torch.set_num_threads(1)

GRADQ = CodecConfig("gradq", bits=4, error_feedback=True)


def trainer(pipe: LocalPipeline, s: int, r: int = 0):
    """A client of replica r of stage s, signed by the pipeline's trainer."""
    connector = pipe.network.connector(CallSigner(pipe.trainer))
    return connector.stage(pipe.replica_addresses[s][r], pipe.replica_peers[s][r])


def as_host(pipe: LocalPipeline, sender: tuple[int, int], to: tuple[int, int]):
    """A client of host `to`, signed by host `sender` (its own connector)."""
    s, r = to
    return pipe.replica_hosts[sender[0]][sender[1]].outbox.connector.stage(
        pipe.replica_addresses[s][r], pipe.replica_peers[s][r]
    )


def tied_request(pipe: LocalPipeline, s: int, step: int, deadline_s: float = 10.0, **override):
    last = len(pipe.counts) - 1
    members = [(t, r) for t in (0, last) for r in range(pipe.counts[t])]
    request = stage_pb2.ReduceRequest(
        step=step, stage=s, group_peers=[pipe.replica_peers[s][0]], group_addresses=[pipe.replica_addresses[s][0]],
        tied_peers=[pipe.replica_peers[t][r] for t, r in members],
        tied_addresses=[pipe.replica_addresses[t][r] for t, r in members], deadline_s=deadline_s,
    )  # fmt: skip
    for key, value in override.items():
        del getattr(request, key)[:]
        getattr(request, key).extend(value)
    return request


def tied_items(pipe: LocalPipeline, step: int, stage: int, index: int, numel: int | None = None, value=1.0):
    numel = numel or pipe.hosts[0].averager.tied_numel
    msg = make_codec(FP32).encode(torch.ones(numel))
    if value != 1.0:  # as a faulty or hostile sender's bytes: its own encoder would refuse a NaN
        msg.raw = torch.full((numel,), value).numpy().tobytes()
    info = stage_pb2.CallInfo(step=step, stage=stage, micro_batch=index, num_micro_batches=2, tied=True)
    return tensor_items(info, msg, 0, None)


def refused(fn, *args, code: grpc.StatusCode, words: str):
    with pytest.raises(LocalRpcError) as e:
        fn(*args)
    assert e.value.code() == code and words in e.value.details(), e.value.details()


def tied_weights(pipe: LocalPipeline) -> list[torch.Tensor]:
    last = len(pipe.counts) - 1
    return [h.worker.module.tied_parameter().detach().clone() for s in (0, last) for h in pipe.replica_hosts[s]]


def test_fp32_step_counts_the_tied_sum_on_its_link_and_the_totals_add_up():
    pipe = LocalPipeline(CFG, 3, FP32, FP32)
    try:
        r = pipe.train_step(batch(seed=1), n_micro=2)
        numel = pipe.hosts[0].averager.tied_numel
        assert numel == CFG.vocab_size * CFG.hidden_dim
        assert r.traffic.sent[("tied", "tied")] == r.sync_bytes
        # two members, one fp32 message each way (zstd shrinks the rows of tokens the batch never saw)
        assert 0 < r.sync_bytes < 1.05 * 2 * 4 * numel
        assert r.traffic.tied_fp32_bytes == 2 * 4 * numel
        assert r.control_bytes > 0
        parts = r.forward_bytes + r.backward_bytes + r.sync_bytes + r.reduce_bytes + r.control_bytes
        assert r.total_wire_bytes == parts
        assert r.fp32_total_wire_bytes == r.fp32_wire_bytes + r.traffic.tied_fp32_bytes + r.control_bytes
        assert r.traffic.link_bytes.keys() == {0, 1}  # the tied group is no pipeline link
        snap = pipe.driver(2).metrics.snapshot()
        assert snap['swarm_wire_bytes_total{direction="tied",link="tied"}'] == r.sync_bytes
        assert snap["swarm_control_bytes_total"] == r.control_bytes
        ends = [pipe.hosts[0], pipe.hosts[2]]
        sent = sum(h.metrics.snapshot()['swarm_wire_bytes_total{direction="tied",link="tied"}'] for h in ends)
        assert sent == r.sync_bytes  # the stages counted what the driver reports
        a, b = tied_weights(pipe)
        assert torch.equal(a, b)
    finally:
        pipe.close()


def test_gradq_replicas_of_both_end_stages_hold_the_same_tied_bits_and_sync_is_compressed():
    pipe = LocalPipeline(CFG, 2, CodecConfig("aqsgd", bits=2), GRADQ, replicas=(2, 3))
    try:
        for step in range(3):
            r = pipe.train_step(batch(n=24, seed=step), n_micro=6)
            copies = tied_weights(pipe)
            assert all(torch.equal(copies[0], c) for c in copies[1:]), f"tied copies differ after step {step}"
        members = 5
        fp32 = members * (members - 1) * 4 * pipe.hosts[0].averager.tied_numel
        assert r.traffic.tied_fp32_bytes == fp32
        assert r.sync_bytes < fp32 / 3.5  # summed at GradientAverager.min_bits = 8
        assert all(h.averager.tied_residual is not None for s in (0, 1) for h in pipe.replica_hosts[s])
    finally:
        pipe.close()


def test_abandon_drops_the_tied_residual_and_step_commits_it():
    pipe = LocalPipeline(CFG, 2, FP32, GRADQ)
    try:
        pipe.train_step(batch(seed=0), n_micro=2)
        committed = [h.averager.tied_residual.clone() for h in pipe.hosts]
        step = pipe._step
        pipe.forward_backward(batch(seed=1), n_micro=2)
        replies = reduce_both(pipe, step)
        assert all(not isinstance(x, Exception) and x.tied_wire_bytes > 0 for x in replies), replies
        assert all(h.averager.groups[True].pending is not None for h in pipe.hosts)
        pipe.abandon_step()
        for h, before in zip(pipe.hosts, committed, strict=True):
            assert torch.equal(h.averager.tied_residual, before) and h.averager.groups[True].pending is None
        r = pipe.train_step(batch(seed=1), n_micro=2)  # runs again whole; its Step commits the new residual
        assert r.attempts == 1
        assert not any(torch.equal(h.averager.tied_residual, b) for h, b in zip(pipe.hosts, committed, strict=True))
    finally:
        pipe.close()


def reduce_both(pipe: LocalPipeline, step: int, deadline_s: float = 10.0) -> list:
    out: list = [None, None]

    def run(k: int, s: int) -> None:
        try:
            out[k] = trainer(pipe, s).Reduce(tied_request(pipe, s, step, deadline_s))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[k] = e

    threads = [threading.Thread(target=run, args=(k, s)) for k, s in enumerate((0, len(pipe.counts) - 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_strangers_and_middle_stages_tied_calls_are_refused():
    pipe = LocalPipeline(CFG, 3, FP32, FP32)
    try:
        pipe.forward_backward(batch(seed=2), n_micro=2)
        stranger = pipe.network.connector(CallSigner(Identity.generate())).stage(
            pipe.addresses[0], pipe.replica_peers[0][0]
        )
        denied = grpc.StatusCode.PERMISSION_DENIED
        refused(stranger.Average, tied_items(pipe, 0, 2, 1), code=denied, words="Average")
        refused(as_host(pipe, (1, 0), (0, 0)).Average, tied_items(pipe, 0, 1, 1), code=denied, words="Average")
        # the last stage is in the tied group, not in stage 0's replica group: a plain Average is refused
        plain = stage_pb2.CallInfo(step=0, stage=0, micro_batch=1, num_micro_batches=2)
        items = tensor_items(plain, make_codec(FP32).encode(torch.ones(pipe.hosts[0].averager.numel)), 0, None)
        refused(as_host(pipe, (2, 0), (0, 0)).Average, items, code=denied, words="only from another replica")
        # Reduce naming a tied group on a middle stage, or one at an address the plan does not give
        middle = tied_request(pipe, 1, 0)
        middle.group_peers[:] = [pipe.replica_peers[1][0]]
        middle.group_addresses[:] = [pipe.addresses[1]]
        refused(trainer(pipe, 1).Reduce, middle, code=denied, words="tied group")
        evil = tied_request(pipe, 0, 0, tied_addresses=[pipe.addresses[0], "evil:1"])
        refused(trainer(pipe, 0).Reduce, evil, code=denied, words="tied group")
        bare = tied_request(pipe, 0, 0, tied_peers=[], tied_addresses=[])
        refused(trainer(pipe, 0).Reduce, bare, code=grpc.StatusCode.INVALID_ARGUMENT, words="tied group")
        step0 = stage_pb2.StepRequest(step=0, global_grad_norm=1.0)
        refused(trainer(pipe, 0).Step, step0, code=grpc.StatusCode.FAILED_PRECONDITION, words="not summed")
        carrying = stage_pb2.StepRequest(step=0, global_grad_norm=1.0)
        carrying.tied_grad_sum.CopyFrom(make_codec(FP32).encode(torch.zeros(3)))
        refused(trainer(pipe, 0).Step, carrying, code=grpc.StatusCode.INVALID_ARGUMENT, words="tied_grad_sum")
        assert pipe.hosts[0].averager.groups[True].inbox == {} and pipe.hosts[0].steps_done == 0
    finally:
        pipe.close()


def test_a_duplicate_malformed_or_never_arriving_member_fails_the_reduce_by_name_and_nothing_applies():
    pipe = LocalPipeline(CFG, 2, FP32, FP32)
    try:
        pipe.forward_backward(batch(seed=3), n_micro=2)
        from_last = as_host(pipe, (1, 0), (0, 0))
        numel = pipe.hosts[0].averager.tied_numel
        refused(from_last.Average, tied_items(pipe, 0, 1, 1, numel=numel - 1), code=grpc.StatusCode.INVALID_ARGUMENT,
                words="tied weight")  # fmt: skip
        from_last.Average(tied_items(pipe, 0, 1, 1))
        refused(from_last.Average, tied_items(pipe, 0, 1, 1), code=grpc.StatusCode.ALREADY_EXISTS, words="sent")
        pipe.abandon_step()
        assert pipe.hosts[0].averager.groups[True].inbox == {}  # the abandon dropped what it held
        # step 1: the last stage alone; stage 0 takes its message but never sends its own
        pipe.forward_backward(batch(seed=4), n_micro=2)
        before = pipe.hosts[1].worker.tied_grad()
        with pytest.raises(LocalRpcError) as e:
            trainer(pipe, 1).Reduce(tied_request(pipe, 1, 1, deadline_s=1.0))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and pipe.replica_peers[0][0] in e.value.details()
        assert torch.equal(pipe.hosts[1].worker.tied_grad(), before)
        refused(trainer(pipe, 1).Step, stage_pb2.StepRequest(step=1, global_grad_norm=1.0),
                code=grpc.StatusCode.FAILED_PRECONDITION, words="not summed")  # fmt: skip
        pipe.abandon_step()
        assert all(h.steps_done == 0 for h in pipe.hosts)
        r = pipe.train_step(batch(seed=3), n_micro=2)  # the next step runs whole
        assert r.attempts == 1 and torch.equal(*tied_weights(pipe))
    finally:
        pipe.close()


def test_a_nan_or_oversized_tied_message_fails_the_reduce_and_nothing_is_applied():
    pipe = LocalPipeline(CFG, 2, FP32, FP32)
    try:
        pipe.forward_backward(batch(seed=5), n_micro=2)
        to_last = as_host(pipe, (0, 0), (1, 0))
        averager = pipe.hosts[1].averager
        too_big = averager.limits.max_numel + 1
        refused(to_last.Average, tied_items(pipe, 0, 0, 0, numel=too_big), code=grpc.StatusCode.INVALID_ARGUMENT,
                words="")  # fmt: skip
        to_last.Average(tied_items(pipe, 0, 0, 0, value=float("nan")))  # held: decoded only in the sum
        before = pipe.hosts[1].worker.tied_grad()
        with pytest.raises(LocalRpcError) as e:
            trainer(pipe, 1).Reduce(tied_request(pipe, 1, 0, deadline_s=5.0))
        assert e.value.code() != grpc.StatusCode.OK
        assert torch.equal(pipe.hosts[1].worker.tied_grad(), before) and averager.groups[True].reduced is None
    finally:
        pipe.close()
