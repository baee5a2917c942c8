"""`swarm experiment finetune --quick`: a local Hugging Face checkpoint (llama-tiny, sharded) with a tokenizer
trained on the local corpus, fine-tuned over a local swarm of 3 swarm-peer processes with the default codecs;
the loss decreases and no peer holds all layers. The processes are reaped by the experiment's process group."""

from __future__ import annotations

import pytest

from swarm.experiments.finetune import FinetuneConfig, parameters_by_stage, run_finetune

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []


def test_quick_finetune_over_three_peers(tmp_path):
    cfg = FinetuneConfig(
        model="llama-tiny", peers=3, steps=8, seq_len=32, batch_size=4, micro_batches=2, train_samples=16,
        lr=3e-3, shard_mb=0,
    )  # fmt: skip
    result = run_finetune(cfg, tmp_path, say=lambda *_: None)
    assert result["steps"] == 8 and result["loss_decreased"] and result["no_peer_holds_all_layers"]
    assert [p["layers"] for p in result["peers"]] == [[0, 1], [1, 2], [2, 3]]
    assert sum(p["parameters"] for p in result["peers"]) == result["total_parameters"]
    assert len(list((tmp_path / "checkpoint").glob("*.safetensors"))) > 1  # sharded, with an index
    assert parameters_by_stage(tmp_path / "checkpoint", [(0, 3)]) == [result["total_parameters"]]
