"""Samples with stable ids, a disjoint held-out slice, per-epoch seeded shuffling, and the corpus sources."""

import pytest
import torch

from swarm.model import data as data_mod
from swarm.model.data import Batch, DataConfig, build_datasets, epoch_batches, load_corpus

torch.set_num_threads(1)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(32, 127)) * 40)  # 3800 bytes
    return path


def test_default_corpus_is_real_text_from_the_python_install():
    train, evals, report = build_datasets(DataConfig(seq_len_tokens=32, train_samples=40, eval_samples=8))
    assert (report.train_samples, report.eval_samples) == (40, 8)
    assert report.train_tokens == 40 * 32 and report.eval_tokens == 8 * 32
    assert "Python" in report.source and "40 training samples" in report.describe()
    text = bytes(train.windows.flatten().tolist())
    assert text.decode("utf-8", errors="replace").count(" ") > len(text) / 10  # prose has spaces


def test_ids_are_stable_distinct_and_held_out_is_disjoint(text_file):
    cfg = DataConfig(path=str(text_file), seq_len_tokens=15, train_samples=None, eval_samples=5)
    train, evals, _ = build_datasets(cfg)
    again, _, _ = build_datasets(cfg)
    assert len(train) + len(evals) == 3800 // 16
    assert torch.equal(train.ids, again.ids) and torch.equal(train.windows, again.windows)
    assert not set(train.ids.tolist()) & set(evals.ids.tolist())
    raw = text_file.read_bytes()
    windows = dict(zip(train.ids.tolist(), train.windows, strict=True))
    windows.update(zip(evals.ids.tolist(), evals.windows, strict=True))
    for sid in windows:  # id i is the i-th window of the corpus
        assert bytes(windows[sid].tolist()) == raw[sid * 16 : (sid + 1) * 16]


def test_a_texts_held_out_windows_do_not_move_with_the_training_sample_count(text_file):
    runs = [build_datasets(DataConfig(path=str(text_file), seq_len_tokens=15, train_samples=n, eval_samples=5))
            for n in (None, 7, 100)]  # fmt: skip
    assert [len(train) for train, _, _ in runs] == [3800 // 16 - 5, 7, 100]
    for train, evals, _ in runs:
        assert evals.ids.tolist() == list(range(3800 // 16 - 5, 3800 // 16))  # the text's last windows
        assert torch.equal(evals.windows, runs[0][1].windows)
        assert not set(train.ids.tolist()) & set(evals.ids.tolist())


def test_batch_targets_are_inputs_shifted_by_one(text_file):
    train, _, _ = build_datasets(DataConfig(path=str(text_file), seq_len_tokens=15, eval_samples=2))
    b = train.batch(slice(0, 3))
    assert torch.equal(b.tokens[:, 1:], b.targets[:, :-1])
    assert b.tokens.shape == (3, 15) and b.tokens.dtype == torch.int64


def test_epochs_reshuffle_with_the_seed_and_see_every_sample_once(text_file):
    train, _, _ = build_datasets(DataConfig(path=str(text_file), seq_len_tokens=15, train_samples=40, eval_samples=2))
    order = lambda epoch, seed: torch.cat([b.sample_ids for b in epoch_batches(train, 8, epoch, seed)]).tolist()
    assert sorted(order(0, 0)) == train.ids.tolist()
    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(1, 0) and order(0, 0) != order(0, 1)
    assert all(len(b.sample_ids) == 6 for b in epoch_batches(train, 6, 0, 0))  # last partial batch dropped
    assert len(list(epoch_batches(train, 6, 0, 0))) == 40 // 6


def test_batch_split_into_micro_batches(text_file):
    train, _, _ = build_datasets(DataConfig(path=str(text_file), seq_len_tokens=15, eval_samples=2))
    b = train.batch(slice(0, 8))
    parts = b.split(4)
    assert [len(p.sample_ids) for p in parts] == [2] * 4
    assert torch.equal(torch.cat([p.tokens for p in parts]), b.tokens)
    with pytest.raises(ValueError):
        b.split(3)
    assert isinstance(parts[0], Batch)


def test_folder_of_text_files_skips_binaries(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second file " * 20)
    (tmp_path / "a.txt").write_bytes(b"first file " * 20)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    text, source = load_corpus(str(tmp_path), max_bytes=10_000)
    assert text.startswith(b"first file") and b"second file" in text and b"\0" not in text
    assert source == str(tmp_path)


def test_falls_back_when_stdlib_sources_are_missing(monkeypatch):
    monkeypatch.setattr(data_mod, "_stdlib_sources", lambda max_bytes: b"")
    monkeypatch.setattr(data_mod, "_license_text", lambda max_bytes: b"")
    text, source = load_corpus(None, max_bytes=5000, min_bytes=1000)
    assert len(text) >= 1000 and "built-in" in source


def test_too_small_corpus_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"too short")
    with pytest.raises(ValueError, match="--data"):
        build_datasets(DataConfig(path=str(path), seq_len_tokens=16, eval_samples=1))
    with pytest.raises(FileNotFoundError):
        build_datasets(DataConfig(path=str(tmp_path / "missing")))
