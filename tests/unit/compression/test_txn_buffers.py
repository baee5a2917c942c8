"""Transactions of the AQ-SGD buffer stores and a link end's state: `rollback` restores ids, slots, the free
list and every row's bits exactly; `commit` keeps the changes and drops the journal, which holds only the rows
and ids the step touched."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig, LinkState, make_codec
from swarm.compression.buffers import MemoryBufferStore, MmapBufferStore
from swarm.runtime.device import DeviceBufferStore


def _snapshot(store) -> tuple:
    rows = {i: store.get(i).cpu().clone() for i in store.ids()}
    return dict(store._slots), store._next_slot, list(store._free), rows


def _same(a: tuple, b: tuple) -> bool:
    return a[:3] == b[:3] and a[3].keys() == b[3].keys() and all(torch.equal(a[3][i], b[3][i]) for i in a[3])


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=["memory", "mmap", *(f"device-{d}" for d in DEVICES)])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryBufferStore(6, torch.float16)
    if request.param.startswith("device-"):  # a sending end's store of a device-encoded codec (its own scatter)
        return DeviceBufferStore(6, torch.float16, request.param.removeprefix("device-"))
    return MmapBufferStore(6, torch.float16, tmp_path / "b.buf")


def test_rollback_undoes_admits_writes_forgets_and_slot_reuse_exactly(store):
    store.admit([1, 2, 3], torch.randn(3, 4))
    store.forget([2])  # a free slot before the step
    before = _snapshot(store)
    store.begin()
    store.scatter(store.lookup([1, 3]), torch.randn(2, 4))  # deltas
    store.admit([1], torch.randn(1, 4))  # an admitted id written again
    store.forget([3])  # forgotten, then its slot reused by a new id in the same step
    with pytest.warns(UserWarning, match="full"):
        store.admit([7, 8, 9, 10, 11, 12], torch.randn(6, 4))  # up to the capacity: 12 does not fit
    assert 12 not in store and len(store) == 6
    store.scatter(store.lookup([7]), torch.randn(1, 4))
    assert store.journalled() > 0 and not _same(_snapshot(store), before)
    store.rollback()
    assert _same(_snapshot(store), before) and store.journalled() == 0


def test_commit_keeps_the_step_and_drops_its_journal(store):
    store.admit([1, 2], torch.randn(2, 4))
    store.begin()
    values = torch.randn(2, 4)
    store.scatter(store.lookup([1]), values[:1])
    store.admit([5], values[1:])
    after = _snapshot(store)
    store.commit()
    assert store.journalled() == 0 and _same(_snapshot(store), after)
    store.rollback()  # nothing open: nothing to undo
    assert _same(_snapshot(store), after)


def test_the_journal_holds_only_the_rows_and_ids_a_step_touched():
    store = MemoryBufferStore(1000, torch.float16)
    store.admit(list(range(500)), torch.randn(500, 8))
    store.begin()
    store.scatter(store.lookup([3, 4, 5]), torch.randn(3, 8))
    store.scatter(store.lookup([4]), torch.randn(1, 8))  # a row journalled once, at its first write
    store.admit([600], torch.randn(1, 8))  # a slot no id held: nothing of it to journal but the id
    assert len(store._journal.rows) == 3 and len(store._journal.slots) == 1


@pytest.mark.parametrize("label", ["aqsgd2", "acsgd2+ch", "gradq2+ef"])
def test_an_abandoned_step_leaves_both_ends_and_the_draws_as_they_were(label):
    config = CodecConfig.parse(label)
    codec = make_codec(config)
    send, recv = LinkState(config), LinkState(config)
    x = torch.randn(4, 3, 16)
    ids = [0, 1, 2, 3]

    def step(commit: bool, data: torch.Tensor) -> bytes:
        for s in (send, recv):
            s.begin_step()
        msg = codec.encode(data, sample_ids=ids if config.name != "gradq" else None, state=send)
        codec.decode(msg, state=recv)
        for s in (send, recv):
            s.end_step(commit)
        return msg.SerializeToString()

    step(True, x)
    draws = send._draws
    y = x + 0.1 * torch.randn_like(x)
    abandoned = step(False, y)
    assert send._draws == draws and send.residual is None
    retried = step(True, y)
    assert retried == abandoned, "the retry sends the bytes the abandoned attempt sent"
    if send.buffers is not None:
        assert [send.buffers.get(i).tolist() for i in ids] == [recv.buffers.get(i).tolist() for i in ids]


def test_an_abandoned_step_restores_the_lowrank_warm_start():
    state = LinkState(CodecConfig.parse("lowrank2+ef"))
    state.warm = torch.ones(3, 2)
    state.begin_step()
    state.warm = torch.zeros(3, 2)
    state.end_step(commit=False)
    assert torch.equal(state.warm, torch.ones(3, 2))
    state.begin_step()
    state.warm = torch.zeros(3, 2)
    state.end_step(commit=True)
    assert torch.equal(state.warm, torch.zeros(3, 2))
