"""Byte-level language-modelling samples with stable ids, a held-out slice, and seeded epoch shuffling.

AQ-SGD keys its message buffers by sample id and only pays off when the same sample comes back, so a
sample here is a fixed window of the corpus whose id is its position: the same id always means the same
tokens, in every epoch and in every process that builds the data set from the same corpus.

The default corpus is real English prose that every CPython install carries: the docstrings of the
standard library's own source files (found through `sysconfig`), falling back to the license text and
then to the docstrings of built-in modules when the sources are not installed. Nothing is downloaded.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DataConfig",
    "Batch",
    "SampleSet",
    "DataReport",
    "load_corpus",
    "build_datasets",
    "epoch_batches",
]


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is cut into samples."""

    path: str | None = None
    """A text file or a folder of them (read recursively, sorted); None = the Python stdlib's docstrings."""
    seq_len_tokens: int = 128
    """Tokens a sample feeds the model (each window holds one more, for the shifted targets)."""
    train_samples: int | None = 384
    """Cap on training samples (None = every window of the corpus not held out)."""
    eval_samples: int = 48
    """Held-out samples, taken from the end of the corpus so they share no text with training."""
    max_corpus_bytes: int = 8_000_000
    """Stop reading the corpus after this many bytes (the stdlib's docstrings alone are tens of MB)."""
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
    corpus_bytes: int
    train_samples: int
    train_tokens: int
    eval_samples: int
    eval_tokens: int

    def describe(self) -> str:
        return (
            f"data: {self.train_samples} training samples ({self.train_tokens:,} tokens) and "
            f"{self.eval_samples} held-out ({self.eval_tokens:,} tokens) from {self.source} "
            f"({self.corpus_bytes:,} bytes)"
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


def _stdlib_docstrings(max_bytes: int, per_file_bytes: int = 4096) -> bytes:
    # Files in a fixed pseudo-random order, each contributing a few KB, so that a small corpus still
    # spans many modules instead of being all of the alphabetically first one.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [*stdlib.glob("*.py"), *stdlib.glob("*/*.py")]
    files = [f for f in files if f.parent == stdlib or not f.parent.name.startswith(("test", "idle"))]
    files.sort(key=lambda f: hashlib.sha256(f.relative_to(stdlib).as_posix().encode()).digest())
    parts, total = [], 0
    for file in files:
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        taken = 0
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40 and taken < per_file_bytes:
                    parts.append(doc.encode())
                    taken += len(parts[-1]) + 2
        total += taken
        if total >= max_bytes:
            break
    return b"\n\n".join(parts)[:max_bytes]


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
            `min_bytes`: stdlib docstrings, then the license text, then built-in docstrings (which
            exist even without the library's sources, unless Python runs with -OO).
        max_bytes: read at most this many bytes.
        min_bytes: the size a default source must reach to be chosen.
    """
    if path is not None:
        return _read_path(Path(path), max_bytes), str(path)
    sources = [
        ("docstrings of the Python standard library", _stdlib_docstrings),
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


def build_datasets(cfg: DataConfig) -> tuple[SampleSet, SampleSet, DataReport]:
    """Cut the corpus into windows of `seq_len_tokens + 1` tokens (bytes, or `cfg.tokenizer`'s ids): training
    first, held-out from the end. A sample's id is its window's index, the same in every process.

    Raises ValueError when the corpus does not hold one training and the held-out windows.
    """
    window = cfg.seq_len_tokens + 1
    wanted = ((cfg.train_samples or 0) + cfg.eval_samples) * window
    per_token = 1 if cfg.tokenizer is None else BYTES_PER_TOKEN_READ
    max_bytes = cfg.max_corpus_bytes if cfg.train_samples is None else min(cfg.max_corpus_bytes, wanted * per_token)
    text, source = load_corpus(cfg.path, max_bytes, min_bytes=wanted * per_token)
    tokens = _tokens(text, cfg.tokenizer)
    n_windows = len(tokens) // window
    if n_windows < cfg.eval_samples + 1:
        unit = "bytes" if cfg.tokenizer is None else "tokens"
        raise ValueError(
            f"{source} holds {len(tokens)} {unit}: too few for {cfg.eval_samples} held-out samples and one "
            f"training sample of {window} {unit}; pass --data with a larger text"
        )
    data = tokens[: n_windows * window]
    windows = data.view(n_windows, window)
    n_train = n_windows - cfg.eval_samples
    if cfg.train_samples is not None:
        n_train = min(n_train, cfg.train_samples)
    ids = torch.arange(n_windows, dtype=torch.int64)
    train = SampleSet(ids[:n_train], windows[:n_train])
    held = slice(n_windows - cfg.eval_samples, n_windows)
    evals = SampleSet(ids[held], windows[held])
    report = DataReport(source, len(text), len(train), train.n_tokens, len(evals), evals.n_tokens)
    return train, evals, report


def epoch_batches(data: SampleSet, batch_size: int, epoch: int, seed: int) -> Iterator[Batch]:
    """The epoch's mini-batches in an order reshuffled every epoch and fixed by (seed, epoch).

    The last incomplete batch is dropped so every step splits into the same micro-batches.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(data), generator=gen)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield data.batch(order[start : start + batch_size])
