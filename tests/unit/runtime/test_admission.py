"""Wedges and budgets: a bad call is refused by name before it changes anything, and never holds the stage.

The stages are the swarm's hosts and servicers on an in-process `LocalNetwork` (the same servicer code a
gRPC server runs), so each case is a few calls and the next legitimate step is checked after it.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, LinkState, make_codec
from swarm.compression.framing import frame_parts
from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig, split_layers
from swarm.net.connect import LocalNetwork, LocalRpcError
from swarm.net.stream import serialize_chunk_item, tensor_items, tokens_to_wire
from swarm.proto import stage_pb2
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.budget import StageBudget
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig

TINY = ModelConfig(vocab_size=256, seq_len_tokens=16, hidden_dim=32, n_layers=3, n_heads=2)
FP32 = CodecConfig("fp32")


class Stages:
    """n in-process stages with a budget, a driver for legitimate steps, and raw clients for hostile calls."""

    def __init__(self, n: int, budget: StageBudget, fw: CodecConfig = FP32, schedule: str = "gpipe"):
        self.network = LocalNetwork()
        self.addresses = [f"local:{s}" for s in range(n)]
        self.peers = [f"peer{s}" for s in range(n)]
        self.hosts, self.servicers = [], []
        for stage, (start, end) in enumerate(split_layers(TINY.n_layers, n)):
            role = StageRole(stage, n, start, end)
            host = StageHost(
                role, TINY, StageConfig(), LinkEnds(fw, FP32), self.peers[stage], self.network, budget=budget
            )
            servicer = StageServicer(host)
            self.network.register(self.addresses[stage], servicer)
            self.hosts.append(host)
            self.servicers.append(servicer)
        self.schedule = schedule
        self.driver = PipelineDriver(self.addresses, self.peers, schedule, 2, deadline_s=30, connector=self.network)
        self.next_step = 0

    def client(self, stage: int):
        return self.network.stage(self.addresses[stage])

    def info(self, stage: int, step: int = 0, mb: int = 0, n_micro: int = 2, **kw) -> stage_pb2.CallInfo:
        return stage_pb2.CallInfo(
            step=step,
            micro_batch=mb,
            stage=stage,
            num_micro_batches=n_micro,
            schedule=self.schedule,
            route=self.addresses,
            route_peers=self.peers,
            deadline_s=kw.pop("deadline_s", 30),
            **kw,
        )

    def legit_step(self) -> float:
        gen = torch.Generator().manual_seed(self.next_step)
        w = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len_tokens + 1), generator=gen)
        batch = Batch(torch.arange(4), w[:, :-1], w[:, 1:])
        result = self.driver.train_step(self.next_step, batch)
        self.next_step += 1
        return result.loss


def refused(call, *args, code=None, words=()):
    with pytest.raises(LocalRpcError) as err:
        call(*args)
    if code is not None:
        assert err.value.code() == code, err.value.details()
    for w in words:
        assert w in err.value.details(), err.value.details()
    return err.value


def activation_items(info, tensor, sample_ids=None, codec=FP32, chunk_bytes=None):
    msg = make_codec(codec).encode(tensor, sample_ids=sample_ids)
    if chunk_bytes is None:
        return list(tensor_items(info, msg, 0, None))
    parts = frame_parts(msg, zstd_level=0, chunk_bytes=chunk_bytes)
    return [serialize_chunk_item(data, info if header else None, header) for header, data in parts]


def test_a_call_failing_after_admission_leaves_no_step_open():
    """Today's wedge: a call that passed the step check and then failed left its step open, and the next
    legitimate step was refused ("step N arrived while step M is unfinished")."""
    s = Stages(3, StageBudget())
    msg = make_codec(FP32).encode(torch.randn(2, 16, 32))
    values = torch.randn(2, 16, 32)
    values[0, 0, 0] = float("nan")
    msg.raw = values.numpy().tobytes()  # passes every check on the way in; decoding finds the NaN
    items = list(tensor_items(s.info(1, step=7), msg, 0, None))
    refused(s.client(1).Forward, items, code=grpc.StatusCode.INVALID_ARGUMENT, words=["NaN"])
    assert s.hosts[1].open_step is None
    assert s.legit_step() > 0


def test_every_check_runs_before_the_stream_is_read():
    s = Stages(2, StageBudget())
    pulled = []

    def stream():
        info = s.info(1, plan_version=9)
        for i, item in enumerate(activation_items(info, torch.randn(2, 16, 32), [0, 1])):
            pulled.append(i)
            yield item
        raise AssertionError("the stage read past the first item of a call it refuses")

    refused(s.client(1).Forward, stream(), code=grpc.StatusCode.FAILED_PRECONDITION, words=["plan 9"])
    assert pulled == [0]


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("micro_batch", 5, ["micro_batch"]),
        ("num_micro_batches", 1 << 20, ["num_micro_batches"]),
        ("schedule", "nonsense", ["schedule"]),
    ],
)
def test_call_info_out_of_bounds_is_refused_by_name(field, value, words):
    s = Stages(2, StageBudget(max_micro_batches=8))
    info = s.info(1)
    setattr(info, field, value)
    refused(s.client(1).Forward, activation_items(info, torch.randn(2, 16, 32), [0, 1]), words=words)
    assert s.hosts[1].open_step is None
    assert s.legit_step() > 0


def test_a_batch_past_the_budget_is_refused_before_decoding():
    s = Stages(2, StageBudget(max_batch=8))
    tokens = tokens_to_wire(torch.zeros(9, 16, dtype=torch.long))
    item = stage_pb2.StreamItem(info=s.info(0), tokens=tokens).SerializeToString()
    refused(s.client(0).Forward, [item], code=grpc.StatusCode.INVALID_ARGUMENT, words=["tokens.shape", "budget"])
    # a 9-row activation is past the message bounds the budget derives (refused from the frame header)
    refused(s.client(1).Forward, activation_items(s.info(1), torch.randn(9, 16, 32), list(range(9))))
    labels = stage_pb2.LabelsRequest(info=s.info(1), labels=tokens)
    refused(s.client(1).PutLabels, labels, words=["labels.shape", "budget"])
    assert [h.open_step for h in s.hosts] == [None, None]
    assert s.legit_step() > 0


def test_labels_are_held_for_the_open_step_only():
    s = Stages(2, StageBudget())
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    s.client(1).PutLabels(stage_pb2.LabelsRequest(info=s.info(1, step=0), labels=labels))
    future = stage_pb2.LabelsRequest(info=s.info(1, step=5), labels=labels)
    refused(s.client(1).PutLabels, future, code=grpc.StatusCode.FAILED_PRECONDITION, words=["unfinished"])
    assert list(s.hosts[1].labels) == [0]
    assert s.legit_step() > 0  # step 0: the labels above are replaced by the driver's
    assert s.hosts[1].labels == {}


def test_a_stale_step_gives_way_and_a_fresh_one_does_not():
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    fresh = Stages(2, StageBudget())
    fresh.client(1).PutLabels(stage_pb2.LabelsRequest(info=fresh.info(1, step=50), labels=labels))
    with pytest.raises(Exception, match="unfinished"):
        fresh.legit_step()
    stale = Stages(2, StageBudget(stale_step_s=1e-9))  # every idle step is stale at once
    stale.client(1).PutLabels(stage_pb2.LabelsRequest(info=stale.info(1, step=50), labels=labels))
    assert stale.legit_step() > 0


def test_the_trainer_that_opened_a_step_may_move_on_and_no_one_else():
    """A trainer runs one step at a time: its call for another step means it gave the open one up."""
    s = Stages(2, StageBudget())
    host = s.hosts[1]
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    host.admit(None, s.info(1, step=3), None, caller="trainer-a")
    host.put_labels(s.info(1, step=3), host.check_labels(s.info(1, step=3), labels))
    host.leave()
    with pytest.raises(Exception, match="unfinished"):
        host.check_call(s.info(1, step=4), caller="stranger")
    host.admit(None, s.info(1, step=4), None, caller="trainer-a")
    assert host.open_step == 4 and host.labels == {}
    host.leave()


def test_abandon_names_the_step_it_drops():
    s = Stages(2, StageBudget())
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    s.client(1).PutLabels(stage_pb2.LabelsRequest(info=s.info(1, step=0), labels=labels))
    refused(s.client(1).Step, stage_pb2.StepRequest(step=5, abandon=True), words=["not open"])
    assert s.hosts[1].open_step == 0
    s.client(1).Step(stage_pb2.StepRequest(step=0, abandon=True))
    assert s.hosts[1].open_step is None


def test_a_refused_call_moves_no_aqsgd_state():
    """Today 163840 first sights entered the AQ-SGD store although the schedule refused the calls after."""
    aq = CodecConfig.parse("aqsgd2")
    s = Stages(3, StageBudget(), fw=aq)
    assert s.legit_step() > 0
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len_tokens + 1), generator=gen)
    s.driver.forward_backward(1, Batch(torch.arange(4), w[:, :-1], w[:, 1:]))  # step 1 open, all of it ran
    store = s.hosts[1].links.forward_recv.buffers
    before = (len(store), store.ids())
    # forward 0 of step 1 again, with 100 samples never seen: all would be first sights
    msg = make_codec(aq).encode(torch.randn(100, 16, 32), sample_ids=list(range(1000, 1100)), state=LinkState(aq))
    items = list(tensor_items(s.info(1, step=1, mb=0), msg, 0, None))
    refused(s.client(1).Forward, items, code=grpc.StatusCode.ABORTED, words=["ran already"])
    assert (len(store), store.ids()) == before
    s.driver.abandon(1)
    s.next_step = 2
    assert s.legit_step() > 0


def test_waits_are_capped_whatever_deadline_the_caller_asks():
    s = Stages(2, StageBudget(max_wait_s=0.2))
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    info = s.info(1, step=0, mb=1, deadline_s=1e6)  # gpipe: forward 1 waits for forward 0, which never comes
    s.client(1).PutLabels(stage_pb2.LabelsRequest(info=info, labels=labels))
    refused(s.client(1).Forward, activation_items(info, torch.randn(2, 16, 32), [0, 1]), words=["waited 0.2 s"])


def test_data_calls_past_their_slots_are_refused_and_control_calls_still_answer():
    s = Stages(2, StageBudget(data_calls=2, max_wait_s=60))
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    info = s.info(1, step=0, mb=1)
    s.client(1).PutLabels(stage_pb2.LabelsRequest(info=info, labels=labels))
    errors = []

    def park(mb):  # forward 1 (twice: the second is refused as running) waits for forward 0 in the gate
        try:
            s.client(1).Forward(activation_items(s.info(1, step=0, mb=mb), torch.randn(2, 16, 32), [0, 1]))
        except LocalRpcError as e:
            errors.append(e.details())

    host = s.hosts[1]
    parked = [threading.Thread(target=park, args=(1,))]
    parked[0].start()
    with host.gate._cond:  # until the first call waits in the gate
        host.gate._cond.wait_for(lambda: host.gate._step == 0, timeout=10)
    # the second slot: a PutLabels held open by the admission lock is hard to park; take it directly
    with s.servicers[1]._data_slots.take():
        refused(
            s.client(1).Forward,
            activation_items(s.info(1, step=0, mb=0), torch.randn(2, 16, 32), [0, 1]),
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            words=["data calls"],
        )
        assert s.client(1).Status(stage_pb2.Empty()).stage == 1
        assert len(s.client(1).Probe(stage_pb2.ProbeRequest(reply_bytes=100)).payload) == 100
        s.client(1).Step(stage_pb2.StepRequest(step=0, abandon=True))  # frees the parked call
    parked[0].join(timeout=10)
    assert not parked[0].is_alive() and "abandoned" in errors[0]
    assert s.legit_step() > 0


def test_probe_and_sink_cost_what_the_budget_allows():
    s = Stages(2, StageBudget(max_sink_bytes=1 << 20))
    refused(s.client(0).Probe, stage_pb2.ProbeRequest(reply_bytes=8 << 20), words=["reply_bytes"])
    small = activation_items(stage_pb2.CallInfo(), torch.randn(1000), None)
    assert s.client(0).Sink(small).wire_bytes > 4000
    big = activation_items(stage_pb2.CallInfo(), torch.randn(1 << 19), None)  # 2 MiB
    refused(s.client(0).Sink, big, code=grpc.StatusCode.INVALID_ARGUMENT, words=["limit"])


def test_large_streams_past_their_slots_are_refused_before_their_body_is_read():
    s = Stages(2, StageBudget(large_streams=1, large_stream_bytes=1024, max_wait_s=1.0))
    pulled = []

    def stream():
        for i, item in enumerate(activation_items(s.info(1), torch.randn(2, 16, 32), [0, 1], chunk_bytes=1024)):
            pulled.append(i)
            yield item

    with s.servicers[1]._large_slots.take():  # another large stream is being read, for longer than max_wait_s
        refused(s.client(1).Forward, stream(), code=grpc.StatusCode.RESOURCE_EXHAUSTED, words=["large stream"])
    assert pulled == [0]
    assert s.legit_step() > 0  # its 4 KiB activations take the slot one at a time


def test_step_numbers_are_bounded():
    s = Stages(2, StageBudget())
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    far = stage_pb2.LabelsRequest(info=s.info(1, step=1 << 62), labels=labels)
    refused(s.client(1).PutLabels, far, code=grpc.StatusCode.INVALID_ARGUMENT, words=["step"])
    assert s.hosts[1].open_step is None


class _Context:
    """A servicer context whose caller can vanish: `vanish()` runs what gRPC runs when a call ends early."""

    def __init__(self):
        self.callbacks = []

    def invocation_metadata(self):
        return ()

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def abort(self, code, details):
        raise LocalRpcError(code, details)

    def vanish(self) -> None:
        for callback in self.callbacks:
            callback()


def test_a_call_whose_caller_vanished_stops_waiting_and_frees_its_slot():
    s = Stages(2, StageBudget(data_calls=1, max_wait_s=60))
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    s.client(1).PutLabels(stage_pb2.LabelsRequest(info=s.info(1, step=0, mb=1), labels=labels))
    context, errors = _Context(), []
    items = activation_items(s.info(1, step=0, mb=1), torch.randn(2, 16, 32), [0, 1])
    parsed = [stage_pb2.StreamItem.FromString(i) for i in items]

    def park():  # forward 1 waits for forward 0, which never comes
        try:
            s.servicers[1].Forward(iter(parsed), context)
        except LocalRpcError as e:
            errors.append(e.details())

    host = s.hosts[1]
    waiting = threading.Thread(target=park)
    waiting.start()
    with host.gate._cond:
        assert host.gate._cond.wait_for(lambda: host.gate._step == 0, timeout=10)
    context.vanish()
    waiting.join(timeout=10)
    assert not waiting.is_alive() and "gave up" in errors[0]
    with s.servicers[1]._data_slots.take():  # its slot is free again
        pass
    assert host.ledger.inflight == 0


def test_a_plan_change_abandons_an_orphaned_step_at_once_and_waits_for_a_live_one():
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    orphans = Stages(2, StageBudget(orphan_step_s=1e-9))  # no call in flight: orphaned at once
    orphans.client(1).PutLabels(stage_pb2.LabelsRequest(info=orphans.info(1, step=0), labels=labels))
    started = time.monotonic()
    assert orphans.servicers[1].swap(None, timeout_s=60, plan_version=1) is False  # abandoned, not waited for
    assert time.monotonic() - started < 30 and orphans.hosts[1].open_step is None
    live = Stages(2, StageBudget(orphan_step_s=60.0))  # its trainer called a moment ago: not orphaned
    live.client(1).PutLabels(stage_pb2.LabelsRequest(info=live.info(1, step=0), labels=labels))
    assert live.servicers[1].swap(None, timeout_s=0.2, plan_version=1) is False  # waited the whole timeout
    assert live.hosts[1].open_step is None


class _Waiting:
    """Runs a Forward into stage 1 (the last of 2) on a thread, and knows when it waits for its labels there."""

    def __init__(self, s: Stages, **info):
        self.error: Exception | None = None
        self.reply = None
        self.waiting = threading.Event()
        host, await_labels = s.hosts[1], s.hosts[1].await_labels

        def noted(*args, **kwargs):
            self.waiting.set()
            return await_labels(*args, **kwargs)

        host.await_labels = noted
        items = activation_items(s.info(1, **info), torch.randn(2, 16, 32), [0, 1])

        def run():
            try:
                self.reply = s.client(1).Forward(items)
            except Exception as e:  # noqa: BLE001 - the test reads it
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.waiting.wait(30.0), "the Forward never reached the labels' wait"

    def ended(self, within_s: float) -> bool:
        self.thread.join(within_s)
        return not self.thread.is_alive()


def test_a_forward_before_its_labels_waits_for_them():
    """The trainer sends labels beside the pipeline: an activation that reaches the last stage first is held until
    they come (not refused), then trains."""
    s = Stages(2, StageBudget())
    forward = _Waiting(s, step=0)
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    s.client(1).PutLabels(stage_pb2.LabelsRequest(info=s.info(1, step=0), labels=labels))
    assert forward.ended(30.0), "the Forward still waits with its labels in"
    assert forward.error is None, forward.error
    assert forward.reply.loss > 0
    s.client(1).Step(stage_pb2.StepRequest(step=0, abandon=True))
    assert s.legit_step() > 0


def test_labels_that_never_come_refuse_the_forward_by_name_after_its_wait():
    """Bounded by the call's own deadline (`call_wait_s`): then refused as before, and the stage serves the next
    step."""
    s = Stages(2, StageBudget())
    forward = _Waiting(s, step=0, deadline_s=0.5)
    assert forward.ended(30.0), "the wait outlived the call's deadline"
    assert isinstance(forward.error, LocalRpcError) and "no labels for step 0" in forward.error.details()
    assert s.hosts[1].open_step is None
    assert s.legit_step() > 0


def test_the_trainers_abandon_ends_a_wait_for_labels():
    """The step's attempt is abandoned (its PutLabels failed, say): the Forward stops waiting long before its 60 s
    and is refused; the stage serves the next step."""
    s = Stages(2, StageBudget())
    forward = _Waiting(s, step=0, attempt_id=77, deadline_s=60)
    s.client(1).Step(stage_pb2.StepRequest(step=0, abandon=True, attempt_id=77))
    assert forward.ended(20.0), "the Forward still waits for labels of an abandoned attempt"
    assert isinstance(forward.error, LocalRpcError) and "abandoned" in forward.error.details()
    assert s.legit_step() > 0


def test_a_forward_sent_twice_is_refused_as_a_repeat_not_held_for_labels_it_used_up():
    """The first one used its micro-batch's labels: the repeat is the schedule's to refuse ("ran already"), at
    once, not a wait of the call's 60 s for labels that will never come again."""
    s = Stages(2, StageBudget())
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    info = s.info(1, step=0, n_micro=2, deadline_s=60)
    s.client(1).PutLabels(stage_pb2.LabelsRequest(info=info, labels=labels))
    items = activation_items(info, torch.randn(2, 16, 32), [0, 1])
    assert s.client(1).Forward(list(items)).loss > 0
    refused(s.client(1).Forward, list(items), words=["ran already"])
