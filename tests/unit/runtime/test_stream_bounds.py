"""The server bounds what a caller holds: read deadlines on a stream, data slots per caller, sample ids, and the
one log line a cancelled or stalled call costs. No sockets: streams are iterators, contexts are stand-ins."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import grpc
import pytest
import torch

from swarm.compression import DEFAULT_LIMITS, CodecConfig, LinkState, WireError, WireLimits, make_codec
from swarm.compression.buffers import MAX_SAMPLE_ID, check_sample_ids
from swarm.net.connect import LocalRpcError
from swarm.net.stream import (
    WATCHDOG,
    ReadTimeouts,
    StreamTimeout,
    read_stream,
    tensor_items,
    tokens_from_wire,
    tokens_to_wire,
)
from swarm.proto import stage_pb2
from swarm.runtime.budget import CallerSlots, SlotsExhausted, StageBudget
from swarm.runtime.messages import StepOrder
from swarm.runtime.policy import Roster
from tests.unit.runtime.test_admission import Stages, activation_items, refused

AQSGD = CodecConfig.parse("aqsgd2")
FAST_LINK = 1e12
"""bytes/s: a minimum rate that makes the item deadline its slack alone"""


class Stalling:
    """A request iterator as gRPC's: hands out `items`, then blocks until the call is cancelled and raises
    RpcError (what `_RequestIterator` does), or hands out `trickle` items `gap_s` apart; `ends`: the stream ends
    after `items` instead."""

    def __init__(self, items, trickle=(), gap_s: float = 0.0, ends: bool = False):
        self.items, self.trickle, self.gap_s, self.ends = list(items), list(trickle), gap_s, ends
        self.cancelled = threading.Event()
        self.active = True

    def __iter__(self):
        return self

    def __next__(self):
        if self.items:
            return self.items.pop(0)
        if self.ends:
            raise StopIteration
        if self.trickle and not self.cancelled.wait(self.gap_s):
            return self.trickle.pop(0)
        if not self.cancelled.wait(10.0):
            raise AssertionError("the stalled stream was never cancelled")
        raise grpc.RpcError()

    def cancel(self) -> None:
        self.active = False
        self.cancelled.set()


def parsed(items) -> list[stage_pb2.StreamItem]:
    return [stage_pb2.StreamItem.FromString(i) for i in items]


def first_item_only(s: Stages, stage: int = 1, **info):
    return parsed(activation_items(s.info(stage, **info), torch.randn(2, 16, 32), [0, 1], chunk_bytes=1024))[:1]


def test_a_stream_that_stalls_between_items_is_cancelled_within_its_item_deadline():
    s = Stages(2, StageBudget())
    stream = Stalling(first_item_only(s))
    begun = time.monotonic()
    with pytest.raises(StreamTimeout, match="no stream item for 0.3 s"):
        read_stream(stream, DEFAULT_LIMITS, timeouts=ReadTimeouts(0.3, 60.0, FAST_LINK), cancel=stream.cancel)
    assert stream.cancelled.is_set()
    assert 0.3 <= time.monotonic() - begun < 3.0
    assert WATCHDOG.watched() == 0  # released


def test_a_stream_that_trickles_past_its_read_deadline_is_cancelled():
    s = Stages(2, StageBudget())
    items = parsed(activation_items(s.info(1), torch.randn(2, 16, 32), [0, 1], chunk_bytes=256))
    stream = Stalling(items[:1], trickle=items[1:], gap_s=0.1)  # each item in time, the whole never
    with pytest.raises(StreamTimeout, match="took longer than 0.5 s"):
        read_stream(stream, DEFAULT_LIMITS, timeouts=ReadTimeouts(2.0, 0.5, FAST_LINK), cancel=stream.cancel)
    assert stream.trickle  # cancelled before the last item


def test_the_servers_own_wait_mid_read_is_not_the_callers():
    """A wait for a large-stream slot (on_header) longer than the item and read deadlines does not cancel."""
    s = Stages(2, StageBudget())
    items = parsed(activation_items(s.info(1), torch.randn(2, 16, 32), [0, 1], chunk_bytes=1024))
    stream = Stalling(items, ends=True)
    waits = []

    def on_header(header) -> None:
        waits.append(threading.Event().wait(0.8))  # the server's own wait, e.g. for a large-stream slot

    read = read_stream(
        stream, DEFAULT_LIMITS, on_header=on_header, timeouts=ReadTimeouts(0.3, 0.4, FAST_LINK), cancel=stream.cancel
    )
    assert read.message is not None and waits == [False]
    assert not stream.cancelled.is_set()


def test_the_default_deadlines_get_a_full_micro_batch_through_a_1_mbit_link():
    """The rule: every item and message the wire limits admit, at 1 Mbit/s, plus the slack."""
    from swarm.model.gpt import ModelConfig

    budget = StageBudget()
    limits = budget.wire_limits(ModelConfig(vocab_size=256, seq_len_tokens=128, hidden_dim=256, n_layers=2))
    timeouts, one_mbit = budget.read_timeouts(), 1e6 / 8
    assert timeouts.item_deadline_s(limits) >= limits.max_chunk_bytes / one_mbit + budget.item_timeout_s
    assert timeouts.read_deadline_s(limits.max_message_bytes) >= limits.max_message_bytes / one_mbit
    with pytest.raises(ValueError, match="item_timeout_s"):
        StageBudget(item_timeout_s=float("inf"))


# ---- data slots per caller -------------------------------------------------------------------------------------


def test_one_caller_holds_at_most_its_share_of_the_data_slots():
    slots = CallerSlots(6, "data", per_caller=4)
    with slots.take("greedy"), slots.take("greedy"), slots.take("greedy"), slots.take("greedy"):
        with pytest.raises(SlotsExhausted, match="greedy holds 4 data calls already"), slots.take("greedy"):
            pass
        with (
            slots.take("honest"),
            slots.take("honest"),
            pytest.raises(SlotsExhausted, match="6 data calls are being served"),
            slots.take("third"),
        ):
            pass
    assert slots.held("greedy") == slots.held("honest") == 0


def test_the_plans_senders_always_find_their_reserved_slots():
    """Two strangers (say, Sybil trainers) fill their shares; the plan's trainer and stage 1 still find theirs."""
    named = frozenset({"trainer", "stage1"})
    slots = CallerSlots(12, "data", per_caller=6, reserved=2)
    with contextlib.ExitStack() as held:
        held.enter_context(slots.take("trainer", named))
        for _ in range(6):
            held.enter_context(slots.take("sybil1", named))
        for _ in range(2):  # 7 taken, 3 owed (trainer 1, stage1 2): 2 more for anyone
            held.enter_context(slots.take("sybil2", named))
        with pytest.raises(SlotsExhausted, match="held back for the plan's other peers"), slots.take("sybil2", named):
            pass
        held.enter_context(slots.take("trainer", named))
        held.enter_context(slots.take("stage1", named))
        held.enter_context(slots.take("stage1", named))
        assert (slots.held("trainer"), slots.held("stage1"), slots.held("sybil2")) == (2, 2, 2)
    assert slots.held("sybil1") == 0


