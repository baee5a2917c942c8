"""`swarm bench model`: per-stage throughput and boundary bytes measured on a tiny model of each family."""

from __future__ import annotations

import pytest
import torch

from swarm.bench.model import bench_model
from swarm.model.spec import resolve_model

torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_bench_model_measures_every_stage_and_the_boundary(name):
    model = resolve_model(name, seq_len_tokens=32)
    r = bench_model(model, 3, 2, 1, 1e-4, "acsgd2+ch+nr", "gradq2+ef+rot+nr+cs+g1024")
    assert [s["layers"] for s in r["stages"]] == [[0, 1], [1, 2], [2, 3]]
    assert all(s["tokens_per_s"] > 0 and s["parameters"] > 0 for s in r["stages"])
    b = r["boundary_bytes_per_token"]
    # fp32: 4 bytes per element of the hidden size, framed; the codecs send a fraction of it
    assert 3 * model.hidden_dim <= b["fp32_forward"] < 6 * model.hidden_dim  # zstd shaves a little
    assert b["codec_forward_steady"] < b["codec_forward_first_sight"] <= b["fp32_forward"]
    assert b["codec_backward"] < b["fp32_backward"] / 4
    assert 0 < r["codecs_network_bound_below_mbit"] < r["fp32_network_bound_below_mbit"]


def test_bench_model_cli_refuses_more_stages_than_layers(capsys):
    from swarm.cli import main

    with pytest.raises(SystemExit, match="--stages 9: expected 1..3"):
        main(["bench", "model", "--model", "llama-tiny", "--stages", "9"])
