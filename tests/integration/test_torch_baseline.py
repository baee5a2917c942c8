"""The torch.distributed.pipelining baseline of the throttled experiment: same math as swarm's fp32 pipeline,
bytes counted from the tensors, every rank reaped on failure and on a deadline. Loopback, unshaped, seconds."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from swarm.experiments.throttled import ThrottledConfig
from swarm.experiments.torch_baseline import (
    NETNS_PREFIX,
    SETTING,
    TorchRun,
    _free_port,
    _refuse_pickled_objects,
    main,
    run_torch,
    run_torch_rows,
)
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.model.gpt import ModelConfig
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import OptimConfig, StageConfig
from swarm.testbed.netns import list_links, list_namespaces, unavailable_reason

ROW_KEYS = {
    "rate_mbit", "setting", "mean_step_s", "first_epoch_step_s", "throughput_samples_per_s", "wire_bytes",
    "total_wire_bytes", "final_loss", "steps",
}  # fmt: skip


def _running(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions `marker` (a test's own folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmdline and state not in ("Z", "X"):
                pids.append(int(entry.name))
    return pids


def _swarm_fp32_losses(cfg: ThrottledConfig) -> list[float]:
    """swarm's in-process fp32 pipeline on the cells' model, data, split and optimizer."""
    model = ModelConfig()
    optim = OptimConfig(total_steps=cfg.steps, warmup_steps=max(1, cfg.steps // 10))
    pipe = LocalPipeline(model, cfg.peers, schedule="1f1b", stage_cfg=StageConfig(optim))
    train, _, _ = build_datasets(
        DataConfig(seq_len_tokens=model.seq_len_tokens, train_samples=cfg.train_samples, eval_samples=0)
    )
    per_epoch = cfg.train_samples // cfg.batch_size
    losses = []
    try:
        for step in range(cfg.steps):
            epoch, index = divmod(step, per_epoch)
            batch = list(epoch_batches(train, cfg.batch_size, epoch, 0))[index]
            losses.append(pipe.train_step(batch, cfg.micro_batches).loss)
    finally:
        pipe.close()
    return losses


def test_rows_match_swarm_fp32_and_count_the_tensors(tmp_path):
    cfg = ThrottledConfig(steps=3, train_samples=16, batch_size=8, micro_batches=4)
    rows = run_torch_rows(cfg, [None], tmp_path, say=lambda _: None)
    assert len(rows) == 1
    row = rows[0]
    assert row.keys() >= ROW_KEYS
    assert row["setting"] == SETTING and row["rate_mbit"] is None and row["steps"] == 3
    assert math.isfinite(row["final_loss"]) and row["mean_step_s"] > 0

    records = [json.loads(x) for x in (tmp_path / "unshaped-torch-fp32" / "rank1.jsonl").read_text().splitlines()]
    torch_losses = [r["loss"] for r in records]
    swarm_losses = _swarm_fp32_losses(cfg)
    # the same model, data and first step: the same first loss; later steps go through the same optimizer
    # (torch scales the gradients by 1/n_micro after summing them, swarm weights each micro-batch's loss)
    assert torch_losses[0] == pytest.approx(swarm_losses[0], abs=1e-6)
    assert torch_losses == pytest.approx(swarm_losses, abs=1e-4)
    assert torch_losses[-1] < torch_losses[0]

    m = ModelConfig()
    activations = cfg.batch_size * m.seq_len_tokens * m.hidden_dim * 4  # one step's, one direction, fp32
    assert row["wire_bytes"] == cfg.steps * 2 * activations
    tied = m.vocab_size * m.hidden_dim * 4
    assert row["total_wire_bytes"] == row["wire_bytes"] + cfg.steps * (2 * tied + 2 * 8)
    assert 0 < row["schedule_step_s"] + row["sync_step_s"] <= row["mean_step_s"]
    assert not _running(str(tmp_path))


@pytest.mark.netns
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"no namespaces: {unavailable_reason()}")
def test_netns_rows_are_shaped_and_the_namespaces_removed(tmp_path):
    cfg = ThrottledConfig(steps=2, train_samples=8, batch_size=8, micro_batches=4, netns=True)
    rows = run_torch_rows(cfg, [4.0], tmp_path, say=lambda _: None)
    # 1 MB of activations and gradients per step plus the tied sum's 0.26 MB: at 4 Mbit/s (0.5 MB/s), each
    # direction's 0.66 MB needs over 1.3 s, far above the unshaped step (a quarter second)
    assert rows[0]["rate_mbit"] == 4.0 and rows[0]["mean_step_s"] > 1.2
    assert not list_namespaces(NETNS_PREFIX) and not list_links(NETNS_PREFIX)
    assert not _running(str(tmp_path))


def test_a_failed_rank_stops_the_run_and_every_rank_is_reaped(tmp_path):
    run = TorchRun(steps=2, train_samples=8, batch_size=8, micro_batches=2, timeout_s=300)
    # rank 1 dies at once; rank 0 would wait 300 s in gloo's rendezvous unless the runner stops it
    places = [([], "lo"), ([sys.executable, "-c", "raise SystemExit(3)"], "lo")]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with 3"):
        run_torch(run, tmp_path, places, f"127.0.0.1:{_free_port()}", deadline_s=120)
    assert time.monotonic() - started < 60
    assert not _running(str(tmp_path))


def test_a_hung_rank_times_out_and_every_rank_is_reaped(tmp_path):
    run = TorchRun(steps=2, train_samples=8, batch_size=8, micro_batches=2, timeout_s=300)
    hang = [sys.executable, "-c", "import select; select.select([], [], [])"]  # never exits by itself
    places = [(hang, "lo"), (hang, "lo")]
    with pytest.raises(TimeoutError, match="still running after 2 s"):
        run_torch(run, tmp_path, places, "127.0.0.1:1", deadline_s=2)
    assert not _running(str(tmp_path))


def test_bad_runs_are_refused():
    with pytest.raises(ValueError, match="at least 2 stages"):
        TorchRun(stages=1)
    with pytest.raises(ValueError, match="micro_batches must divide"):
        TorchRun(batch_size=8, micro_batches=3)
    with pytest.raises(SystemExit):
        main(["--rank", "5", "--master", "127.0.0.1:1", "--run", json.dumps({"stages": 2}), "--out", os.devnull])


def test_object_collectives_are_refused_in_the_ranks():
    # the ranks patch torch.distributed like this before anything connects: no peer's bytes are unpickled
    import types

    fake = types.SimpleNamespace()
    _refuse_pickled_objects(fake)
    for name in ("recv_object_list", "broadcast_object_list", "all_gather_object"):
        with pytest.raises(RuntimeError, match="unpickle"):
            getattr(fake, name)([None])
