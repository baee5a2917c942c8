"""`swarm demo` end to end in a small form: the README's main job starts its peers, trains, and sums up."""

from __future__ import annotations

import csv
import json

import pytest

pytestmark = pytest.mark.integration


def test_the_demo_trains_and_its_planner_calibrates_the_prediction(tmp_path, capsys):
    from swarm.cli import main

    out = tmp_path / "demo"
    # 4 steps an epoch: the planner's calibration window (steps 4-8) closes inside the run, and its plan reaches
    # the trainer: the planner reads the clocks once a second and the trainer polls the plan once a second, so the
    # run must outlast a few seconds plus DHT latency under load (24 steps, ~4 s, did not on a loaded CI machine)
    args = ["demo", "--json", "--out", str(out), "--epochs", "20", "--train-samples", "32", "--batch-size", "8"]
    assert main([*args, "--save-model", str(tmp_path / "model")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 80 and summary["final_loss"] < summary["first_loss"]
    assert summary["total_ratio_vs_fp32"] > 4
    # the republished plan is the same stages under the next version, with the calibrated prediction
    assert summary["plan_version"] == 2 and summary["predicted_step_s"] > 0
    assert (out / "steps.csv").exists() and (out / "loss.png").exists()
    # issue 28: the demo stops its peers (SIGINT), so each saves its own stage and none takes the others over
    # (a leave at the end left a 2-stage model in one file, layers-0000-0002)
    assert set(summary["peer_exit_codes"].values()) == {0}, summary["peer_exit_codes"]
    ranges = sorted(tuple(map(int, p.stem.split("-")[1:])) for p in (out / "checkpoints").glob("layers-*.safetensors"))
    assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[0][1] == ranges[1][0], ranges
    # held-out evaluation through the peers, forward only: every 20 steps (the default) and after the last
    with open(out / "steps.csv") as f:
        held = {int(r["step"]): r["held_out_loss"] for r in csv.DictReader(f) if r["held_out_loss"]}
    assert sorted(held) == [20, 40, 60, 80]
    assert summary["held_out_step"] == 80 and summary["held_out_loss"] == float(held[80])
    # it learned something that carries over: below the untrained model's loss (32 windows of the standard library's
    # sources for 20 epochs overfit after step 20, so a later held-out point need not be below an earlier one)
    assert 0 < summary["held_out_loss"] < summary["first_loss"] and 0 < float(held[20]) < summary["first_loss"]
    got = _the_saved_model_is_the_runs(tmp_path / "model", out / "checkpoints", summary)
    assert got["train_samples"] == 32 and got["windows"] == "the run's (recorded)"


def _the_saved_model_is_the_runs(model_dir, checkpoints, summary) -> dict:
    """--save-model wrote what the stages ended with: `swarm eval` on it gives the held-out loss of the stages'
    own modules loaded from their final checkpoints (and the run's own held-out loss, where it reports one)."""
    import torch
    from safetensors.torch import load_file

    from swarm.model.gpt import ModelConfig, build_stage
    from swarm.model.heldout import held_out_loss, held_out_windows
    from swarm.train.evaluate import EvalConfig, evaluate_dir

    got = evaluate_dir(EvalConfig(model=str(model_dir)))
    cfg, stages = ModelConfig(), []
    ranges = {tuple(int(n) for n in f.stem.split("-")[1:]): f for f in checkpoints.glob("layers-*.safetensors")}
    chain = [max((r for r in ranges if r[0] == 0), key=lambda r: r[1])]  # one tiling of the layers, longest first
    while chain[-1][1] < cfg.n_layers:
        chain.append(max((r for r in ranges if r[0] == chain[-1][1]), key=lambda r: r[1]))
    for i, (start, end) in enumerate(chain):
        stage = build_stage(cfg, start, end, i == 0, i == len(chain) - 1)
        state = load_file(str(ranges[start, end]))
        stage.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
        stages.append(stage)
    with torch.no_grad():

        def logits(tokens):
            for stage in stages:
                tokens = stage(tokens)
            return tokens

        windows = held_out_windows(None, cfg.seq_len_tokens, got["train_samples"], got["eval_samples"])
        want = held_out_loss(logits, windows)
    assert abs(got["held_out_loss"] - want) <= 1e-4 * want
    if "held_out_loss" in summary:
        assert abs(got["held_out_loss"] - summary["held_out_loss"]) <= 1e-4 * summary["held_out_loss"]
    return got
