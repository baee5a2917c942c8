"""Samples cut from a tokenizer's ids: windows of token ids with stable ids, the same in every process; the
byte-level default is unchanged (tests/unit/test_data.py)."""

from __future__ import annotations

import pytest
import torch

from swarm.model.data import BYTES_PER_TOKEN_READ, DataConfig, build_datasets
from swarm.model.hf import load_tokenizer, train_tokenizer

torch.set_num_threads(1)

PROSE = "The quick brown fox jumps over the lazy dog while the swarm trains a model over slow links. " * 60


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text(PROSE)
    tokenizer = root / "tokenizer.json"
    train_tokenizer([PROSE], 300, tokenizer)
    return corpus, tokenizer


def test_samples_are_windows_of_the_tokenizers_ids_with_stable_ids(corpus_and_tokenizer):
    corpus, tokenizer = corpus_and_tokenizer
    cfg = DataConfig(path=str(corpus), seq_len_tokens=16, train_samples=None, eval_samples=4, tokenizer=str(tokenizer))
    train, evals, report = build_datasets(cfg)
    again, again_evals, _ = build_datasets(cfg)
    text = PROSE.encode()
    tail = 4 * 17 * BYTES_PER_TOKEN_READ  # held out: the ids of the text's last bytes
    head_ids = load_tokenizer(tokenizer).encode(text[: len(text) - tail].decode()).ids
    tail_ids = load_tokenizer(tokenizer).encode(text[len(text) - tail :].decode()).ids
    assert len(head_ids) < (len(text) - tail) / 2  # subwords, not bytes
    assert len(train) == len(head_ids) // 17 and report.train_tokens == len(train) * 16
    assert torch.equal(train.windows, again.windows) and torch.equal(train.ids, again.ids)
    assert torch.equal(evals.windows, again_evals.windows) and torch.equal(evals.ids, again_evals.ids)
    for sid, window in zip(train.ids.tolist(), train.windows, strict=True):  # id i: the i-th window of ids
        assert window.tolist() == head_ids[sid * 17 : (sid + 1) * 17]
    n_tail = len(tail_ids) // 17
    assert [w.tolist() for w in evals.windows] == [tail_ids[i * 17 : (i + 1) * 17] for i in range(n_tail - 4, n_tail)]
    assert not set(train.ids.tolist()) & set(evals.ids.tolist())
    assert int(train.windows.max()) >= 256  # merged tokens beyond the byte range occur


def test_held_out_windows_do_not_move_with_the_training_sample_count(corpus_and_tokenizer):
    corpus, tokenizer = corpus_and_tokenizer
    runs = [
        build_datasets(
            DataConfig(path=str(corpus), seq_len_tokens=16, train_samples=n, eval_samples=4, tokenizer=str(tokenizer))
        )  # fmt: skip
        for n in (None, 3, 20)
    ]
    assert [len(train) for train, _, _ in runs][1:] == [3, 20]
    for _, evals, _ in runs[1:]:
        assert torch.equal(evals.windows, runs[0][1].windows) and torch.equal(evals.ids, runs[0][1].ids)


def test_a_corpus_too_small_for_the_windows_names_tokens(corpus_and_tokenizer):
    corpus, tokenizer = corpus_and_tokenizer
    with pytest.raises(ValueError, match="tokens: too few"):
        build_datasets(DataConfig(path=str(corpus), seq_len_tokens=4000, eval_samples=4, tokenizer=str(tokenizer)))


def test_model_flags_carry_the_tokenizer_and_refuse_one_larger_than_the_vocabulary(tmp_path, corpus_and_tokenizer):
    import argparse

    from swarm.options import add_model_arguments, model_config

    _, big = corpus_and_tokenizer  # 300 tokens
    small = tmp_path / "small.json"
    train_tokenizer([PROSE], 256, small)  # the byte alphabet alone
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    cfg = model_config(parser.parse_args(["--model", "llama-tiny", "--tokenizer", str(small), "--seq-len", "16"]))
    assert cfg.tokenizer_path == str(small.resolve()) and cfg.family == "llama"
    with pytest.raises(SystemExit, match="300 tokens, more than the model's vocabulary 256"):
        model_config(parser.parse_args(["--model", "llama-tiny", "--tokenizer", str(big)]))
    with pytest.raises(SystemExit, match="--model no-such-model: unknown model"):
        model_config(parser.parse_args(["--model", "no-such-model"]))
