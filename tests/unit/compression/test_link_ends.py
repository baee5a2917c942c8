"""A stage's link ends: one buffer file per end under --buffer-dir, and sending ends per destination."""

from __future__ import annotations

import argparse

import pytest
import torch

from swarm.compression import MmapBufferStore
from swarm.options import codec_configs
from swarm.runtime.boundary import MAX_DESTINATIONS, LinkEnds, send_file


def stage_links(buffer_dir=None) -> LinkEnds:
    args = argparse.Namespace(
        fw_codec="aqsgd2", bw_codec="gradq4", group_size=64, zstd_level=1, codec_seed=0, buffer_dir=buffer_dir
    )
    return LinkEnds(*codec_configs(args))


def send(sender, receiver, address: str, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """One activation from `sender` to the stage at `address` (`receiver`), through their codec states."""
    end = sender.send_end("fw", address)
    msg = end.codec.encode(x, sample_ids=ids, state=end.state)
    return receiver.forward_recv.codec.decode(msg, state=receiver.forward_recv.state)


def same(a, b) -> bool:
    return sorted(a.ids()) == sorted(b.ids()) and all(torch.equal(a.get(s), b.get(s)) for s in a.ids())


def test_a_middle_stage_maps_one_file_per_end_and_both_stay_in_step(tmp_path):
    first, middle, last = stage_links(tmp_path / "a"), stage_links(tmp_path / "b"), stage_links(tmp_path / "c")
    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(6, 4, 32, generator=gen)
    for t in range(6):
        ids = [(t + i) % 6 for i in range(3)]
        x = acts[ids] + 0.01 * t
        y = send(first, middle, "middle:1", x, ids)
        send(middle, last, "last:1", torch.tanh(y) * 2, ids)  # what the middle stage computes and sends on
    [to_middle], [to_last] = first.send_ends("fw"), middle.send_ends("fw")
    recv, sent = middle.forward_recv.buffers, to_last.buffers
    assert isinstance(recv, MmapBufferStore) and isinstance(sent, MmapBufferStore)
    assert recv.path != sent.path  # before the fix both were <dir>/fw.buf: one overwrote the other
    assert {recv.path.name, sent.path.name} == {"fw-recv.buf", send_file("fw", "last:1")}
    assert same(to_middle.buffers, recv) and same(sent, last.forward_recv.buffers)
    assert middle.buffered_samples() == len(recv) + len(sent) == 12


def test_a_send_to_another_address_leaves_the_next_stages_buffers_alone():
    stage, nxt, stranger = stage_links(), stage_links(), stage_links()
    x, ids = torch.randn(3, 4, 32), [1, 2, 3]
    send(stage, nxt, "next:1", x, ids)
    before = {s: stage.send_end("fw", "next:1").buffers.get(s).clone() for s in ids}
    for t in range(3):  # a caller names another route: its own end moves, not next:1's
        send(stage, stranger, "evil:6666", x + t, ids)
    assert all(torch.equal(before[s], stage.send_end("fw", "next:1").buffers.get(s)) for s in ids)
    y = send(stage, nxt, "next:1", x + 0.01, ids)  # still deltas, still in step
    assert same(stage.send_end("fw", "next:1").buffers, nxt.forward_recv.buffers)
    assert (y - (x + 0.01)).abs().max() < 0.1
    stage.forget([1], "evil:6666")
    assert 1 in stage.send_end("fw", "next:1").buffers and 1 not in stage.send_end("fw", "evil:6666").buffers
    assert stage.buffered_samples() == stage.send_buffers("fw") == 3 + 2  # it receives nothing itself
    assert stage.send_buffers("bw") is None


def test_sending_ends_are_bounded_per_kind_and_a_dropped_one_starts_over(tmp_path):
    stage = stage_links(tmp_path)
    receivers = {f"peer{i}:1": stage_links() for i in range(MAX_DESTINATIONS + 1)}
    x, ids = torch.randn(2, 4, 32), [5, 6]
    for address, receiver in receivers.items():
        send(stage, receiver, address, x, ids)
    ends = stage.send_ends("fw")
    assert len(ends) == MAX_DESTINATIONS
    assert not (tmp_path / send_file("fw", "peer0:1")).exists()  # the least recently used, dropped
    assert (tmp_path / send_file("fw", f"peer{MAX_DESTINATIONS}:1")).exists()
    end = stage.send_end("fw", "peer0:1")  # back again: a fresh end, whose first message is in full
    msg = end.codec.encode(x, sample_ids=ids, state=end.state)
    assert not any(msg.sample_is_delta)
    receivers["peer0:1"].forward_recv.codec.decode(msg, state=receivers["peer0:1"].forward_recv.state)
    assert same(end.buffers, receivers["peer0:1"].forward_recv.buffers)
    assert len(stage.send_ends("fw")) == MAX_DESTINATIONS
    with pytest.raises(ValueError, match="kind"):
        stage.send_end("sideways", "peer0:1")


def test_addresses_that_read_alike_get_their_own_files():
    assert send_file("fw", "a:1") != send_file("fw", "a_1")
    assert "/" not in send_file("fw", "../../etc/passwd") and send_file("bw", "x").startswith("bw-send-")


def test_a_drifted_receiver_is_repaired_inside_a_running_pipeline():
    from swarm.compression import CodecConfig
    from swarm.model.data import Batch
    from swarm.model.gpt import ModelConfig
    from swarm.runtime.inprocess import LocalPipeline

    model = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=2, n_heads=4, init_seed=1)
    pipe = LocalPipeline(model, 2, CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4"))
    windows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = Batch(torch.arange(4), windows[:, :-1], windows[:, 1:])
    for _ in range(2):
        pipe.train_step(batch, n_micro=1)
    recv = pipe.hosts[1].links.forward_recv.buffers
    recv.scatter(recv.lookup([2]), recv.get(2).unsqueeze(0).float() + 0.5)  # one row goes bad
    [to_next] = pipe.hosts[0].links.send_ends("fw")
    assert not same(to_next.buffers, recv)
    result = pipe.train_step(batch, n_micro=1)  # the digest disagrees: refused, re-sent in full, served
    assert torch.isfinite(torch.tensor(result.loss))
    assert same(to_next.buffers, recv)
    pipe.train_step(batch, n_micro=1)  # and deltas again from there
    assert same(to_next.buffers, recv)
