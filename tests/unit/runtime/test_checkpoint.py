"""Stage checkpoints: weights survive a round trip, and a failed or refused write never costs the old one."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import swarm.runtime.checkpoint as checkpoint
from swarm.model.gpt import ModelConfig, build_stage
from swarm.runtime.checkpoint import checkpoint_path, load_stage, load_worker, resume, save_stage, save_worker
from swarm.runtime.worker import StageConfig, StageWorker

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=3)


def stage_state(cfg: ModelConfig = CFG, start: int = 0, end: int = 2, first: bool = True, last: bool = False):
    return {k: v.detach().clone() for k, v in build_stage(cfg, start, end, first, last).state_dict().items()}


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("start,end,first,last", [(0, 2, True, False), (2, 4, False, True), (0, 4, True, True)])
def test_a_stage_round_trips_exactly_and_loads_into_a_fresh_stage(tmp_path, start, end, first, last):
    trained = build_stage(CFG, start, end, first, last)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))  # weights no init reproduces
    path = checkpoint_path(tmp_path / "new" / "dir", start, end)
    assert path.name == f"layers-{start:04d}-{end:04d}.safetensors"
    assert save_stage(path, {k: v.detach().clone() for k, v in trained.state_dict().items()}, {"steps_done": "7"})

    fresh = build_stage(ModelConfig(**{**CFG.__dict__, "init_seed": 4}), start, end, first, last)
    state = load_stage(path, fresh.state_dict())
    assert_same_state(state, trained.state_dict())
    fresh.load_state_dict(state)
    x = torch.randint(0, CFG.vocab_size, (2, 8)) if first else torch.randn(2, 8, CFG.hidden_dim)
    torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=0)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"steps_done": "7"}


def test_non_contiguous_tensors_are_saved_as_their_values(tmp_path):
    state = {"w": torch.arange(12.0).reshape(3, 4).t()}
    assert not state["w"].is_contiguous()
    path = tmp_path / "stage0.safetensors"
    assert save_stage(path, state, {})
    assert_same_state(load_stage(path, state), state)


def _failing_write(exc: BaseException):
    """A save_file that leaves half a file where it was told to write, then fails with `exc`."""

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)
        raise exc

    return save_file


def test_a_full_disk_keeps_the_previous_checkpoint_and_reports_false(tmp_path, monkeypatch, caplog):
    path = checkpoint_path(tmp_path, 0, 2)
    old = stage_state()
    assert save_stage(path, old, {"steps_done": "1"})
    before = path.read_bytes()

    monkeypatch.setattr(checkpoint, "save_file", _failing_write(OSError(errno.ENOSPC, "No space left on device")))
    with caplog.at_level(logging.ERROR, logger="swarm.runtime.checkpoint"):
        assert save_stage(path, stage_state(ModelConfig(**{**CFG.__dict__, "init_seed": 9})), {}) is False
    assert "No space left on device" in caplog.text and "previous one is kept" in caplog.text
    assert path.read_bytes() == before
    assert_same_state(load_stage(path, old), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # the half-written file is gone


def test_a_safetensors_write_error_is_a_refused_checkpoint_naming_path_and_disk(tmp_path, monkeypatch, caplog):
    from safetensors import SafetensorError

    path = checkpoint_path(tmp_path, 0, 2)
    old = stage_state()
    assert save_stage(path, old, {})
    full = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    monkeypatch.setattr(checkpoint, "save_file", _failing_write(full))
    with caplog.at_level(logging.ERROR, logger="swarm.runtime.checkpoint"):
        assert save_stage(path, stage_state(ModelConfig(**{**CFG.__dict__, "init_seed": 9})), {}) is False
    assert str(path) in caplog.text and "StorageFull" in caplog.text and "the disk mounted at" in caplog.text
    assert_same_state(load_stage(path, old), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no partial file


def test_on_a_really_full_disk_a_checkpoint_is_refused_and_the_previous_one_kept(tmp_path, caplog):
    from tests.unit.full_disk import fill, tiny_disk

    small = {"w": torch.arange(64.0)}
    with tiny_disk(tmp_path, size_kib=64) as disk:
        path = checkpoint_path(disk, 0, 2)
        assert save_stage(path, small, {"steps_done": "1"})
        fill(disk)
        with caplog.at_level(logging.ERROR, logger="swarm.runtime.checkpoint"):
            assert save_stage(path, {"w": torch.zeros(4096)}, {"steps_done": "2"}) is False  # no exception
        assert f"the disk mounted at {disk}" in caplog.text
        assert_same_state(load_stage(path, small), small)
        assert not path.with_suffix(".tmp").exists()


def test_a_write_that_fails_otherwise_raises_and_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path, 0, 2)
    old = stage_state()
    assert save_stage(path, old, {})
    monkeypatch.setattr(checkpoint, "save_file", _failing_write(RuntimeError("serializer failed")))
    with pytest.raises(RuntimeError, match="serializer failed"):
        save_stage(path, stage_state(ModelConfig(**{**CFG.__dict__, "init_seed": 9})), {})
    assert_same_state(load_stage(path, old), old)


def test_a_refused_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path, 0, 2)
    old = stage_state()
    assert save_stage(path, old, {})

    def refuse(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(checkpoint.os, "replace", refuse)
    assert save_stage(path, stage_state(ModelConfig(**{**CFG.__dict__, "init_seed": 9})), {}) is False
    assert_same_state(load_stage(path, old), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_loading_into_a_stage_of_other_widths_names_the_tensor_and_both_shapes(tmp_path):
    path = checkpoint_path(tmp_path, 0, 2)
    assert save_stage(path, stage_state(), {})
    wider = stage_state(ModelConfig(**{**CFG.__dict__, "hidden_dim": 48}))
    with pytest.raises(ValueError, match=r"tok_emb.weight has shape \[64, 32\], expected \[64, 48\]"):
        load_stage(path, wider)


def test_loading_into_a_stage_of_other_layers_lists_what_is_missing_and_unexpected(tmp_path):
    path = checkpoint_path(tmp_path, 0, 2)
    assert save_stage(path, stage_state(start=0, end=2, first=True, last=False), {})
    other = stage_state(start=2, end=4, first=False, last=True)
    with pytest.raises(ValueError, match="does not match this stage") as refused:
        load_stage(path, other)
    message = str(refused.value)
    assert "'blocks.2." in message.split("unexpected")[0]  # missing: the other stage's blocks
    assert "'tok_emb.weight'" in message.split("unexpected")[1]  # unexpected: this checkpoint's embeddings


def _trained_worker(start: int, end: int, steps: int, seed: int = 0) -> StageWorker:
    torch.manual_seed(seed)
    first, last = start == 0, end == CFG.n_layers
    worker = StageWorker(build_stage(CFG, start, end, first, last), StageConfig())
    for _ in range(steps):
        _one_step(worker, first, last, seed)
    return worker


def _one_step(worker: StageWorker, first: bool, last: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen) if first else torch.randn(2, 8, 32, generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen) if last else None
    out = worker.forward(0, x, None, targets)
    worker.backward(0, torch.tensor(1.0) if last else torch.ones_like(out))
    worker.step()


@pytest.mark.parametrize("start,end", [(0, 2), (2, 4)])
def test_a_resumed_stage_takes_the_same_next_step_as_the_one_that_never_stopped(tmp_path, start, end):
    """Weights, AdamW's moments and the learning-rate schedule's position all come back: the next step of a
    resumed stage equals the next step of the original, bit for bit."""
    original = _trained_worker(start, end, steps=3)
    path = save_worker(tmp_path, original, start, end, steps_done=3, plan_version=5)
    assert path == checkpoint_path(tmp_path, start, end)
    restarted = _trained_worker(start, end, steps=0, seed=1)  # other weights, empty optimizer
    meta = load_worker(path, restarted, start, end)
    assert (meta["steps_done"], meta["lr_step"], meta["plan_version"]) == ("3", "3", "5")
    assert restarted.step_count == original.step_count == 3
    first, last = start == 0, end == CFG.n_layers
    _one_step(original, first, last, seed=7)
    _one_step(restarted, first, last, seed=7)
    assert_same_state(restarted.module.state_dict(), original.module.state_dict())


def test_a_checkpoint_of_other_layers_or_a_broken_file_is_reported_and_skipped(tmp_path, caplog):
    worker = _trained_worker(0, 2, steps=1)
    before = {k: v.clone() for k, v in worker.module.state_dict().items()}
    other = _trained_worker(2, 4, steps=1)
    save_worker(tmp_path, other, 2, 4, steps_done=1)
    # the other stage's file put where this stage's belongs (a stale copy, a manual mistake)
    checkpoint_path(tmp_path, 2, 4).rename(checkpoint_path(tmp_path, 0, 2))
    with caplog.at_level(logging.ERROR, logger="swarm.runtime.checkpoint"):
        assert resume(tmp_path, worker, 0, 2) is None
    assert "holds layers [2, 4), not [0, 2)" in caplog.text
    checkpoint_path(tmp_path, 0, 2).write_bytes(b"not a safetensors file")
    assert resume(tmp_path, worker, 0, 2) is None
    assert resume(tmp_path / "empty", worker, 0, 2) is None
    assert_same_state(worker.module.state_dict(), before)  # nothing was loaded


def test_a_stage_taken_over_keeps_its_moments_and_schedule_and_ignores_other_layers():
    """What GetState hands over (weights, AdamW moments, lr step, steps done) makes the new holder's next step
    the one the old holder would have taken; tensors of layers it does not hold are left out."""
    from swarm.runtime.checkpoint import handover_tensors, take_over

    old = _trained_worker(0, 2, steps=3)
    neighbour = _trained_worker(2, 4, steps=3)
    new = _trained_worker(0, 2, steps=0, seed=1)
    count, missing, steps_done = take_over(new, {**handover_tensors(neighbour, 3), **handover_tensors(old, 3)})
    assert (count, missing, steps_done) == (len(old.module.state_dict()), [], 3)
    assert new.step_count == 3
    _one_step(old, True, False, seed=7)
    _one_step(new, True, False, seed=7)
    assert_same_state(new.module.state_dict(), old.module.state_dict())


def test_a_dead_holders_checkpoint_is_its_handover(tmp_path):
    from swarm.runtime.checkpoint import checkpoint_handover, take_over

    old = _trained_worker(2, 4, steps=2)
    save_worker(tmp_path, old, 2, 4, steps_done=2)
    new = _trained_worker(2, 4, steps=0, seed=1)
    assert take_over(new, checkpoint_handover(tmp_path, 2, 4))[2] == 2
    _one_step(old, False, True, seed=7)
    _one_step(new, False, True, seed=7)
    assert_same_state(new.module.state_dict(), old.module.state_dict())
    with pytest.raises(OSError):
        checkpoint_handover(tmp_path, 0, 2)


def test_a_handover_travels_split_by_byte_significance_and_arrives_bit_for_bit():
    """GetState's frames (`named_state_items`): weights and AdamW moments compressed losslessly, so a held copy
    paced at a share of a slow link holds it less long."""
    from swarm.compression import CodecConfig, Unframer, make_codec
    from swarm.proto import wire_pb2
    from swarm.runtime.checkpoint import handover_tensors
    from swarm.runtime.service import named_state_items

    tensors = handover_tensors(_trained_worker(0, 2, steps=3), 3)
    items = list(named_state_items(tensors, chunk_bytes=64 << 10))
    fp32 = make_codec(CodecConfig("fp32"))
    unframers: dict[str, Unframer] = {}
    got, splits = {}, 0
    for item in items:
        splits += item.chunk.header.compression == wire_pb2.ZSTD_SPLIT
        msg = unframers.setdefault(item.name, Unframer()).feed(item.chunk)
        if msg is not None:
            got[item.name] = fp32.decode(msg)
    assert got.keys() == tensors.keys() and splits > 0
    for name, tensor in tensors.items():
        assert torch.equal(got[name].view(tensor.shape), tensor.float()), name
    raw = sum(t.numel() * 4 for t in tensors.values())
    assert sum(len(item.chunk.data) for item in items) < 0.9 * raw
