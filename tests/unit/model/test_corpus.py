"""The default corpus: the standard library's sources, read in path order, split by file into training and held-out
text, with a digest that tells two Pythons' corpora apart; held-out windows that occur in training are skipped."""

from __future__ import annotations

import itertools

import pytest
import torch

from swarm.model import data as data_mod
from swarm.model.corpus import MIN_CHECKED_BYTES, corpus_files, is_held_out, read_stdlib_corpus
from swarm.model.data import HELD_OUT_FIRST_ID, DataConfig, build_datasets, epoch_batches

torch.set_num_threads(1)


def _names(held_out: bool, n: int, prefix: str = "m") -> list[str]:
    """`n` module names whose path puts them in training (held_out False) or held out."""
    names = (f"{prefix}{i}.py" for i in itertools.count())
    return list(itertools.islice((p for p in names if is_held_out(p) == held_out), n))


def _library(root, files: dict[str, bytes]):
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_files_are_sorted_sources_outside_tests_and_installed_packages(tmp_path):
    _library(tmp_path, {
        "b.py": b"b", "a.py": b"a", "pkg/z.py": b"z", "pkg/README.txt": b"no", "site-packages/x.py": b"no",
        "test/test_a.py": b"no", "pkg/tests/t.py": b"no", "idlelib/idle_test/t.py": b"no", "__pycache__/a.py": b"no",
    })  # fmt: skip
    assert corpus_files(tmp_path) == ["a.py", "b.py", "pkg/z.py"]


def test_split_is_by_file_path_and_the_digest_names_the_text(tmp_path):
    train, held = _names(False, 3), _names(True, 2)
    files = {name: f"# {name}\n".encode() * 20 for name in train + held}
    files[train[1]] += b"\0binary"  # skipped: not text
    one = read_stdlib_corpus(_library(tmp_path / "one", files))
    assert (one.train_files, one.held_out_files) == (2, 2)
    assert one.train == files[train[0]] + b"\n\n" + files[train[2]]  # in path order
    assert all(files[name] in one.held_out and files[name] not in one.train for name in held)
    same = read_stdlib_corpus(_library(tmp_path / "two", files))  # another root, the same text
    assert same.digest == one.digest and same.train == one.train
    files[held[0]] = files[held[0]].replace(b"#", b"%", 1)
    assert read_stdlib_corpus(_library(tmp_path / "three", files)).digest != one.digest


def test_a_library_without_sources_is_none_and_the_data_falls_back(tmp_path, monkeypatch):
    assert read_stdlib_corpus(tmp_path / "missing") is None
    assert read_stdlib_corpus(_library(tmp_path / "no-held-out", {_names(False, 1)[0]: b"x" * 100})) is None
    monkeypatch.setattr(data_mod, "read_stdlib_corpus", lambda: None)
    train, evals, report = build_datasets(DataConfig(seq_len_tokens=16, train_samples=8, eval_samples=2))
    assert "Python" in report.source and len(train) == 8 and len(evals) == 2  # the license text or the builtins


def test_in_training_finds_every_verbatim_run_and_only_those(tmp_path):
    gen = torch.Generator().manual_seed(0)
    text = bytes(torch.randint(32, 127, (5000,), generator=gen).tolist())
    corpus = read_stdlib_corpus(_library(tmp_path, {_names(False, 1)[0]: text, _names(True, 1)[0]: b"held " * 40}))
    for start in (0, 1, 63, 64, 65, 2000, len(corpus.train) - MIN_CHECKED_BYTES):
        run = corpus.train[start : start + MIN_CHECKED_BYTES + start % 7]
        assert corpus.in_training(run), start
        assert not corpus.in_training(run[:-1] + b"\x01")
    with pytest.raises(ValueError, match="at least"):
        corpus.in_training(text[:64])


def test_held_out_windows_that_occur_in_training_are_skipped(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    shared = bytes(torch.randint(32, 127, (3 * 129,), generator=gen).tolist())
    own = bytes(torch.randint(32, 127, (4 * 129,), generator=gen).tolist())
    (train_name,), (held_name,) = _names(False, 1), _names(True, 1)
    root = _library(tmp_path, {train_name: b"t" * 500 + shared + b"t" * 500, held_name: shared + own})
    monkeypatch.setattr(data_mod, "read_stdlib_corpus", lambda: read_stdlib_corpus(root))
    train, evals, _ = build_datasets(DataConfig(seq_len_tokens=128, train_samples=None, eval_samples=4))
    assert (evals.ids - HELD_OUT_FIRST_ID).tolist() == [3, 4, 5, 6]  # the first 3 are copies of training text
    assert bytes(evals.windows.flatten().tolist()) == own
    with pytest.raises(ValueError, match="held-out"):
        build_datasets(DataConfig(seq_len_tokens=128, train_samples=None, eval_samples=5))


def test_the_stdlib_corpus_runs_thousands_of_single_pass_steps():
    corpus = read_stdlib_corpus()
    assert corpus is not None, "this Python has no standard library sources"
    assert len(corpus.train) + len(corpus.held_out) >= 10_000_000
    assert len(corpus.train) // 129 // 16 >= 3000  # steps of 16 default samples in one pass
    train, evals, report = build_datasets(DataConfig(train_samples=6144))
    assert len(train) == 6144 and len(set(train.ids.tolist())) == 6144
    seen = torch.cat([b.sample_ids for b in epoch_batches(train, 16, 0, 0)])
    assert len(seen) == 6144 and len(set(seen.tolist())) == 6144  # one epoch: every sample exactly once
    assert report.corpus_digest == corpus.digest and report.corpus_digest[:12] in report.describe()
    for window in evals.windows:  # the held-out text never occurs in training
        assert bytes(window.tolist()) not in corpus.train
    small_train, small_evals, small = build_datasets(DataConfig())
    assert torch.equal(small_evals.windows, evals.windows) and torch.equal(small_evals.ids, evals.ids)
    assert torch.equal(small_train.windows, train.windows[: len(small_train)])  # a prefix of the longer run's
    assert small.windows_digest != report.windows_digest and small.corpus_digest == report.corpus_digest
