"""Byte-level language-modelling samples with stable ids, a held-out slice, and seeded epoch shuffling.

AQ-SGD keys its message buffers by sample id and only pays off when the same sample comes back, so a
sample here is a fixed window of the corpus whose id is its position: the same id always means the same
tokens, in every epoch and in every process that builds the data set from the same corpus.

The default corpus is the Python standard library's own sources (`swarm.model.corpus`), about 12 MB that every
CPython install carries, split by file into training and held-out text; it falls back to the license text and
then to the docstrings of built-in modules when the sources are not installed. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.model.corpus import MIN_CHECKED_BYTES, StdlibCorpus, read_stdlib_corpus

__all__ = [
    "DataConfig",
    "Batch",
    "SampleSet",
    "DataReport",
    "HELD_OUT_FIRST_ID",
    "load_corpus",
    "build_datasets",
    "epoch_batches",
]


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is cut into samples."""

    path: str | None = None
    """A text file or a folder of them (read recursively, sorted); None = the Python standard library's sources
    (`swarm.model.corpus`)."""
    seq_len_tokens: int = 128
    """Tokens a sample feeds the model (each window holds one more, for the shifted targets)."""
    train_samples: int | None = 384
    """Cap on training samples (None = every window of the corpus not held out)."""
    eval_samples: int = 48
    """Held-out samples, sharing no text with training: the first windows of the default corpus's held-out files
    (the same whatever `train_samples` is), or the windows after the training ones in a `path` text."""
    max_corpus_bytes: int = 64_000_000
    """Read at most this many bytes of a `path` text, or of the default corpus's training text (about 11 MB)."""
    tokenizer: str | None = None
    """A local tokenizer.json (`swarm.model.hf.load_tokenizer`): samples are windows of its token ids; None =
    bytes (token id = byte value), as the built-in model reads."""

    def __post_init__(self) -> None:
        if self.seq_len_tokens < 1:
            raise ValueError("seq_len_tokens must be positive")
        if self.eval_samples < 0 or (self.train_samples is not None and self.train_samples < 1):
            raise ValueError("need at least one training sample and a non-negative held-out count")


@dataclass(frozen=True)
class Batch:
    """A mini-batch: row i of `tokens`/`targets` is the sample with id `sample_ids[i]`."""

    sample_ids: torch.Tensor
    """int64 [B]."""
    tokens: torch.Tensor
    """int64 [B, T] inputs."""
    targets: torch.Tensor
    """int64 [B, T] next tokens."""

    def split(self, n_micro: int) -> list[Batch]:
        """Split into `n_micro` micro-batches of equal size (B must be divisible by n_micro)."""
        if len(self.sample_ids) % n_micro:
            raise ValueError(f"batch of {len(self.sample_ids)} does not split into {n_micro} micro-batches")
        parts = zip(
            self.sample_ids.chunk(n_micro),
            self.tokens.chunk(n_micro),
            self.targets.chunk(n_micro),
            strict=True,
        )
        return [Batch(*p) for p in parts]

    def select(self, rows: torch.Tensor) -> Batch:
        """The rows `rows` (int64 indices, in that order) as a batch of their own."""
        return Batch(self.sample_ids[rows], self.tokens[rows], self.targets[rows])


@dataclass(frozen=True)
class SampleSet:
    """Fixed token windows; `windows[i]` is the sample whose id is `ids[i]`."""

    ids: torch.Tensor
    """int64 [N] stable sample ids (the window's index in the corpus)."""
    windows: torch.Tensor
    """int64 [N, T + 1] tokens of each window."""

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_tokens(self) -> int:
        return len(self.ids) * (self.windows.size(1) - 1)

    def batch(self, rows: torch.Tensor | slice) -> Batch:
        w = self.windows[rows]
        return Batch(self.ids[rows], w[:, :-1], w[:, 1:])


@dataclass(frozen=True)
class DataReport:
    """What the loader built, for the log and the experiment's JSON."""

    source: str
    """Where the text came from (for the default corpus: the Python version and its file counts)."""
    corpus_bytes: int
    """Bytes of text read."""
    train_samples: int
    train_tokens: int
    eval_samples: int
    eval_tokens: int
    corpus_digest: str = ""
    """Hex SHA-256 of the corpus: for the default one, every file's path and bytes (`StdlibCorpus.digest`), so
    two machines whose Pythons differ can tell; for a `path`, the bytes read."""
    windows_digest: str = ""
    """Hex SHA-256 of the token ids of every training, then every held-out window: equal where two runs trained and
    evaluated on the same samples."""

    def describe(self) -> str:
        return (
            f"data: {self.train_samples} training samples ({self.train_tokens:,} tokens) and "
            f"{self.eval_samples} held-out ({self.eval_tokens:,} tokens) from {self.source} "
            f"({self.corpus_bytes:,} bytes, sha256 {self.corpus_digest[:12]}, windows {self.windows_digest[:12]})"
        )


