"""A real loopback swarm: a bootstrap node and swarm-peer processes found through the DHT.

With fp32 codecs the trainer's losses equal the in-process pipeline's step for step; when a stage's peer is
killed mid-run, `swarm train` names that stage and peer and exits non-zero. Every process is reaped.
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time

import pytest
import torch

from swarm.compression import CodecConfig
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.inprocess import LocalPipeline
from swarm.testbed.local import local_swarm
from tests.integration.swarm_fixtures import TINY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL_FLAGS = ["--layers", "3", "--hidden", "32", "--heads", "2", "--seq-len", "16"]


def test_fp32_swarm_matches_in_process_pipeline_step_for_step(tmp_path):
    train, _, _ = build_datasets(DataConfig(seq_len_tokens=16, train_samples=16, eval_samples=0))
    data = list(epoch_batches(train, 8, 0, 0)) + list(epoch_batches(train, 8, 1, 0))
    fp32 = CodecConfig("fp32")
    local = LocalPipeline(TINY, 2, fp32, fp32, "1f1b")
    expected = [local.train_step(b, 2).loss for b in data]
    with local_swarm(tmp_path, 2, [*MODEL_FLAGS, "--fw-codec", "fp32", "--bw-codec", "fp32"]) as swarm:
        pipe = PipelineDriver(
            swarm.route,
            swarm.peers,
            "1f1b",
            n_micro=2,
            deadline_s=60,
            plan_version=swarm.plan_version,
            signer=swarm.signer,  # the trainer the plan names: stages serve no one else
        )
        results = [pipe.train_step(step, b) for step, b in enumerate(data)]
        got = [r.loss for r in results]
        pipe.close()
        codes = swarm.procs.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # the tied embedding's gradient goes stage 0 <-> last stage once each way (fp32 here, zstd'd), no trainer hop,
    # and is counted on link "tied" and in the totals
    embedding_bytes = 4 * TINY.vocab_size * TINY.hidden_dim
    assert all(0 < r.sync_bytes < 2 * embedding_bytes + 400 for r in results)
    assert all(r.traffic.tied_fp32_bytes == 2 * embedding_bytes for r in results)
    parts = [r.forward_bytes + r.backward_bytes + r.sync_bytes + r.reduce_bytes + r.control_bytes for r in results]
    assert [r.total_wire_bytes for r in results] == parts
    assert codes["peer0"] == 0 and codes["peer1"] == 0, "peers must shut down cleanly on SIGTERM"


def test_trainer_names_the_stage_whose_peer_died_and_goes_on_on_the_survivors_plan(tmp_path):
    """Issue 12: a dead stage peer no longer ends the run. The one-chain trainer names the stage and peer and
    waits for the survivors' new plan (the survivor alone, one stage), and finishes every step once."""
    with local_swarm(tmp_path, 2, [*MODEL_FLAGS, "--rate-mbit", "20"]) as swarm:
        procs, route, peers = swarm.procs, swarm.route, swarm.peers
        trainer = subprocess.Popen(
            [
                sys.executable, "-m", "swarm.cli", "train", "--address-file", str(tmp_path / "bootstrap.addr"),
                *MODEL_FLAGS, "--train-samples", "16", "--epochs", "100",
                "--deadline-s", "20", "--out", str(tmp_path / "train"),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        watcher = PipelineDriver(route, peers)
        try:
            deadline = time.monotonic() + 120
            # kill stage 1's peer once training is well under way, so the kill lands mid-run
            while watcher.status()[1].steps_done < 3:
                assert time.monotonic() < deadline and trainer.poll() is None, "training never got going"
                procs.check_alive()
                time.sleep(0.1)  # poll interval; the condition above is what synchronizes
            stage1 = next(
                name for name in ("peer0", "peer1") if f"joined the DHT as {peers[1]}" in procs.tail(name, 1000)
            )
            procs.procs[stage1].send_signal(signal.SIGKILL)
            _, err = trainer.communicate(timeout=90)
        finally:
            watcher.close()
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait(10)
    assert trainer.returncode == 0, err[-2000:]
    # the trainer either met the dead peer (it names stage 1 and waits) or the survivor's plan first (refused)
    assert f"stage 1 (peer {peers[1]}" in err or "plan 3:" in err, err[-2000:]
    with open(tmp_path / "train" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1)), "every step ran exactly once"
    assert int(rows[-1]["plan_version"]) > int(rows[0]["plan_version"]), "the end ran on the survivors' plan"