def test_the_reserve_never_keeps_a_caller_alone_below_its_share():
    named = frozenset(f"peer{i}" for i in range(16))  # more plan peers than slots to reserve
    slots = CallerSlots(24, "data", per_caller=20, reserved=2)
    held = [slots.take("peer0", named) for _ in range(20)]
    for h in held:
        h.__enter__()
    assert slots.held("peer0") == 20
    for h in held:
        h.__exit__(None, None, None)


def test_a_slot_is_freed_when_its_call_fails():
    slots = CallerSlots(1, "data", per_caller=1)
    with pytest.raises(RuntimeError), slots.take("a"):
        raise RuntimeError("the call failed")
    with slots.take("b"):
        assert slots.held("b") == 1


def test_a_stage_reserves_slots_for_its_neighbours_and_its_trainers_at_the_ends():
    s = Stages(3, StageBudget())
    roster = Roster((("a0", "b0"), ("a1",), ("a2",)), (("x", "y"), ("z",), ("w",)), frozenset({"t"}), frozenset())
    for servicer in s.servicers:
        servicer.set_roster(roster)
    for host, peer in zip(s.hosts, ("a0", "a1", "a2"), strict=True):
        host.peer_id = peer
    assert s.servicers[0]._named_senders() == {"b0", "a1", "t"}
    assert s.servicers[1]._named_senders() == {"a0", "b0", "a2"}
    assert s.servicers[2]._named_senders() == {"a1", "t"}


# ---- sample ids ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1 << 62, -(1 << 63), MAX_SAMPLE_ID, -1])
def test_sample_ids_outside_0_to_2_53_are_refused_at_the_edge(bad):
    with pytest.raises(WireError, match=f"tokens.sample_ids: {bad} is outside"):
        tokens_from_wire(tokens_to_wire(torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, bad])), 256, 16)
    check_sample_ids([0, MAX_SAMPLE_ID - 1])  # the largest id passes


