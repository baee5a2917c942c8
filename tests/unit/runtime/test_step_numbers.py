"""A retry message names the step as steps.csv does too: the wire counts steps from 0, steps.csv from 1."""

import logging

import torch

from swarm.model.gpt import ModelConfig
from swarm.runtime.driver import csv_row
from swarm.runtime.inprocess import LocalPipeline
from swarm.train.steplog import step_row

torch.set_num_threads(1)

CFG = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=32, n_layers=2, n_heads=4, init_seed=1)


def _batch(n: int = 4):
    from swarm.model.data import Batch

    windows = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len_tokens + 1), generator=torch.Generator().manual_seed(0))
    return Batch(torch.arange(n), windows[:, :-1], windows[:, 1:])


def test_the_retry_message_names_the_steps_csv_row(caplog):
    pipe = LocalPipeline(CFG, 2, replicas=2)
    try:
        result = pipe.train_step(_batch(), 2)  # wire step 0
        pipe.kill(1, 1)
        with caplog.at_level(logging.WARNING, logger="swarm.runtime.driver"):
            result = pipe.train_step(_batch(), 2)  # wire step 1: its first attempt loses a replica
        assert result.attempts == 2
        assert f"step 1{csv_row(1)}: attempt 1 failed" in caplog.text
        assert "(steps.csv step 2)" in caplog.text and step_row(result, 1 + 1, 0)["step"] == 2
    finally:
        pipe.close()
