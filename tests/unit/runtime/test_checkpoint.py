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
from swarm.runtime.checkpoint import checkpoint_path, load_stage, save_stage

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
    path = checkpoint_path(tmp_path / "new" / "dir", 1)
    assert path.name == "stage1.safetensors"
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
    path = checkpoint_path(tmp_path, 0)
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


def test_a_write_that_fails_otherwise_raises_and_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path, 0)
    old = stage_state()
    assert save_stage(path, old, {})
    monkeypatch.setattr(checkpoint, "save_file", _failing_write(RuntimeError("serializer failed")))
    with pytest.raises(RuntimeError, match="serializer failed"):
        save_stage(path, stage_state(ModelConfig(**{**CFG.__dict__, "init_seed": 9})), {})
    assert_same_state(load_stage(path, old), old)


def test_a_refused_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path, 0)
    old = stage_state()
    assert save_stage(path, old, {})

    def refuse(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(checkpoint.os, "replace", refuse)
    assert save_stage(path, stage_state(ModelConfig(**{**CFG.__dict__, "init_seed": 9})), {}) is False
    assert_same_state(load_stage(path, old), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_loading_into_a_stage_of_other_widths_names_the_tensor_and_both_shapes(tmp_path):
    path = checkpoint_path(tmp_path, 0)
    assert save_stage(path, stage_state(), {})
    wider = stage_state(ModelConfig(**{**CFG.__dict__, "hidden_dim": 48}))
    with pytest.raises(ValueError, match=r"tok_emb.weight has shape \[64, 32\], expected \[64, 48\]"):
        load_stage(path, wider)


def test_loading_into_a_stage_of_other_layers_lists_what_is_missing_and_unexpected(tmp_path):
    path = checkpoint_path(tmp_path, 0)
    assert save_stage(path, stage_state(start=0, end=2, first=True, last=False), {})
    other = stage_state(start=2, end=4, first=False, last=True)
    with pytest.raises(ValueError, match="does not match this stage") as refused:
        load_stage(path, other)
    message = str(refused.value)
    assert "'blocks.2." in message.split("unexpected")[0]  # missing: the other stage's blocks
    assert "'tok_emb.weight'" in message.split("unexpected")[1]  # unexpected: this checkpoint's embeddings