@pytest.mark.parametrize("bad", [1 << 62, -(1 << 63)])
def test_a_neighbours_sample_ids_out_of_range_are_refused_by_name_before_any_state_changes(bad):
    s = Stages(3, StageBudget(), fw=AQSGD)
    assert s.legit_step() > 0
    buffered = len(s.hosts[1].links.forward_recv.buffers)
    labels = tokens_to_wire(torch.zeros(2, 16, dtype=torch.long))
    s.client(2).PutLabels(stage_pb2.LabelsRequest(info=s.info(2, step=1), labels=labels))
    msg = make_codec(CodecConfig("fp32")).encode(torch.randn(2, 16, 32), sample_ids=[5, bad])
    error = refused(
        s.client(1).Forward,
        list(tensor_items(s.info(1, step=1), msg, 0, None)),
        code=grpc.StatusCode.INVALID_ARGUMENT,
        words=["sample_ids", str(bad), "invalid message from"],
    )
    assert "(not authenticated)" in error.details()  # no verifier here: the sender is named by its address
    assert s.hosts[1].open_step is None
    assert len(s.hosts[1].links.forward_recv.buffers) == buffered


def test_the_aqsgd_codec_refuses_out_of_range_ids_too():
    codec = make_codec(AQSGD)
    sender, receiver = LinkState(AQSGD), LinkState(AQSGD)
    msg = codec.encode(torch.randn(2, 4, 8), sample_ids=[1 << 62, 1], state=sender)
    with pytest.raises(WireError, match="sample_ids"):
        codec.decode(msg, state=receiver, limits=WireLimits())
    assert len(receiver.buffers) == 0


# ---- what a cancelled or stalled call costs the log ------------------------------------------------------------


class _Context:
    """The part of a gRPC servicer context the stage service uses, for a caller who cancels or stalls."""

    def __init__(self, stream: Stalling):
        self.stream = stream

    def invocation_metadata(self):
        return ()

    def add_callback(self, callback) -> bool:
        return True

    def abort(self, code, details):
        raise LocalRpcError(code, details)

    def cancel(self) -> None:
        self.stream.cancel()

    def is_active(self) -> bool:
        return self.stream.active

    def peer(self) -> str:
        return "ipv4:203.0.113.9:4242"


def _no_traceback(records) -> None:
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    assert all(r.exc_info is None for r in records)


