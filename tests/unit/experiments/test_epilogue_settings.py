"""The experiments' epilogue-only settings: `FW/BW@epiK` (convergence), `FW/BW@epi` (throttled)."""

import pytest

from swarm.experiments.selective import measure_stage_times, split_epilogue, split_epilogue_tail
from swarm.model.gpt import ModelConfig

D = "acsgd2+ch+nr/gradq2+ef+rot+nr+cs+g1024"
TINY = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=2, n_heads=4, init_seed=1)


def test_epilogue_suffixes_split_off():
    assert split_epilogue_tail(f"{D}@epi1") == (D, 1)
    assert split_epilogue_tail(f"{D}@w1@epi2") == (f"{D}@w1", 2)
    assert split_epilogue_tail(D) == (D, None)
    assert split_epilogue(f"{D}@epi") == (D, True) and split_epilogue(D) == (D, False)
    with pytest.raises(ValueError, match="@epiK"):
        split_epilogue_tail(f"{D}@epix")


def test_the_convergence_setting_carries_its_tail_and_is_not_the_default():
    from swarm.experiments.convergence import ExperimentConfig, _codec_defaults, _parse_setting, is_default_setting

    cfg = ExperimentConfig()
    setting = _parse_setting(f"{D}@epi1", *_codec_defaults(cfg), cfg)
    assert setting.name == f"{D}@epi1" and setting.epilogue_tail == 1
    assert setting.backward.label == _parse_setting(D, *_codec_defaults(cfg), cfg).backward.label
    assert not is_default_setting(setting, *_codec_defaults(cfg))


def test_stage_times_are_measured_for_every_stage():
    times = measure_stage_times(TINY, 2, 2, iters=1)
    assert len(times) == 2 and all(f > 0 and b >= 0 for f, b in times)


def test_a_throttled_epilogue_cell_has_the_live_planner_choose_and_predicts_from_timed_stages(monkeypatch):
    import swarm.experiments.selective as selective
    from swarm.experiments.throttled import Cell, ThrottledConfig, epilogue_choice, peer_config, summarize

    monkeypatch.setattr(selective, "measure_stage_times", lambda *a, **k: [(0.01, 0.02), (0.015, 0.03)])
    epilogue_choice.cache_clear()
    cfg = ThrottledConfig(rates=(1.0,), settings=(f"{D}@epi",))
    peer = peer_config(Cell(1.0, f"{D}@epi"), cfg)
    assert peer.planning.epilogue_only and not peer.bw_epilogue  # the peers' planner chooses (--plan-epilogue-only)
    assert not peer_config(Cell(1.0, D), cfg).planning.epilogue_only
    # the row's prediction: the same rule on this machine's timed stages at the cell's rate
    slow = epilogue_choice(Cell(1.0, f"{D}@epi"), cfg)[0].label()
    fast = epilogue_choice(Cell(None, f"{D}@epi"), cfg)[0].label()
    assert slow == "fp32:4:1f1b:4" and fast.startswith("fp32:") and fast != slow  # 1 Mbit/s: every message exposed
    steps = [{"step_s": "1.0", "train_loss": "2.0", "forward_bytes": "10", "backward_bytes": "5", "step": "1"}]
    summary = {"epilogue": {"tails": "4"}, "bw_epilogue": "fp32:4:1f1b:4"}
    row = summarize(Cell(1.0, f"{D}@epi"), steps, 1, 8, summary)
    assert row["bw_bits"] == 2 and row["tails"] == "4" and row["bw_epilogue"] == "fp32:4:1f1b:4"
