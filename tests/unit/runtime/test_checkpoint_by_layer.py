"""Stage checkpoints found by layer: a restart under another split finds every layer across the files present,
the newest step winning per layer, and names what no file holds."""

from __future__ import annotations

import logging

import pytest
import torch

from swarm.model.gpt import TIED_EMBEDDING, TIED_HEAD, ModelConfig, build_stage, split_layers
from swarm.runtime.checkpoint import (
    checkpoint_path,
    gather_layers,
    layer_unit,
    resume,
    save_worker,
    scan_checkpoints,
)
from swarm.runtime.worker import StageWorker

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=6, n_heads=4, init_seed=3)


def _worker(start: int, end: int, first: bool, last: bool, seed: int = 0) -> StageWorker:
    return StageWorker(build_stage(ModelConfig(**{**CFG.__dict__, "init_seed": seed}), start, end, first, last))


def _trained(start, end, first, last, steps=2, seed=0) -> StageWorker:
    """A stage whose weights and moments no init reproduces."""
    worker = _worker(start, end, first, last)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen) if first else torch.randn(2, 8, 32, generator=gen)
        targets = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen) if last else None
        out = worker.forward(0, x, None, targets)
        worker.backward(0, torch.tensor(1.0) if last else torch.ones_like(out))
        worker.step()
    return worker


def _save_split(directory, n_stages: int, steps_done: int = 2) -> dict[str, torch.Tensor]:
    """Trains and saves every stage of an n-stage split; returns the unsplit model's weights and moments by name
    (the last stage's head copy under its own name)."""
    ranges = split_layers(CFG.n_layers, n_stages)
    state = {}
    for i, (start, end) in enumerate(ranges):
        w = _trained(start, end, i == 0, i == n_stages - 1, seed=i)
        assert save_worker(directory, w, start, end, steps_done=steps_done, plan_version=n_stages)
        state.update({f"model.{k}": v for k, v in w.module.state_dict().items()})
        for name, p in w.module.named_parameters():
            state[f"optim.{name}.exp_avg"] = w.optimizer.state[p]["exp_avg"].clone()
    return state