def test_a_stream_its_caller_cancels_costs_one_info_line_and_no_traceback(caplog):
    s = Stages(2, StageBudget())
    stream = Stalling(first_item_only(s))
    context = _Context(stream)
    threading.Timer(0.2, stream.cancel).start()  # the caller goes away mid-stream
    with caplog.at_level(logging.INFO, logger="swarm.runtime.service"), pytest.raises(grpc.RpcError):
        s.servicers[1].Forward(stream, context)
    lines = [r for r in caplog.records if r.name == "swarm.runtime.service"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "cancelled by its caller" in lines[0].getMessage() and "203.0.113.9" in lines[0].getMessage()
    _no_traceback(caplog.records)
    assert s.servicers[1]._data_slots.held(None) == 0
    assert s.legit_step() > 0


def test_a_stalled_stream_is_cancelled_by_the_stage_with_one_warning_naming_its_caller(caplog):
    s = Stages(2, StageBudget(item_timeout_s=0.3, min_link_rate_bytes_per_s=FAST_LINK))
    stream = Stalling(first_item_only(s))
    with caplog.at_level(logging.INFO, logger="swarm.runtime.service"):
        error = refused(s.servicers[1].Forward, stream, _Context(stream), code=grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "no stream item for" in error.details()
    lines = [r for r in caplog.records if r.name == "swarm.runtime.service"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "203.0.113.9" in lines[0].getMessage() and "no stream item" in lines[0].getMessage()
    _no_traceback(caplog.records)
    assert s.servicers[1]._data_slots.held(None) == 0
    assert s.hosts[1].open_step is None
    assert s.legit_step() > 0


# ---- memory: first sights of calls that never run ----------------------------------------------------------------


def test_first_sights_of_a_call_whose_turn_never_comes_leave_the_buffers_at_once():
    """Calls admitted, decoded (their first sights buffered), then refused at their turn's deadline used to keep
    their rows in the AQ-SGD buffers until the step ended, and for good if it was then applied: a stream of such
    calls grew the stage's memory round after round. Now the rows go when the call fails, while the step is open."""
    s = Stages(3, StageBudget(), fw=AQSGD)
    assert s.legit_step() > 0
    store = s.hosts[1].links.forward_recv.buffers
    before = set(store.ids())
    step = s.next_step

    def park(mb: int, ids: list[int], wait_s: float, out: list) -> None:
        msg = make_codec(AQSGD).encode(torch.randn(len(ids), 16, 32), sample_ids=ids, state=LinkState(AQSGD))
        info = s.info(1, step=step, mb=mb, n_micro=4, deadline_s=wait_s)
        try:
            s.client(1).Forward(list(tensor_items(info, msg, 0, None)))
        except LocalRpcError as e:
            out.append(e.details())

    soon, late = [], []
    holder = threading.Thread(target=park, args=(2, list(range(2000, 2064)), 30.0, late))
    holder.start()  # keeps the step open: a call in flight, waiting for 1F0
    deadline = time.monotonic() + 20
    while not set(range(2000, 2064)) <= set(store.ids()) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    park(1, list(range(1000, 1256)), 0.5, soon)  # waits 0.5 s for 1F0, which never comes
    assert soon and "waited" in soon[0], soon
    assert s.hosts[1].open_step == step  # still open: its other call waits
    ids = set(store.ids())
    assert not ids & set(range(1000, 1256))  # the failed call's 256 first sights are gone already
    assert set(range(2000, 2064)) <= ids  # the waiting call's stay
    s.hosts[1].gate.wake()
    s.hosts[1].step(StepOrder(step=step, abandon=True))
    holder.join(30)
    assert set(store.ids()) == before
    assert s.legit_step() > 0


def test_a_stalled_link_probe_gives_its_slot_back(caplog):
    s = Stages(2, StageBudget(item_timeout_s=0.3, min_link_rate_bytes_per_s=FAST_LINK, probe_calls=1))
    stream = Stalling(first_item_only(s))
    with caplog.at_level(logging.INFO, logger="swarm.runtime.service"):
        error = refused(s.servicers[1].Sink, stream, _Context(stream), code=grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "no stream item" in error.details()
    _no_traceback(caplog.records)
    with s.servicers[1]._probe_slots.take():  # its one slot is free again
        pass


def test_a_caller_slot_waited_for_is_taken_when_freed_and_refused_by_name_when_not():
    slots = CallerSlots(2, "large stream", per_caller=1, reserved=1)
    got = []
    with slots.take("a", frozenset({"a", "b"})):
        started = time.monotonic()
        with pytest.raises(SlotsExhausted, match="a holds 1 large stream calls already"), slots.take("a", wait_s=0.1):
            pass
        assert time.monotonic() - started >= 0.1  # it waited for its own share before it was refused

        def second() -> None:
            with slots.take("a", wait_s=10.0):
                got.append(slots.held("a"))

        waiter = threading.Thread(target=second)
        waiter.start()
        with slots.take("b", frozenset({"a", "b"})):  # another sender is not held up by a's wait
            assert slots.held("b") == 1
    waiter.join(10.0)  # the first slot freed: the waiting one takes it
    assert got == [1] and slots.held("a") == 0


def test_one_sender_cannot_hold_every_large_stream_slot():
    s = Stages(2, StageBudget(large_streams=4, large_stream_bytes=1024, max_wait_s=0.2))
    servicer = s.servicers[1]
    assert servicer.budget.caller_large_streams == 2
    with contextlib.ExitStack() as held:
        held.enter_context(servicer._large_slot("greedy"))
        held.enter_context(servicer._large_slot("greedy"))
        with pytest.raises(SlotsExhausted, match="greedy holds 2 large stream"), servicer._large_slot("greedy"):
            pass
        held.enter_context(servicer._large_slot("other"))  # the two left are not the greedy sender's


def _state_clients(pipe):
    """GetState callers the plan allows: its trainer and a stage-1 peer (each with its own key)."""
    from swarm.net.auth import CallSigner

    trainer = pipe.network.connector(CallSigner(pipe.trainer)).stage(pipe.addresses[0])
    peer = pipe.replica_hosts[1][0].outbox.connector.stage(pipe.addresses[0])
    return trainer, peer


def test_get_state_holds_one_slot_per_caller_and_refuses_another_plans_state_with_the_plan_marker():
    import dataclasses

    from swarm.net.stream import PLAN_MISMATCH
    from swarm.runtime.inprocess import LocalPipeline
    from tests.unit.net.test_policy import TINY

    pipe = LocalPipeline(TINY, 2)
    try:
        servicer = pipe.switches[0][0].target
        servicer.budget = dataclasses.replace(servicer.budget, state_wait_s=0.2)
        trainer, peer = _state_clients(pipe)
        first = iter(trainer.GetState(stage_pb2.StateRequest(stage=0)))
        next(first)  # the trainer's first GetState is being sent: it holds its one state slot
        with pytest.raises(LocalRpcError, match="holds 1 GetState calls already") as e:
            list(trainer.GetState(stage_pb2.StateRequest(stage=0)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(list(peer.GetState(stage_pb2.StateRequest(stage=0)))) > 1  # another caller is served meanwhile
        list(first)  # sent: the slot is the trainer's again
        assert len(list(trainer.GetState(stage_pb2.StateRequest(stage=0)))) > 1
        with pytest.raises(LocalRpcError, match=PLAN_MISMATCH) as e:
            list(peer.GetState(stage_pb2.StateRequest(stage=0, plan_version=7)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not stage 0 of plan 7" in str(e.value)
    finally:
        pipe.close()