def _read_path(path: Path, max_bytes: int) -> bytes:
    if path.is_file():
        return path.read_bytes()[:max_bytes]
    if not path.is_dir():
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    parts, total = [], 0
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        data = file.read_bytes()
        if b"\0" in data[:4096]:  # binary, not text
            continue
        parts.append(data)
        total += len(data) + 2
        if total >= max_bytes:
            break
    return b"\n\n".join(parts)[:max_bytes]


def _stdlib_sources(max_bytes: int) -> bytes:
    """The default corpus's training text (`swarm.model.corpus`), or nothing without the library's sources."""
    corpus = read_stdlib_corpus()
    return b"" if corpus is None else corpus.train[:max_bytes]


def _license_text(max_bytes: int) -> bytes:
    candidates = [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt", Path(sys.prefix) / "LICENSE.txt"]
    for path in candidates:
        if path.is_file():
            return path.read_bytes()[:max_bytes]
    return b""


def _builtin_docstrings(max_bytes: int) -> bytes:
    import builtins

    parts = []
    for obj in vars(builtins).values():
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and len(doc) >= 40:
            parts.append(doc.encode())
    return b"\n\n".join(dict.fromkeys(parts))[:max_bytes]


def load_corpus(path: str | None, max_bytes: int, min_bytes: int = 0) -> tuple[bytes, str]:
    """The corpus as bytes and a description of where it came from.

    Args:
        path: a text file or folder of them; None picks the first default source with at least
            `min_bytes`: the training files of the standard library's sources, then the license text, then
            built-in docstrings (which exist even without the library's sources, unless Python runs with -OO).
        max_bytes: read at most this many bytes.
        min_bytes: the size a default source must reach to be chosen.
    """
    if path is not None:
        return _read_path(Path(path), max_bytes), str(path)
    sources = [
        ("the Python standard library's sources (training files)", _stdlib_sources),
        ("the Python license text", _license_text),
        ("docstrings of Python's built-in objects", _builtin_docstrings),
    ]
    best = (b"", "nothing")
    for name, reader in sources:
        text = reader(max_bytes)
        if len(text) >= min_bytes:
            return text, name
        if len(text) > len(best[0]):
            best = (text, name)
    return best[0], best[1] + " (smaller than asked for)"


BYTES_PER_TOKEN_READ = 8
"""With a tokenizer, bytes of corpus read per token wanted: subword tokenizers average 3-5 bytes per token on
English prose, so 8 leaves room without reading the whole corpus."""


def _tokens(text: bytes, tokenizer: str | None) -> torch.Tensor:
    """The corpus as int64 token ids: its bytes, or `tokenizer`'s ids of its UTF-8 text (invalid bytes replaced)."""
    if tokenizer is None:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long() if text else torch.zeros(0, dtype=torch.long)
    from swarm.model.hf import load_tokenizer

    ids = load_tokenizer(tokenizer).encode(text.decode("utf-8", errors="replace")).ids
    return torch.tensor(ids, dtype=torch.int64)


HELD_OUT_FIRST_ID = 1 << 40
"""Id of the default corpus's first held-out window; a held-out window's id is this plus its window's position in the
held-out text: apart from every training window's id, and the same whatever a run's training sample count is."""


def build_datasets(cfg: DataConfig) -> tuple[SampleSet, SampleSet, DataReport]:
    """Cut the corpus into windows of `seq_len_tokens + 1` tokens (bytes, or `cfg.tokenizer`'s ids).

    The default corpus (`cfg.path` None) is split by file (`swarm.model.corpus`): training windows are cut from
    the training files' text, ids 0, 1, ... in order; held-out windows from the held-out files' text, id
    `HELD_OUT_FIRST_ID` + the window's position there, so they do not move with `train_samples`. Held-out byte
    windows of 127 bytes or more that occur verbatim in the training text (the library copies some code between
    files) are skipped. A `cfg.path` text (or a fallback
    source, when the library's sources are missing) is one text: training windows first, held-out from the end
    of the text, which do not move with `train_samples` either (`_one_text_datasets`). Either way ids are the same
    in every process.

    Raises ValueError when the corpus does not hold one training and the held-out windows.
    """
    corpus = read_stdlib_corpus() if cfg.path is None else None
    if corpus is None:
        return _one_text_datasets(cfg)
    window = cfg.seq_len_tokens + 1
    per_token = 1 if cfg.tokenizer is None else BYTES_PER_TOKEN_READ
    train_text = corpus.train[: cfg.max_corpus_bytes]
    if cfg.train_samples is not None:
        train_text = train_text[: cfg.train_samples * window * per_token]
    train_windows = _windows(_tokens(train_text, cfg.tokenizer), window, cfg.train_samples)
    if cfg.tokenizer is None and window >= MIN_CHECKED_BYTES:
        held_ids, held_text = _unseen_windows(corpus, window, cfg.eval_samples)
        held_windows = _windows(_tokens(held_text, None), window, None)
    else:  # token windows, and byte runs too short to check: the first ones
        held_text = corpus.held_out[: cfg.eval_samples * window * per_token]
        held_windows = _windows(_tokens(held_text, cfg.tokenizer), window, cfg.eval_samples)
        held_ids = torch.arange(len(held_windows), dtype=torch.int64)
    if len(train_windows) < 1 or len(held_windows) < cfg.eval_samples:
        raise ValueError(
            f"{corpus.source} holds {len(train_windows)} training and {len(held_windows)} held-out windows of "
            f"{window} tokens: too few for {cfg.eval_samples} held-out samples and one training sample; pass "
            "--data with a larger text"
        )
    train = SampleSet(torch.arange(len(train_windows), dtype=torch.int64), train_windows)
    evals = SampleSet(HELD_OUT_FIRST_ID + held_ids, held_windows)
    return train, evals, _report(corpus.source, len(train_text) + len(held_text), corpus.digest, train, evals)


def _unseen_windows(corpus: StdlibCorpus, window: int, count: int) -> tuple[torch.Tensor, bytes]:
    """The first `count` windows of the held-out text whose bytes do not occur in the training text: their
    positions (int64) and their bytes, joined."""
    positions, parts = [], []
    for i in range(len(corpus.held_out) // window):
        if len(positions) == count:
            break
        chunk = corpus.held_out[i * window : (i + 1) * window]
        if not corpus.in_training(chunk):
            positions.append(i)
            parts.append(chunk)
    return torch.tensor(positions, dtype=torch.int64), b"".join(parts)


def _windows(tokens: torch.Tensor, window: int, limit: int | None) -> torch.Tensor:
    """The first `limit` (None: all) whole windows of `tokens`, [N, window]."""
    n = len(tokens) // window if limit is None else min(len(tokens) // window, limit)
    return tokens[: n * window].view(n, window)


def _report(source: str, corpus_bytes: int, corpus_digest: str, train: SampleSet, evals: SampleSet) -> DataReport:
    windows = hashlib.sha256()
    for part in (train.windows, evals.windows):
        windows.update(part.contiguous().numpy().tobytes())
    return DataReport(
        source, corpus_bytes, len(train), train.n_tokens, len(evals), evals.n_tokens, corpus_digest,
        windows.hexdigest(),
    )  # fmt: skip


def _one_text_datasets(cfg: DataConfig) -> tuple[SampleSet, SampleSet, DataReport]:
    """`build_datasets` of one text: training windows first, held-out from the end of the text (at most
    `cfg.max_corpus_bytes` of it), so the held-out windows do not move with `train_samples`.

    Bytes: id i is the text's i-th window, the held-out ones the last `eval_samples` of them. With a tokenizer the
    held-out windows are the last `eval_samples` windows of the ids of the text's tail (`BYTES_PER_TOKEN_READ` bytes
    a token), id `HELD_OUT_FIRST_ID` + position there; training windows are cut from the ids of the text before it.
    """
    window = cfg.seq_len_tokens + 1
    per_token = 1 if cfg.tokenizer is None else BYTES_PER_TOKEN_READ
    text, source = load_corpus(cfg.path, cfg.max_corpus_bytes, min_bytes=(cfg.eval_samples + 1) * window * per_token)
    unit = "bytes" if cfg.tokenizer is None else "tokens"
    if cfg.tokenizer is None:
        n_windows = len(text) // window
        n_train = n_windows - cfg.eval_samples
        held_ids = torch.arange(n_train, n_windows, dtype=torch.int64)
        held_windows = _windows(_tokens(text[n_train * window : n_windows * window], None), window, None)
        train_text = text[: n_train * window] if n_train > 0 else b""
    else:
        tail = min(len(text), cfg.eval_samples * window * per_token)
        tail_windows = _windows(_tokens(text[len(text) - tail :], cfg.tokenizer), window, None)
        held_windows = tail_windows[len(tail_windows) - min(len(tail_windows), cfg.eval_samples) :]
        held_ids = HELD_OUT_FIRST_ID + torch.arange(len(tail_windows) - len(held_windows), len(tail_windows))
        train_text = text[: len(text) - tail]
    if cfg.train_samples is not None:
        train_text = train_text[: cfg.train_samples * window * per_token]
    train_windows = _windows(_tokens(train_text, cfg.tokenizer), window, cfg.train_samples)
    if len(train_windows) < 1 or len(held_windows) < cfg.eval_samples:
        raise ValueError(
            f"{source} holds {len(text)} bytes: {len(train_windows)} training and {len(held_windows)} held-out "
            f"windows of {window} {unit}: too few for {cfg.eval_samples} held-out samples and one training sample; "
            "pass --data with a larger text"
        )
    train = SampleSet(torch.arange(len(train_windows), dtype=torch.int64), train_windows)
    evals = SampleSet(held_ids.to(torch.int64), held_windows)
    return train, evals, _report(source, len(text), hashlib.sha256(text).hexdigest(), train, evals)


def epoch_batches(data: SampleSet, batch_size: int, epoch: int, seed: int) -> Iterator[Batch]:
    """The epoch's mini-batches in an order reshuffled every epoch and fixed by (seed, epoch).

    The last incomplete batch is dropped so every step splits into the same micro-batches.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(data), generator=gen)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield data.batch(order[start : start + batch_size])
