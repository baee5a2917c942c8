"""The message buffers' memory budget and least-recently-seen eviction: both ends evict the same samples from the
same sequence of ids, an evicted sample is a first sight again, a receiver that lacks a reference says so (never
decodes against nothing), an abandoned step undoes its evictions, and the budget bounds the bytes held."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import BufferMissError, CodecConfig, LinkState, make_codec
from swarm.options import CodecFlags

TOKENS, HIDDEN = 16, 8
SAMPLE_BYTES = TOKENS * HIDDEN * 2  # fp16 buffers


def ends(label="acsgd2+ch+nr+rot+fs4", samples=6, **kw):
    cfg = CodecConfig.parse(label, seed=3, buffer_budget_bytes=int(samples * SAMPLE_BYTES), **kw)
    return make_codec(cfg), LinkState(cfg), LinkState(cfg)


def snapshot(state):
    store = state.buffers
    ids = sorted(store.ids())
    return store.recency(), ids, store.gather(store.lookup(ids)).clone()


def assert_same(send, recv):
    (a_order, a_ids, a), (b_order, b_ids, b) = snapshot(send), snapshot(recv)
    assert a_order == b_order and a_ids == b_ids
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def sample(i: int, visit: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * i + visit)
    return torch.randn(TOKENS, HIDDEN, generator=gen) + i


def send_ids(codec, send, recv, ids, visit=0):
    x = torch.stack([sample(i, visit) for i in ids])
    msg = codec.encode(x, sample_ids=ids, state=send)
    return msg, codec.decode(msg, state=recv)


@pytest.mark.parametrize("label", ["acsgd2+ch+nr+rot+fs4", "aqsgd2+fs8", "tern+ch+fs2"])
def test_both_ends_evict_the_same_samples(label):
    codec, send, recv = ends(label)
    gen = torch.Generator().manual_seed(0)
    for visit in range(40):
        pool = 8 if visit < 20 else 30  # first mostly hits, then mostly evictions
        ids = torch.randperm(pool, generator=gen)[:3].tolist()
        send_ids(codec, send, recv, ids, visit)
        assert_same(send, recv)
        assert len(send.buffers) <= 6
    assert send.buffers.evicted == recv.buffers.evicted > 10


def test_the_least_recently_seen_sample_goes_and_comes_back_as_a_first_sight():
    codec, send, recv = ends(samples=3)
    send_ids(codec, send, recv, [1, 2, 3])
    send_ids(codec, send, recv, [1])  # 1 seen again: 2 is now the least recently seen
    assert send.buffers.recency() == [2, 3, 1]
    send_ids(codec, send, recv, [4])
    assert sorted(send.buffers.ids()) == sorted(recv.buffers.ids()) == [1, 3, 4]
    msg, _ = send_ids(codec, send, recv, [2, 3])
    assert list(msg.sample_is_delta) == [False, True]  # 2 was evicted: a first sight again
    assert_same(send, recv)


def test_a_receiver_restarted_empty_reports_the_miss_and_the_resend_restores_the_buffers():
    codec, send, recv = ends()
    send_ids(codec, send, recv, [1, 2, 3])
    fresh = LinkState(recv.config)
    msg = codec.encode(torch.stack([sample(i, 1) for i in (1, 2, 3)]), sample_ids=[1, 2, 3], state=send)
    with pytest.raises(BufferMissError) as miss:
        codec.decode(msg, state=fresh)
    assert sorted(miss.value.sample_ids) == [1, 2, 3] and len(fresh.buffers) == 0
    send.buffers.forget(miss.value.sample_ids)  # the runtime's repair: forget the message's ids, resend in full
    msg, out = send_ids(codec, send, fresh, [1, 2, 3], 1)
    assert not any(msg.sample_is_delta)
    assert_same(send, fresh)


def test_a_receiver_with_a_smaller_budget_never_decodes_against_nothing():
    codec, send, _ = ends(samples=6)
    _, _, small = ends(samples=2)
    send_ids(codec, send, small, [1, 2, 3])  # the receiver keeps 2 and 3 only
    assert sorted(small.buffers.ids()) == [2, 3]
    msg = codec.encode(torch.stack([sample(i, 1) for i in (1, 2)]), sample_ids=[1, 2], state=send)
    with pytest.raises(BufferMissError) as miss:
        codec.decode(msg, state=small)
    assert miss.value.sample_ids == [1]


def test_an_abandoned_step_undoes_its_evictions_exactly():
    codec, send, recv = ends(samples=4)
    send_ids(codec, send, recv, [1, 2, 3, 4])
    before = snapshot(send), snapshot(recv), send.buffers.evicted
    for state in (send, recv):
        state.begin_step()
    send_ids(codec, send, recv, [5, 6], 1)
    send_ids(codec, send, recv, [1, 7], 1)
    assert send.buffers.evicted == 4  # 1, 2 for 5, 6; then 3, 4 for 1 (a first sight again) and 7
    for state in (send, recv):
        state.end_step(commit=False)
    for state, (order, ids, rows) in zip((send, recv), before[:2], strict=True):
        now = snapshot(state)
        assert now[0] == order and now[1] == ids and torch.equal(now[2], rows)
    assert send.buffers.evicted == before[2] == 0
    retry, _ = send_ids(codec, send, recv, [5, 6], 1)  # the retry sends what a clean run sends
    _, clean_send, clean_recv = ends(samples=4)
    send_ids(codec, clean_send, clean_recv, [1, 2, 3, 4])
    clean, _ = send_ids(codec, clean_send, clean_recv, [5, 6], 1)
    assert retry.SerializeToString() == clean.SerializeToString()
    assert_same(send, clean_send)


def test_the_budget_bounds_the_bytes_held_in_memory_and_on_disk(tmp_path):
    budget = 5 * SAMPLE_BYTES + SAMPLE_BYTES // 2  # five and a half samples: five fit
    for where in (None, str(tmp_path / "fw.buf")):
        cfg = CodecConfig.parse("acsgd2+ch+fs4", buffer_budget_bytes=budget, buffer_path=where)
        codec, state = make_codec(cfg), LinkState(cfg)
        for start in range(0, 60, 4):
            ids = list(range(start, start + 4))
            codec.encode(torch.stack([sample(i, 0) for i in ids]), sample_ids=ids, state=state)
        store = state.buffers
        assert store.capacity == len(store) == 5
        held = store._data._rows if where is None else store._data
        assert held.numel() * held.element_size() <= budget
        if where is not None:
            assert (tmp_path / "fw.buf").stat().st_size <= budget


def test_a_budget_below_one_sample_sends_every_sample_as_a_first_sight():
    codec, send, recv = ends(samples=0.5)
    with pytest.warns(UserWarning, match="holds no sample"):  # once per store
        send_ids(codec, send, recv, [1, 2])
    msg, out = send_ids(codec, send, recv, [1, 2])
    assert not any(msg.sample_is_delta) and len(send.buffers) == len(recv.buffers) == 0


def test_none_eviction_keeps_the_first_samples():
    codec, send, recv = ends(samples=2, buffer_eviction="none")
    with pytest.warns(UserWarning, match="evicts nothing"):
        send_ids(codec, send, recv, [1, 2, 3])
    msg, _ = send_ids(codec, send, recv, [3, 1])
    assert list(msg.sample_is_delta) == [False, True] and send.buffers.evicted == 0


def test_bad_budgets_and_policies_are_refused():
    with pytest.raises(ValueError, match="buffer_budget_bytes"):
        CodecConfig.parse("acsgd2", buffer_budget_bytes=-1)
    with pytest.raises(ValueError, match="buffer_eviction"):
        CodecConfig.parse("acsgd2", buffer_eviction="fifo")
    _, state, _ = ends()
    state.buffers.admit([1], torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="before its first sample"):
        state.buffers.limit_bytes(10)


def test_the_flag_reaches_both_codecs_and_a_plans_codec():
    built = CodecFlags(buffer_budget_bytes=1 << 20).build()
    assert built["fw_codec"].buffer_budget_bytes == built["bw_codec"].buffer_budget_bytes == 1 << 20
    named = CodecConfig.parse("tern+ch", **built["fw_codec"].local_options())  # a plan's codec for the link
    assert named.buffer_budget_bytes == 1 << 20
    assert CodecFlags.of(built["fw_codec"], built["bw_codec"]).buffer_budget_bytes == 1 << 20


@pytest.fixture(params=["memory", "mmap", "device-cpu"])
def lru_store(request, tmp_path):
    from swarm.compression.buffers import MemoryBufferStore, MmapBufferStore
    from swarm.runtime.device import DeviceBufferStore

    store = {
        "memory": lambda: MemoryBufferStore(4, torch.float16),
        "mmap": lambda: MmapBufferStore(4, torch.float16, tmp_path / "b.buf"),
        "device-cpu": lambda: DeviceBufferStore(4, torch.float16, "cpu"),
    }[request.param]()
    store.eviction = "lru"
    return store


def test_rollback_restores_evicted_rows_and_the_recency_order(lru_store):
    store = lru_store
    store.admit([1, 2, 3, 4], torch.randn(4, 3))
    store.touch([2, 1])
    before = store.recency(), {i: store.get(i).clone() for i in store.ids()}, store.evicted
    store.begin()
    store.admit([5, 6], torch.randn(2, 3))  # evicts 3, 4
    store.scatter(store.lookup([2]), torch.randn(1, 3))
    store.touch([2])
    store.admit([7, 3], torch.randn(2, 3))  # evicts 1, 5; 3 comes back into a reused slot
    assert store.evicted == 4 and store.recency() == [6, 2, 7, 3]
    store.rollback()
    assert store.recency() == before[0] == [3, 4, 2, 1] and store.evicted == before[2]
    assert all(torch.equal(store.get(i), row) for i, row in before[1].items())
    store.admit([8], torch.randn(1, 3))  # the order drives the next eviction as before the step
    assert 3 not in store and store.recency() == [4, 2, 1, 8]
