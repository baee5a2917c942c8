"""`swarm experiment freezing` on processes: the pretrained state every peer loads (swarm.experiments.freezing_live)."""

from __future__ import annotations

import pytest
import torch

from swarm.experiments.freezing import byte_llama
from swarm.experiments.freezing_live import write_checkpoint
from swarm.model.hf import hf_model_config
from swarm.model.hf_stage import build_hf_stage
from swarm.model.hf_weights import load_stage_weights


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_stage_loads_exactly_the_pretrained_weights_from_the_written_checkpoint(tmp_path, tied):
    model = byte_llama(3, 32, 16, seed=0, tied=tied)
    whole = build_hf_stage(model, 0, 3, True, True)
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn_like(p))  # "pretrained": anything but the seeded init
    weights = dict(whole.named_parameters())
    if tied:  # a pipeline's last stage holds its own copy of the head, equal to the embedding
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].detach().clone()
    checkpoint = write_checkpoint(model, weights, tmp_path / "checkpoint")
    loaded = hf_model_config(str(checkpoint), seq_len_tokens=16)
    assert loaded.n_layers == 3 and loaded.tied_embeddings == tied and loaded.weights_dir is not None
    for start, end in ((0, 1), (1, 3)):
        stage = build_hf_stage(loaded, start, end, start == 0, end == 3)
        load_stage_weights(stage, loaded)
        for name, p in stage.named_parameters():
            source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            torch.testing.assert_close(p, weights[source], rtol=0, atol=0, msg=name)


def test_the_quick_form_runs_on_processes_by_default_with_room_for_a_repack():
    import argparse

    from swarm.daemon.repack import repack_layout
    from swarm.experiments.freezing import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    live = config_from_args(parser.parse_args(["--quick"]))
    one = config_from_args(parser.parse_args(["--quick", "--in-process"]))
    assert not live.in_process and one.in_process and one.n_stages == 2
    # 4 peers of one layer: the cap (3 of 4 layers) repacks them onto 2 stages of 2 replicas, stage 0 all frozen
    cap = int(live.max_fraction * live.n_layers)
    assert live.n_stages == live.n_layers == 4 and cap == 3
    assert repack_layout(live.n_layers, cap, live.n_stages, 1.0, live.n_stages) == ([(0, 3), (3, 4)], [2, 2])