def _check_loaded(worker: StageWorker, saved: dict[str, torch.Tensor]) -> None:
    for name, value in worker.module.state_dict().items():
        want = saved.get(f"model.{name}")
        if want is None and name == TIED_HEAD:  # a one-stage split's head is its embedding
            want = saved[f"model.{TIED_EMBEDDING}"]
        torch.testing.assert_close(value, want, rtol=0, atol=0, msg=name)
    for name, p in worker.module.named_parameters():
        key = f"optim.{name}.exp_avg"
        want = saved.get(key, saved.get(f"optim.{TIED_EMBEDDING}.exp_avg") if name == TIED_HEAD else None)
        torch.testing.assert_close(worker.optimizer.state[p]["exp_avg"], want, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("saved_as,loaded_as", [(2, 3), (3, 2), (1, 3), (3, 1)])
def test_a_restart_under_another_split_finds_every_layer_with_its_moments(tmp_path, saved_as, loaded_as, caplog):
    saved = _save_split(tmp_path, saved_as)
    ranges = split_layers(CFG.n_layers, loaded_as)
    with caplog.at_level(logging.INFO, logger="swarm.runtime.checkpoint"):
        for i, (start, end) in enumerate(ranges):
            worker = _worker(start, end, i == 0, i == loaded_as - 1, seed=99)  # other weights than the saved ones
            found = resume(tmp_path, worker, start, end)
            assert found is not None and found["steps_done"] == "2" and found["missing"] == ""
            assert worker.step_count == 2  # the schedule's position came back too
            _check_loaded(worker, saved)
    assert "found by layer" in caplog.text and "start from the initial weights" not in caplog.text


def test_the_newest_step_wins_per_layer(tmp_path):
    old = _trained(0, 3, True, False, seed=1)
    save_worker(tmp_path, old, 0, 3, steps_done=4)
    new = _trained(2, 6, False, True, seed=2)  # layer 2 is in both files; this one is newer
    save_worker(tmp_path, new, 2, 6, steps_done=7)
    files = scan_checkpoints(tmp_path)
    middle = {k: v.shape for k, v in build_stage(CFG, 1, 4, False, False).state_dict().items()}
    found = gather_layers(files, middle)
    assert found.missing == []
    assert found.sources["layer 1"].steps_done == 4 and found.sources["layer 2"].steps_done == 7
    assert found.steps_done == 7
    torch.testing.assert_close(
        found.tensors["model.blocks.2.ln1.weight"], new.module.state_dict()["blocks.2.ln1.weight"]
    )
    torch.testing.assert_close(
        found.tensors["model.blocks.1.ln1.weight"], old.module.state_dict()["blocks.1.ln1.weight"]
    )


def test_a_missing_layer_is_named_in_one_error_line_and_the_rest_is_loaded(tmp_path, caplog):
    saved = _save_split(tmp_path, 3)  # [0, 2) [2, 4) [4, 6)
    checkpoint_path(tmp_path, 2, 4).unlink()  # a peer's disk is gone
    worker = _worker(0, 3, True, False, seed=99)
    init = {k: v.clone() for k, v in worker.module.state_dict().items()}
    with caplog.at_level(logging.ERROR, logger="swarm.runtime.checkpoint"):
        found = resume(tmp_path, worker, 0, 3)
    assert found is not None and found["missing"] == "layer 2"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "layers [0, 3) resumed without layer 2" in errors[0], errors
    state = worker.module.state_dict()
    torch.testing.assert_close(state["blocks.1.attn.qkv.weight"], saved["model.blocks.1.attn.qkv.weight"])
    torch.testing.assert_close(state["blocks.2.attn.qkv.weight"], init["blocks.2.attn.qkv.weight"])  # still init


def test_with_no_layer_anywhere_nothing_changes_and_every_layer_is_named(tmp_path, caplog):
    save_worker(tmp_path, _trained(0, 2, True, False), 0, 2, steps_done=1)
    worker = _worker(2, 4, False, False, seed=99)
    before = {k: v.clone() for k, v in worker.module.state_dict().items()}
    with caplog.at_level(logging.ERROR, logger="swarm.runtime.checkpoint"):
        assert resume(tmp_path, worker, 2, 4) is None
    assert "none of layers 2 and 3 is in the 1 checkpoints" in caplog.text
    for k, v in worker.module.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_a_broken_file_among_good_ones_is_skipped_and_named(tmp_path, caplog):
    _save_split(tmp_path, 2)
    (tmp_path / "layers-0000-0006.safetensors").write_bytes(b"\0" * 100)  # a truncated write of another split
    with caplog.at_level(logging.ERROR, logger="swarm.runtime.checkpoint"):
        files = scan_checkpoints(tmp_path)
    assert len(files) == 2 and "layers-0000-0006.safetensors skipped" in caplog.text
    worker = _worker(0, 6, True, True, seed=99)
    assert resume(tmp_path, worker, 0, 6)["missing"] == ""


def test_a_tensor_of_another_shape_does_not_count_as_the_layer(tmp_path):
    wide = ModelConfig(**{**CFG.__dict__, "hidden_dim": 64})
    save_worker(tmp_path, StageWorker(build_stage(wide, 0, 2, True, False)), 0, 2, steps_done=9)
    found = gather_layers(
        scan_checkpoints(tmp_path), {k: v.shape for k, v in build_stage(CFG, 0, 2, True, False).state_dict().items()}
    )
    assert sorted(found.missing) == sorted(["layer 0", "layer 1", "pos_emb.weight", "tok_emb.weight"])
    assert found.missing_text() == "layers 0, 1, pos_emb.weight and tok_emb.weight"


def test_units_are_blocks_for_every_family():
    assert layer_unit("blocks.3.attn.qkv.weight") == "layer 3"
    assert layer_unit("transformer.h.12.mlp.c_fc.bias") == "layer 12"
    assert layer_unit("model.layers.0.self_attn.q_proj.weight") == "layer 0"
    assert layer_unit("tok_emb.weight") == "tok_emb.weight"
    assert layer_unit("transformer.ln_f.weight") == "transformer.ln_f.weight"


def test_a_new_last_stage_taking_over_from_a_one_stage_plan_takes_the_embedding_as_its_head():
    """Live re-plan 1 -> 2 stages: the old stage handed over only `tok_emb.weight`; the new last stage's tied head
    copy is that embedding, with its moments, not its initial weights."""
    from swarm.runtime.checkpoint import handover_tensors, take_over

    old = _trained(0, 6, True, True)
    new = _worker(3, 6, False, True, seed=99)
    count, missing, steps_done = take_over(new, handover_tensors(old, 2))
    assert missing == [] and steps_done == 2 and count == len(new.module.state_dict())
    torch.testing.assert_close(new.module.head_weight, old.module.tok_emb.weight, rtol=0, atol=0)
    want = old.optimizer.state[old.module.tok_emb.weight]["exp_avg"]
    torch.testing.assert_close(new.optimizer.state[new.module.head_weight]["exp_avg"], want, rtol=0, atol=0)
