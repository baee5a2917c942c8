"""The replicas' gradient sum (Reduce, Average): exact in fp32, bit-identical on every replica with gradq, error
feedback committed only by Step, and every stranger's, duplicate, late or missing stream handled by name."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from swarm.compression import make_codec
from swarm.net.auth import Identity
from swarm.net.connect import LocalRpcError
from swarm.net.stream import tensor_items, tokens_to_wire
from swarm.proto import stage_pb2
from swarm.runtime import average
from swarm.runtime.average import EARLY_REDUCE, GradientAverager, flatten_grads
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.budget import SlotsExhausted
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.worker import StageConfig
from tests.unit.runtime.test_replica_host import FP32, GRADQ, TINY, Replicas, batch


def flat(pipe: Replicas, r: int) -> torch.Tensor:
    return flatten_grads(pipe.hosts[r].averager.params)


def test_fp32_reduce_is_exactly_the_sum_of_the_replicas_gradients():
    pipe = Replicas(3)
    pipe.split_step(0, rows=6)
    own = [flat(pipe, r) for r in range(3)]
    replies = pipe.reduce(0)
    want = own[0] + own[1] + own[2]
    for r in range(3):
        assert torch.equal(flat(pipe, r), want)
        assert replies[r].group_size == 3
        assert replies[r].fp32_wire_bytes == 2 * 4 * want.numel()
        assert 0.5 * replies[r].fp32_wire_bytes < replies[r].wire_bytes < 1.1 * replies[r].fp32_wire_bytes
    sent = sum(
        h.metrics.snapshot().get('swarm_wire_bytes_total{direction="average",link="average"}', 0) for h in pipe.hosts
    )
    assert sent == sum(r.wire_bytes for r in replies)


def test_gradq_reduce_gives_every_replica_the_same_bits_and_then_the_same_weights(monkeypatch):
    monkeypatch.setattr(GradientAverager, "sum_codec", None)  # the backward codec's sum config at min_bits
    pipe = Replicas(2, backward=GRADQ)
    pipe.split_step(0)
    own = [flat(pipe, r) for r in range(2)]
    replies = pipe.reduce(0)
    assert torch.equal(flat(pipe, 0), flat(pipe, 1))
    exact = own[0] + own[1]
    assert 0 < (flat(pipe, 0) - exact).norm() < 0.1 * exact.norm()  # quantized: close to the exact sum, not equal
    # a 4-bit backward codec still sums at GradientAverager.min_bits = 8: about a quarter of fp32's bytes
    assert replies[0].wire_bytes < replies[0].fp32_wire_bytes / 3.5
    for r in range(2):
        pipe.step(r, 0)
    digests = {pipe.client(r).Status(stage_pb2.Empty()).weights_digest for r in range(2)}
    assert len(digests) == 1


def test_error_feedback_residual_is_committed_by_step_and_dropped_by_abandon():
    pipe = Replicas(2, backward=GRADQ)
    pipe.split_step(0)
    pipe.reduce(0)
    for r in range(2):
        pipe.client(r).Step(stage_pb2.StepRequest(step=0, abandon=True))
    assert all(h.averager.residual is None for h in pipe.hosts)  # abandoned: no trace of the attempt
    pipe.split_step(1)
    pipe.reduce(1)
    assert all(h.averager.residual is None for h in pipe.hosts)  # reduced, not applied yet
    for r in range(2):
        pipe.step(r, 1)
    residuals = [h.averager.residual for h in pipe.hosts]
    assert all(res is not None and res.shape == (pipe.hosts[0].averager.numel,) for res in residuals)
    assert float(residuals[0].abs().sum()) > 0


def test_a_member_that_never_sends_fails_the_reduce_in_time_and_changes_nothing():
    pipe = Replicas(2, backward=GRADQ)
    pipe.split_step(0)
    before = flat(pipe, 0)
    (result,) = pipe.reduce(0, members=[0], deadline_s=0.3)  # replica 1 never reduces, so never sends
    assert isinstance(result, LocalRpcError) and result.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pipe.peers[1] in result.details() and "nothing was summed" in result.details()
    assert torch.equal(flat(pipe, 0), before)
    assert pipe.hosts[0].averager.residual is None and pipe.hosts[0].averager.groups[False].pending is None


def slowed(monkeypatch, seconds: float) -> None:
    """Every flatten of the sum's gradients takes `seconds` more: a CPU starved past the Reduce's deadline (the
    machine's load, made deterministic)."""
    real = average.flatten_grads

    def slow(params):
        time.sleep(seconds)
        return real(params)

    monkeypatch.setattr(average, "flatten_grads", slow)


def test_a_member_that_never_sends_is_named_even_when_the_encode_outlasts_the_deadline(monkeypatch):
    # under load the encode alone may take the whole deadline; the Reduce then failed on its send ("sending the
    # gradients to [] took too long": nobody named, nothing said about the sum): the deadline's failure is the
    # missing members', wherever the clock ran out
    pipe = Replicas(2, backward=GRADQ)
    pipe.split_step(0)
    before = flat(pipe, 0)
    slowed(monkeypatch, 0.4)
    (result,) = pipe.reduce(0, members=[0], deadline_s=0.3)
    assert isinstance(result, LocalRpcError) and result.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pipe.peers[1] in result.details() and "nothing was summed" in result.details(), result.details()
    assert torch.equal(flat(pipe, 0), before) and pipe.hosts[0].averager.groups[False].pending is None


def test_a_message_that_does_not_reach_a_member_in_time_fails_the_reduce_naming_it():
    pipe = Replicas(2, backward=GRADQ)
    pipe.split_step(0)
    before = [flat(pipe, r) for r in range(2)]
    release, entered = threading.Event(), threading.Event()
    receiving = pipe.hosts[1].averager
    real = receiving.receive

    def stuck(call, sender):  # replica 1 takes replica 0's message only once the test lets it
        entered.set()
        release.wait(30)
        return real(call, sender)

    receiving.receive = stuck
    results: list = []
    late = threading.Thread(target=lambda: results.extend(pipe.reduce(0, members=[1], deadline_s=30)))
    late.start()  # replica 1 sends its own message and waits for replica 0's
    arrived = pipe.hosts[0].averager._arrived  # replica 0's inbox is notified on replica 0's condition
    with arrived:
        assert arrived.wait_for(lambda: pipe.hosts[0].averager.groups[False].inbox, timeout=30)
    try:
        (result,) = pipe.reduce(0, members=[0], deadline_s=0.5)
        assert entered.is_set()
    finally:
        release.set()
    late.join(30)
    assert isinstance(result, LocalRpcError) and result.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"did not reach {pipe.peers[1]}" in result.details() and "nothing was summed" in result.details()
    assert pipe.peers[1] + " sent no" not in result.details()  # its message was in: only the send was late
    assert torch.equal(flat(pipe, 0), before[0]) and pipe.hosts[0].averager.groups[False].pending is None


def test_a_second_reduce_of_a_step_is_refused_and_sums_nothing_twice():
    pipe = Replicas(2)
    pipe.split_step(0)
    pipe.reduce(0)
    summed = flat(pipe, 0)
    again = pipe.reduce(0)
    assert all(isinstance(e, LocalRpcError) and "already reduced" in e.details() for e in again)
    assert torch.equal(flat(pipe, 0), summed)


def test_reduce_before_the_steps_backward_or_of_a_group_of_one():
    pipe = Replicas(2)
    started = time.monotonic()
    (early,) = pipe.reduce(0, members=[0], deadline_s=0.3)  # waits for the step's backwards as long as its deadline
    assert isinstance(early, LocalRpcError) and early.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert EARLY_REDUCE in early.details() and time.monotonic() - started >= 0.3
    pipe.split_step(0)
    alone = stage_pb2.ReduceRequest(step=0, stage=0, group_peers=[pipe.peers[0]], group_addresses=[pipe.addresses[0]])
    before = flat(pipe, 0)
    reply = pipe.client(0).Reduce(alone)
    assert (reply.group_size, reply.wire_bytes) == (1, 0) and torch.equal(flat(pipe, 0), before)


def _entered(pipe: Replicas, monkeypatch) -> list[threading.Event]:
    """One event per replica, set when a Reduce there begins its wait for the step's backwards."""
    events = [threading.Event() for _ in pipe.hosts]
    for host, event in zip(pipe.hosts, events, strict=True):
        real = host.await_backwards

        def waiting(*args, real=real, event=event):
            event.set()
            return real(*args)

        monkeypatch.setattr(host, "await_backwards", waiting)
    return events


def test_a_reduce_sent_before_the_backwards_waits_for_them_and_sums_what_they_left(monkeypatch):
    reference = Replicas(2)
    reference.split_step(0)
    reference.reduce(0)
    pipe = Replicas(2)
    entered = _entered(pipe, monkeypatch)
    early: list = []
    thread = threading.Thread(target=lambda: early.extend(pipe.reduce(0, deadline_s=30)))
    thread.start()
    assert all(e.wait(30) for e in entered)  # both Reduces are in before any of the step's work
    assert thread.is_alive() and not early
    # the step as `split_step` runs it, each replica's forward before either's backward: a replica's sum reaches
    # the other once the step is open there (a trainer sends Reduce early on one route only, where it always is)
    tokens, targets = batch(6, 0)
    parts, infos = torch.arange(6).tensor_split(2), [pipe.info(r, 0, loss_weight=0.5) for r in range(2)]
    for r, idx in enumerate(parts):
        pipe.client(r).PutLabels(stage_pb2.LabelsRequest(info=infos[r], labels=tokens_to_wire(targets[idx])))
        item = stage_pb2.StreamItem(info=infos[r], tokens=tokens_to_wire(tokens[idx], torch.arange(3)))
        pipe.client(r).Forward(iter([item.SerializeToString()]))
    for r in range(2):
        pipe.client(r).Backward(iter([stage_pb2.StreamItem(info=infos[r]).SerializeToString()]))
    thread.join(30)
    assert not thread.is_alive() and all(r.group_size == 2 for r in early), early
    assert torch.equal(flat(pipe, 0), flat(reference, 0)) and torch.equal(flat(pipe, 1), flat(reference, 1))


def test_an_early_reduce_ends_when_its_attempt_is_abandoned(monkeypatch):
    pipe = Replicas(2)
    entered = _entered(pipe, monkeypatch)
    waiting: list = []
    thread = threading.Thread(target=lambda: waiting.extend(pipe.reduce(0, members=[0], deadline_s=30, attempt_id=7)))
    thread.start()
    assert entered[0].wait(30)
    started = time.monotonic()
    pipe.client(0).Step(stage_pb2.StepRequest(step=0, abandon=True, attempt_id=7))
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - started < 10, "the wait ran on to its deadline"
    assert isinstance(waiting[0], LocalRpcError) and "that attempt of step 0 was abandoned" in waiting[0].details()
    pipe.split_step(0)  # the next attempt runs as if nothing had waited
    assert not any(isinstance(r, LocalRpcError) for r in pipe.reduce(0, attempt_id=8))


def test_at_most_two_reduces_wait_for_a_steps_backwards_and_a_third_is_refused_at_once(monkeypatch):
    """A flood of early Reduces (only the plan's trainer may send them) parks two server threads, not more."""
    pipe = Replicas(2)
    host, lock, entered = pipe.hosts[0], threading.Lock(), []
    real = host.await_backwards

    def counted(*args):
        with lock:
            entered.append(args)
        return real(*args)

    monkeypatch.setattr(host, "await_backwards", counted)
    waiting: list = []
    threads = [
        threading.Thread(target=lambda a=a: waiting.extend(pipe.reduce(0, members=[0], deadline_s=30, attempt_id=a)))
        for a in (7, 8)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(entered) < 2:  # both hold a slot: they took it before they began to wait
        assert time.monotonic() < deadline, "the two Reduces did not both wait"
        time.sleep(0.005)
    started = time.monotonic()
    (third,) = pipe.reduce(0, members=[0], deadline_s=30, attempt_id=9)
    assert isinstance(third, LocalRpcError) and third.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, third
    assert time.monotonic() - started < 10 and len(entered) == 2
    for a in (7, 8):
        pipe.client(0).Step(stage_pb2.StepRequest(step=0, abandon=True, attempt_id=a))
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and len(waiting) == 2


def test_an_average_refused_for_want_of_a_data_slot_is_sent_again_within_the_deadline(monkeypatch):
    """A member whose data slots are full (its step's last calls, where a Reduce left with the pipeline) refuses
    an Average with RESOURCE_EXHAUSTED: the sender tries again shortly, and the sum completes."""
    pipe = Replicas(2)
    pipe.split_step(0)
    busy = pipe.network._servicers[pipe.addresses[1]]
    real, refusals = busy._data_slot, []

    def full(caller):
        if len(refusals) < 3:
            refusals.append(caller)
            raise SlotsExhausted("24 data calls are being served already; retry later")
        return real(caller)

    monkeypatch.setattr(busy, "_data_slot", full)
    replies = pipe.reduce(0, deadline_s=30)
    assert all(not isinstance(r, LocalRpcError) and r.group_size == 2 for r in replies), replies
    assert refusals == [pipe.peers[0]] * 3 and torch.equal(flat(pipe, 0), flat(pipe, 1))


def test_an_average_refused_for_want_of_a_data_slot_until_the_deadline_fails_the_reduce_by_name(monkeypatch):
    pipe = Replicas(2)
    pipe.split_step(0)
    busy = pipe.network._servicers[pipe.addresses[1]]

    def full(caller):
        raise SlotsExhausted("24 data calls are being served already; retry later")

    monkeypatch.setattr(busy, "_data_slot", full)
    started = time.monotonic()
    (first, _) = pipe.reduce(0, deadline_s=1.0)
    assert isinstance(first, LocalRpcError) and time.monotonic() - started < 10
    # its last refusal is named whether it came before the Reduce's wait for the sends ended or after (a loaded
    # machine: the send's thread still retrying when the clock ran out)
    assert pipe.peers[1] in first.details() and "data calls" in first.details(), first.details()


def average_items(
    pipe: Replicas, sender: int, step: int, pulled: list | None = None, numel: int | None = None, attempt_id: int = 0
):
    """An Average stream as replica `sender` would send it (fp32), counting the items pulled."""
    numel = numel or pipe.hosts[0].averager.numel
    msg = make_codec(FP32).encode(torch.ones(numel))
    info = stage_pb2.CallInfo(
        step=step, stage=0, micro_batch=sender, num_micro_batches=len(pipe.hosts), attempt_id=attempt_id
    )
    for item in tensor_items(info, msg, 0, None):
        if pulled is not None:
            pulled.append(1)
        yield item


def refused(fn, *args, code: grpc.StatusCode, words: str):
    with pytest.raises(LocalRpcError) as e:
        fn(*args)
    assert e.value.code() == code and words in e.value.details(), e.value.details()


def test_strangers_average_and_reduce_are_refused_before_the_body_is_read():
    pipe = Replicas(2)
    pipe.split_step(0)
    pulled: list = []
    anonymous = pipe.network.stage(pipe.addresses[0])
    refused(anonymous.Average, average_items(pipe, 1, 0, pulled), code=grpc.StatusCode.UNAUTHENTICATED, words="token")
    stranger = pipe.client(0, Identity.generate())
    refused(
        stranger.Average, average_items(pipe, 1, 0, pulled), code=grpc.StatusCode.PERMISSION_DENIED, words="Average"
    )
    # refused from the metadata: the stage read nothing (the stranger's own client took its first item to sign
    # it; the anonymous one took none)
    assert pulled == [1]
    request = stage_pb2.ReduceRequest(step=0, stage=0, group_peers=pipe.peers, group_addresses=pipe.addresses)
    refused(stranger.Reduce, request, code=grpc.StatusCode.PERMISSION_DENIED, words="Reduce only from a trainer")
    replica = pipe.client(0, pipe_identity(pipe, 1))
    refused(replica.Reduce, request, code=grpc.StatusCode.PERMISSION_DENIED, words="Reduce only from a trainer")
    evil = stage_pb2.ReduceRequest(
        step=0, stage=0, group_peers=pipe.peers, group_addresses=[pipe.addresses[0], "evil:1"]
    )
    refused(pipe.client(0).Reduce, evil, code=grpc.StatusCode.PERMISSION_DENIED, words="plan addresses")
    assert pipe.hosts[0].averager.groups[False].inbox == {}


def pipe_identity(pipe: Replicas, r: int) -> Identity:
    """Replica r's identity, as its own connector signs with it."""
    return pipe.ids[r]


def test_a_duplicate_late_or_oversized_average_is_refused():
    pipe = Replicas(2)
    pipe.split_step(0)
    from_1 = pipe.client(0, pipe_identity(pipe, 1))
    from_1.Average(average_items(pipe, 1, 0))
    refused(from_1.Average, average_items(pipe, 1, 0), code=grpc.StatusCode.ALREADY_EXISTS, words="sent its gradients")
    refused(from_1.Average, average_items(pipe, 1, 5), code=grpc.StatusCode.FAILED_PRECONDITION, words="open step")
    pulled: list = []
    big = average_items(pipe, 1, 0, pulled, numel=pipe.hosts[0].averager.numel * 4)
    refused(pipe.client(1, pipe_identity(pipe, 0)).Average, big, code=grpc.StatusCode.INVALID_ARGUMENT, words="")
    assert len(pulled) <= 2  # the header's declared size is refused before the body
    pipe.client(0).Step(stage_pb2.StepRequest(step=0, abandon=True))
    refused(from_1.Average, average_items(pipe, 1, 0), code=grpc.StatusCode.FAILED_PRECONDITION, words="open step")


def test_a_late_average_of_an_abandoned_attempt_is_refused_in_the_rerun_of_its_step():
    """CI's failure: attempt 1 of step 0 was abandoned, the rerun opened step 0 again on this replica, and attempt
    1's late Average landed in the rerun's inbox, so the rerun's own Average from that sender was refused as a
    second one ("sent its gradients for step 0") and the step failed. The Average carries its attempt now."""
    pipe = Replicas(2)
    pipe.split_step(0)
    for r in range(2):
        pipe.client(r).Step(stage_pb2.StepRequest(step=0, abandon=True, attempt_id=7))
    pipe.split_step(0)  # the rerun opens step 0 again
    from_1 = pipe.client(0, pipe_identity(pipe, 1))
    refused(
        from_1.Average,
        average_items(pipe, 1, 0, attempt_id=7),
        code=grpc.StatusCode.FAILED_PRECONDITION,
        words="that attempt of step 0 was abandoned",
    )
    from_1.Average(average_items(pipe, 1, 0, attempt_id=8))  # the rerun's own, from the same sender
    refused(
        from_1.Average,
        average_items(pipe, 1, 0, attempt_id=8),
        code=grpc.StatusCode.ALREADY_EXISTS,
        words="sent its gradients",
    )


def test_a_late_reduce_of_an_abandoned_attempt_commits_nothing_in_the_rerun_of_its_step():
    """CI's failure (test_entry_audit, a liar evicted at step 0): attempt 7's Reduce on a replica was still decoding
    when the trainer abandoned the attempt and the rerun opened step 0 there again; the late Reduce found step 0
    open and marked it reduced, so the rerun's sums with that replica were refused ("step 0 is reduced already")."""
    pipe = Replicas(2)
    pipe.split_step(0)
    slow = pipe.hosts[0].averager
    real = slow._decode_all
    entered, release = threading.Event(), threading.Event()

    def held(*args):
        entered.set()
        release.wait(30)
        return real(*args)

    slow._decode_all = held
    late: list = []
    thread = threading.Thread(target=lambda: late.extend(pipe.reduce(0, attempt_id=7)))
    thread.start()
    try:
        assert entered.wait(30)  # replica 0 holds every message of attempt 7 and has not summed them yet
        for r in range(2):
            pipe.client(r).Step(stage_pb2.StepRequest(step=0, abandon=True, attempt_id=7))
        pipe.split_step(0, seed=1)  # the rerun opens step 0 again on both
    finally:
        release.set()
        thread.join(30)
    assert not thread.is_alive()
    assert isinstance(late[0], LocalRpcError) and late[0].code() == grpc.StatusCode.ABORTED, late[0]
    assert "ended while it was being reduced" in late[0].details()
    slow._decode_all = real
    rerun = pipe.reduce(0, attempt_id=8)
    assert not any(isinstance(r, LocalRpcError) for r in rerun), rerun
    assert torch.equal(flat(pipe, 0), flat(pipe, 1))
    refused(
        pipe.client(0).Reduce,
        stage_pb2.ReduceRequest(step=0, stage=0, group_peers=list(pipe.peers), group_addresses=list(pipe.addresses),
                                attempt_id=7),
        code=grpc.StatusCode.FAILED_PRECONDITION,
        words="that attempt of step 0 was abandoned",
    )  # fmt: skip


def test_the_tied_weight_is_left_to_grads_on_a_multi_stage_host():
    role = StageRole(0, 2, 0, 1)
    host = StageHost(role, TINY, StageConfig(), LinkEnds(FP32, FP32), "p", None)
    tied = host.worker.module.tied_parameter()
    assert tied is not None and all(p is not tied for p in host.averager.params)
    assert host.averager.numel == sum(p.numel() for p in host.worker.module.parameters()) - tied.numel()


def test_a_waiting_reduce_holds_one_slot_and_leaves_status_and_step_free(monkeypatch):
    import swarm.runtime.service as service

    monkeypatch.setattr(service, "REDUCE_SLOT_WAIT_S", 0.5)  # how long the second waits for the slot, then refused
    pipe = Replicas(2)
    pipe.split_step(0)
    first: list = []
    waiting = threading.Thread(target=lambda: first.extend(pipe.reduce(0, members=[0], deadline_s=30)))
    waiting.start()
    inbox = pipe.hosts[1].averager
    with inbox._arrived:  # replica 0 sent its gradients: it now waits for replica 1's
        assert inbox._arrived.wait_for(lambda: inbox.groups[False].inbox, timeout=30)
    (second,) = pipe.reduce(0, members=[0])
    assert isinstance(second, LocalRpcError) and second.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert pipe.client(0).Status(stage_pb2.Empty()).stage == 0  # control calls still answered
    refused(pipe.client(0).Step, stage_pb2.StepRequest(step=1), code=grpc.StatusCode.FAILED_PRECONDITION, words="")
    (late,) = pipe.reduce(0, members=[1])  # replica 1 joins: both sums complete
    waiting.join(30)
    assert not waiting.is_alive() and late.group_size == 2 and first[0].group_size == 2
    assert torch.equal(flat(pipe, 0), flat(pipe, 1))
    refused(
        pipe.client(0, pipe_identity(pipe, 1)).Average, average_items(pipe, 1, 0),
        code=grpc.StatusCode.FAILED_PRECONDITION, words="reduced already",
    )  # fmt: skip


def test_an_unreachable_member_fails_the_reduce_by_name():
    pipe = Replicas(2)
    pipe.split_step(0)
    before = flat(pipe, 0)
    pipe.network.unregister(pipe.addresses[1])  # as a killed peer: every connector sees it gone
    (result,) = pipe.reduce(0, members=[0], deadline_s=5)
    assert isinstance(result, LocalRpcError) and result.code() == grpc.StatusCode.UNAVAILABLE
    assert pipe.peers[1] in result.details()
    assert torch.equal(flat(pipe, 0), before) and pipe.hosts[0].averager.groups[False].pending is None


def test_a_sender_that_dies_halfway_leaves_nothing_held_and_may_send_again():
    pipe = Replicas(2)
    pipe.split_step(0)
    items = list(average_items(pipe, 1, 0))
    last = stage_pb2.StreamItem.FromString(items[-1])
    last.chunk.data = last.chunk.data[: len(last.chunk.data) // 2]  # the stream ends mid-body: its sender died
    from_1 = pipe.client(0, pipe_identity(pipe, 1))
    refused(from_1.Average, iter([*items[:-1], last.SerializeToString()]), code=grpc.StatusCode.INVALID_ARGUMENT,
            words="")  # fmt: skip
    assert pipe.hosts[0].averager.groups[False].inbox == {} or pipe.hosts[0].averager.groups[False].inbox_step != 0
    from_1.Average(iter(items))  # the whole stream again (its sender came back): taken, not a duplicate
    assert set(pipe.hosts[0].averager.groups[False].inbox) == {pipe.ids[1].peer_id}


def scale_grads(pipe: Replicas, r: int, factor: float) -> None:
    for p in pipe.hosts[r].averager.params:
        if p.grad is not None:
            p.grad.mul_(factor)


def summed_steps(pipe: Replicas, steps: range, factors: dict[int, float] | None = None) -> None:
    for step in steps:
        pipe.split_step(step, seed=step)
        for r, factor in (factors or {}).items():
            scale_grads(pipe, r, factor)
        replies = pipe.reduce(step)
        assert not [e for e in replies if isinstance(e, LocalRpcError)], f"step {step}: {replies}"
        for r in range(len(pipe.hosts)):
            pipe.step(r, step)


def test_an_honest_sibling_is_summed_when_this_replicas_own_gradients_are_near_zero_for_a_step():
    """A model that fits its data: one replica's micro-batches of a step give a gradient 1e4 x smaller than its
    sibling's, honestly. Held to that step's own norm, the sibling's was refused as 64x out of proportion, and the
    refuser struck until evicted (two honest peers so, in a suite run); held to its recent largest, it is summed."""
    pipe = Replicas(2)
    summed_steps(pipe, range(3))
    pipe.split_step(3, seed=3)
    scale_grads(pipe, 0, 1e-4)
    own = [flat(pipe, r) for r in range(2)]
    assert own[1].norm() > 64 * own[0].norm()  # what the old rule refused
    replies = pipe.reduce(3)
    assert not [e for e in replies if isinstance(e, LocalRpcError)], replies
    assert torch.equal(flat(pipe, 0), flat(pipe, 1)) and torch.equal(flat(pipe, 0), own[0] + own[1])


def test_a_members_accepted_messages_never_raise_the_bound_its_sibling_holds_it_to():
    """A liar accepted at 50x its sibling's norm step after step cannot ramp up: the bound is the receiver's own
    messages' largest, so 50 x 50 is refused by name, nothing summed; and a huge message at once is refused too."""
    pipe = Replicas(2)
    summed_steps(pipe, range(2))
    summed_steps(pipe, range(2, 8), {1: 50.0})  # within 64x: summed (the norm rule is a bound, not a detector)
    pipe.split_step(8, seed=8)
    scale_grads(pipe, 1, 2500.0)
    before = flat(pipe, 0)
    result = pipe.reduce(8)[0]
    assert isinstance(result, LocalRpcError) and result.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pipe.peers[1] in result.details() and "more than 64x" in result.details(), result.details()
    assert torch.equal(flat(pipe, 0), before)  # nothing summed


def test_a_reduce_waiting_on_a_silent_member_ends_when_its_attempt_is_abandoned_even_if_the_step_reopened():
    """A suite run of test_verify: a liar's eviction abandoned attempt 1 while its Reduce on the honest replica
    waited for the liar's gradients; the abandon's wake-up came before the step was closed and the rerun opened
    step 0 again, so the wait (judged by the open step) went on to its deadline holding the stage's one Reduce
    slot, and the rerun's Reduce there was refused as busy. Here that interleaving is pinned: the attempt is
    marked abandoned and the waiters woken while step 0 stays open (as the rerun leaves it)."""
    pipe = Replicas(2)
    pipe.split_step(0)
    waiting: list = []
    thread = threading.Thread(target=lambda: waiting.extend(pipe.reduce(0, members=[0], deadline_s=30, attempt_id=7)))
    thread.start()
    inbox, host = pipe.hosts[1].averager, pipe.hosts[0]
    with inbox._arrived:  # replica 0 sent its gradients: it now waits for replica 1's, which never come
        assert inbox._arrived.wait_for(lambda: inbox.groups[False].inbox, timeout=30)
    started = time.monotonic()
    with host.compute_lock:
        host.ledger.abandoned(0, 7)  # what Step(abandon, attempt 7) records first
        host.averager.end_step()  # its wake-up; the step's close is what the rerun's reopen undoes
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - started < 10, "the wait ran on to its deadline"
    assert isinstance(waiting[0], LocalRpcError) and waiting[0].code() == grpc.StatusCode.ABORTED, waiting[0]
    assert host.open_step == 0  # the step stayed open throughout (the rerun's)


def test_a_member_refused_until_the_clock_ran_out_is_named_with_its_refusal_even_when_the_send_outlives_the_wait(
    monkeypatch,
):
    """The Reduce's wait for its sends ends at the deadline; a send still in its last refused try then (a loaded
    machine) has recorded no error, and the failure is the deadline's: it still says why that member was not reached."""
    pipe = Replicas(2)
    pipe.split_step(0)
    busy = pipe.network._servicers[pipe.addresses[1]]
    tries, released = [], threading.Event()

    def full(caller):
        tries.append(caller)
        if len(tries) > 1:  # the next try outlives the Reduce's deadline
            released.wait(30)
        raise SlotsExhausted("24 data calls are being served already; retry later")

    monkeypatch.setattr(busy, "_data_slot", full)
    try:
        (first, _) = pipe.reduce(0, deadline_s=1.0)
    finally:
        released.set()
    assert isinstance(first, LocalRpcError) and "within the Reduce's deadline" in first.details(), first.details()
    assert f"did not reach {pipe.peers[1]} (refused until the deadline: 24 data calls" in first.details()
