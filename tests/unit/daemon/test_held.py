"""Held checkpoint copies: the buddy choice, the pull every N steps, GetState serving a held copy by layer range
(to plan peers only, bounded), the freshest-copy choice, and when a graceful leave is done."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, Unframer, make_codec
from swarm.daemon.held import HELD_METADATA_KEY, Copy, HeldStore, buddy_of, freshest, parse_held_layers
from swarm.daemon.replication import HeldServer, Replicator, leave_done, takeover_sources
from swarm.model.gpt import ModelConfig
from swarm.net.auth import CallSigner, Identity
from swarm.net.connect import LocalRpcError, _LocalContext, method_path
from swarm.peers.records import PeerAnnouncement, PlanRecord
from swarm.proto import stage_pb2
from swarm.runtime.checkpoint import handover_tensors
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.daemon.test_repair import A, B, C, D, E, grid

TINY = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=32, n_layers=3, n_heads=2)


def decode(items) -> dict[str, torch.Tensor]:
    fp32, unframers, out = make_codec(CodecConfig("fp32")), {}, {}
    for item in items:
        msg = unframers.setdefault(item.name, Unframer()).feed(item.chunk)
        if msg is not None:
            out[item.name] = fp32.decode(msg)
    return out


def test_buddy_is_the_next_peer_in_plan_order_serving_another_stage():
    plan = grid([A, B], [C], unused=[D])
    assert buddy_of(plan, A) == (1, C), "B serves A's own stage: skipped"
    assert buddy_of(plan, B) == (1, C)
    assert buddy_of(plan, C) == (0, A), "wraps past the standby"
    assert buddy_of(plan, D) == (0, A), "a standby keeps a copy too"
    assert buddy_of(plan, E) is None, "not in the plan"
    assert buddy_of(grid([A, B]), A) is None, "one stage: nothing else to copy"


def test_freshest_copy_prefers_a_replica_then_the_most_steps():
    held = [Copy(C, 40, False), Copy(B, 60, False), Copy(A, 60, False)]
    assert freshest(held) == Copy(A, 60, False), "most steps, ties by id"
    assert freshest([*held, Copy(D, 0, True)]) == Copy(D, 0, True), "a live replica first"
    assert freshest([]) is None


def ann(pid: str, held=(), version: int = 0, stage: int | None = None) -> PeerAnnouncement:
    layers = {} if stage is None else {"stage": stage, "layer_start": stage, "layer_end": stage + 1}
    return PeerAnnouncement(pid, "127.0.0.1:1", "cpu", 1, 1.0, plan_version=version, held=held, **layers)


def test_takeover_sources_surviving_replicas_then_held_copies_by_steps():
    old = PlanRecord(version=3, document=grid([A, B], [C, D]), created_at=1.0)
    peers = [ann(B), ann(C, held=[(1, 2, 10)]), ann(D, held=[(0, 1, 30)]), ann(E, held=[(0, 1, 50), (1, 2, 5)])]
    replicas, held = takeover_sources(old, 0, peers, me=E)
    assert replicas == [B], "A is gone"
    assert held == [(D, 30)], "E is the taker itself; only D holds [0, 1)"
    replicas, held = takeover_sources(old, 0, [p for p in peers if p.peer_id != B], me=C)
    assert replicas == [] and held == [(E, 50), (D, 30)], "no replica survives: freshest held copy first"


def test_held_layers_metadata_is_parsed_with_bounds():
    assert parse_held_layers([("other", "x")], 4) is None
    assert parse_held_layers([(HELD_METADATA_KEY, "1-3")], 4) == (1, 3)
    for bad in ("3-1", "0-5", "a-b", "1-2-3", "1" * 40):
        with pytest.raises(ValueError, match=HELD_METADATA_KEY):
            parse_held_layers([(HELD_METADATA_KEY, bad)], 4)


def test_held_store_keeps_the_newest_copy_and_reloads_it(tmp_path):
    pipe = LocalPipeline(TINY, 2, auth=False)
    worker = pipe.hosts[1].worker
    store = HeldStore(tmp_path)
    assert store.save(2, 3, handover_tensors(worker, 20), plan_version=4)
    assert not store.save(2, 3, handover_tensors(worker, 10)), "an older copy does not replace a newer one"
    assert store.held() == ((2, 3, 20),)
    again = HeldStore(tmp_path)  # after a restart
    assert again.held() == ((2, 3, 20),)
    loaded = again.load(2, 3)
    for name, value in worker.module.state_dict().items():
        torch.testing.assert_close(loaded[f"model.{name}"], value)
    assert again.load(0, 2) is None
    (tmp_path / "layers-0000-0001.safetensors").write_bytes(b"torn")
    assert HeldStore(tmp_path).held() == ((2, 3, 20),), "a torn file is skipped, not fatal"
    pipe.close()


def servicer_of(pipe: LocalPipeline, stage: int):
    """The StageServicer registered for `stage` (LocalPipeline may wrap it in a kill switch)."""
    registered = pipe.network._servicers[pipe.addresses[stage]]
    return getattr(registered, "target", registered)


def call_get_state(servicer, signer: CallSigner, callee: str, held: str | None):
    request = stage_pb2.StateRequest(stage=0)
    metadata = signer.metadata(callee, method_path("GetState"), request)  # the token and this call's proof
    metadata += ((HELD_METADATA_KEY, held),) if held else ()
    return list(servicer.GetState(request, _LocalContext(metadata)))


def test_get_state_serves_held_copies_to_plan_peers_only(tmp_path):
    pipe = LocalPipeline(TINY, 2)
    servicer = servicer_of(pipe, 0)
    store = HeldStore(tmp_path)
    store.save(2, 3, handover_tensors(pipe.hosts[1].worker, 7))
    servicer.held_state = HeldServer(store, TINY.n_layers)
    callee = pipe.hosts[0].peer_id
    neighbour = pipe.hosts[1].outbox.connector.signer
    got = decode(call_get_state(servicer, neighbour, callee, "2-3"))
    assert int(got["meta.steps_done"].item()) == 7
    for name, value in pipe.hosts[1].worker.module.state_dict().items():
        torch.testing.assert_close(got[f"model.{name}"], value)
    assert set(got) == set(handover_tensors(pipe.hosts[1].worker, 7))
    own = decode(call_get_state(servicer, neighbour, callee, None))
    assert set(own) == set(handover_tensors(pipe.hosts[0].worker, 0)), "no metadata: the served stage"
    cases = {
        "0-2": grpc.StatusCode.NOT_FOUND,  # a range it does not hold
        "9-1": grpc.StatusCode.INVALID_ARGUMENT,
    }
    for held, code in cases.items():
        with pytest.raises(LocalRpcError) as e:
            call_get_state(servicer, neighbour, callee, held)
        assert e.value.code() == code
    with pytest.raises(LocalRpcError, match="GetState only to a peer of the plan"):
        call_get_state(servicer, CallSigner(Identity.generate()), callee, "2-3")  # a stranger
    # a second transfer while one is under way is refused at once, and the slot comes back after
    metadata = (
        *neighbour.metadata(callee, method_path("GetState"), stage_pb2.StateRequest()),
        (HELD_METADATA_KEY, "2-3"),
    )
    first = servicer.GetState(stage_pb2.StateRequest(), _LocalContext(metadata))
    next(first)
    servicer.budget = dataclasses.replace(servicer.budget, state_wait_s=0.5)  # the second's wait, then refused
    with pytest.raises(LocalRpcError) as e:
        call_get_state(servicer, neighbour, callee, "2-3")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.close()  # a caller that goes away mid-stream gives the slot back
    assert call_get_state(servicer, neighbour, callee, "2-3")
    pipe.close()


def test_every_get_state_stream_is_counted_whole_or_cut_short_and_logged(tmp_path, caplog):
    from swarm.metrics import STATE_SENT_LOG

    pipe = LocalPipeline(TINY, 2)
    servicer = servicer_of(pipe, 0)
    store = HeldStore(tmp_path)
    store.save(2, 3, handover_tensors(pipe.hosts[1].worker, 7))
    servicer.held_state = HeldServer(store, TINY.n_layers)
    counted = []
    servicer.state_sent = counted.append
    callee, neighbour = pipe.hosts[0].peer_id, pipe.hosts[1].outbox.connector.signer
    with caplog.at_level("INFO", logger="swarm.runtime.service"):
        held = call_get_state(servicer, neighbour, callee, "2-3")
        own = call_get_state(servicer, neighbour, callee, None)
        metadata = neighbour.metadata(callee, method_path("GetState"), stage_pb2.StateRequest())
        cut = servicer.GetState(stage_pb2.StateRequest(), _LocalContext(metadata))
        first = next(cut)
        cut.close()  # the caller went away after one item
    sizes = [sum(i.ByteSize() for i in held), sum(i.ByteSize() for i in own), first.ByteSize()]
    assert counted == sizes and sizes[0] > 0 and sizes[1] > sizes[2]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(STATE_SENT_LOG)]
    assert [int(line.split()[2]) for line in lines] == sizes
    with pytest.raises(LocalRpcError):
        call_get_state(servicer, CallSigner(Identity.generate()), callee, "2-3")  # a stranger gets nothing
    assert counted == sizes, "a refused call sent nothing"
    pipe.close()


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_replicator_pulls_the_buddy_every_n_steps(tmp_path):
    pipe = LocalPipeline(TINY, 2)
    host = pipe.hosts[1]
    plan = PlanRecord(version=2, document={"stages": [
        {"layer_start": 0, "layer_end": 2, "peer_ids": [A]},
        {"layer_start": 2, "layer_end": 3, "peer_ids": [B]},
    ], "unused_peer_ids": [C]}, created_at=1.0)  # fmt: skip
    peers = [ann(A), ann(B), ann(C)]
    servicer = servicer_of(pipe, 1)
    plan_peer = pipe.hosts[0].outbox.connector.signer
    fetched = []

    def fetch(address, stage, version):  # GetState from stage 1, as fetch_state reads it
        fetched.append((address, stage, version))
        request = stage_pb2.StateRequest(stage=1)
        context = _LocalContext(plan_peer.metadata(host.peer_id, method_path("GetState"), request))
        return decode(servicer.GetState(request, context))

    clock = Clock()
    store = HeldStore(tmp_path)
    rep = Replicator(A, store, every_steps=20, status=lambda a: host.steps_done, fetch=fetch, poll_s=2.0, clock=clock)
    pulled = []
    rep.on_pulled = lambda: pulled.append(store.held())
    host.restore(19)
    assert not rep.tick(plan, peers), "19 steps: not due"
    clock.t += 2
    host.restore(20)
    assert rep.tick(plan, peers)
    rep._busy.acquire()  # the pull thread is done once it releases
    rep._busy.release()
    assert fetched == [("127.0.0.1:1", 1, 2)] and pulled == [((2, 3, 20),)]
    clock.t += 2
    host.restore(39)
    assert not rep.tick(plan, peers), "next pull at step 40"
    assert not rep.tick(None, peers), "no plan: nothing to copy"
    clock.t += 2
    rep.status = lambda a: None
    host.restore(40)
    assert not rep.tick(plan, peers), "holder unreachable: try later"
    pipe.close()


def test_no_copy_is_held_of_a_stage_its_replicas_already_hold(tmp_path):
    def plan(version, *stage1):
        return PlanRecord(version=version, document={"stages": [
            {"layer_start": 0, "layer_end": 2, "peer_ids": [A]},
            {"layer_start": 2, "layer_end": 3, "peer_ids": list(stage1)},
        ]}, created_at=1.0)  # fmt: skip

    peers = [ann(A), ann(B), ann(C)]
    clock = Clock()
    rep = Replicator(A, HeldStore(tmp_path), every_steps=20, status=lambda a: 40, fetch=None, poll_s=2.0, clock=clock)
    assert rep.due(plan(2, B, C), peers) is None, "stage 1 has two replicas: each holds the other's state"
    assert not rep.tick(plan(2, B, C), peers)
    clock.t += 2
    assert rep.due(plan(3, B), peers) == ("127.0.0.1:1", 1, 2, 3), "down to one replica: its copy is due again"


def test_a_leave_is_done_when_the_successor_follows_a_plan_without_the_leaver():
    new = PlanRecord(version=5, document=grid([A, E], [C, D]), created_at=1.0)
    assert not leave_done(None, [ann(A)], B, (0, 1))
    assert not leave_done(PlanRecord(version=4, document=grid([A, B], [C, D]), created_at=1.0), [ann(A)], B, (0, 1))
    assert leave_done(None, [ann(B), dataclasses.replace(ann(A), leaving=True)], B, (0, 1)), "everyone leaves"
    behind = [ann(A, version=5, stage=0), ann(E, version=4), ann(C, version=5, stage=1), ann(D, version=5, stage=1)]
    assert not leave_done(new, behind, B, (0, 1)), "E has not taken stage 0 over yet"
    done = [*behind[:1], ann(E, version=5, stage=0), *behind[2:]]
    assert leave_done(new, done, B, (0, 1))


class FakeCall:
    """What a unary-stream gRPC call returns: an iterator of replies that can be cancelled."""

    def __init__(self, items):
        self.items, self.cancelled = iter(items), False

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)

    def cancel(self):
        self.cancelled = True


class FakeChannels:
    """Hands StageStub a channel whose GetState streams `items` (and records the metadata it was called with)."""

    def __init__(self, items):
        self.items, self.calls, self.metadata = items, [], None

    def get(self, address):
        channels = self

        class Channel:
            def unary_stream(self, method, request_serializer=None, response_deserializer=None, **_):
                def call(request, timeout=None, metadata=None):
                    channels.metadata = metadata
                    channels.calls.append(FakeCall(channels.items))
                    return channels.calls[-1]

                return call

            unary_unary = stream_unary = stream_stream = unary_stream

        return Channel()


def test_fetch_state_bounds_what_a_holder_sends(monkeypatch):
    from swarm.compression import WireError
    from swarm.daemon import state_fetch
    from swarm.daemon.held import fetch_held
    from swarm.runtime.service import named_state_items

    tensors = {"model.w": torch.ones(4, 4), "meta.steps_done": torch.tensor([3.0])}
    good = list(named_state_items(tensors))
    channels = FakeChannels(good)
    got = fetch_held(channels, "x", 0, 1)
    assert set(got) == set(tensors) and channels.metadata == ((HELD_METADATA_KEY, "0-1"),)
    channels = FakeChannels(good + good[:1])  # a tensor sent twice
    with pytest.raises(WireError, match="repeated"):
        state_fetch.fetch_state(channels, "x", 0, 0)
    assert channels.calls[-1].cancelled, "the stream is cancelled, not read on"
    with pytest.raises(WireError, match="over 16 bytes"):
        state_fetch.fetch_state(FakeChannels(good), "x", 0, 0, max_bytes=16)
    monkeypatch.setattr(state_fetch, "MAX_STATE_TENSORS", 1)
    with pytest.raises(WireError, match="over 1"):
        state_fetch.fetch_state(FakeChannels(good), "x", 0, 0)
