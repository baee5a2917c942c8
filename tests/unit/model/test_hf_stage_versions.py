"""A GPT-2 stage computes the same under transformers 4 (a block returns a tuple) and 5 (the tensor itself): the
GPU machine's image carries transformers 5 while this project pins 4 (scripts/gpu-device-run.sh)."""

from __future__ import annotations

import torch

from swarm.model.hf import hf_model_config
from swarm.model.spec import build_stage


def test_a_gpt2_stage_takes_a_block_output_as_a_tuple_or_as_the_tensor():
    cfg = hf_model_config("gpt2-tiny")
    stage = build_stage(cfg, 0, cfg.n_layers, True, True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = stage(tokens)
        for block in stage.transformer.h.values():
            forward = block.forward

            def as_tensor(*args, forward=forward, **kwargs):
                out = forward(*args, **kwargs)
                return out[0] if isinstance(out, tuple) else out

            block.forward = as_tensor
        assert torch.equal(stage(tokens), expected)
