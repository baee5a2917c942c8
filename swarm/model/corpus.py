"""The default corpus: the Python standard library's own sources, split by file into training and held-out text.

Every machine with Python carries it and nothing is downloaded. Without its tests it holds about 12 MB of real
text (code, comments and docstrings; CPython 3.11), so one pass of the default model (129-byte windows) runs about
90,000 windows, 5,600 steps of 16, without seeing a sample twice.

The files are read in sorted order of their path relative to the library's root (the order is fixed by the
paths, not by the file system). A file is held out of training when the first byte of the SHA-256 of its path is
below `HELD_OUT_OF_256` (about 5% of the files): held-out windows are cut from held-out files only, and which file
is held out does not depend on the run (its sample counts, its tokenizer) nor on which other files exist. The
library copies some text between files (`chunk.py`'s class is in `wave.py` too, the `encodings/cp*.py` tables share
most lines): 9% of the held-out files' 129-byte windows occur verbatim in a training file, so
`swarm.model.data.build_datasets` skips such windows (`StdlibCorpus.in_training`) where they are bytes of at least
`MIN_CHECKED_BYTES` (the default 128-token samples are); shorter windows and tokenized ones are not checked.

The text is whatever `sysconfig.get_paths()["stdlib"]` holds, so it differs between Python versions (3.12 dropped
distutils, 3.13 lib2to3 and the "dead batteries") and builds. `StdlibCorpus.digest` is a SHA-256 of every file's
path and bytes, in order: runs record it, so two machines can tell whether they trained on the same text.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HELD_OUT_OF_256", "MIN_CHECKED_BYTES", "StdlibCorpus", "corpus_files", "is_held_out", "read_stdlib_corpus"]

HELD_OUT_OF_256 = 13
"""A file is held out when the first byte of the SHA-256 of its relative path is below this: 13/256, about 5% of
the files (about 600 KB, 4,600 windows of 129 bytes, on CPython 3.11)."""
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
"""Folders not read: installed third-party packages (they differ between machines) and the test suites (their
data files are binary-like blobs, and they double the corpus with repetitive assertions)."""
_SEPARATOR = b"\n\n"
_BLOCK = 64
"""Bytes of the training text's aligned blocks that `in_training` indexes: a run of at least 2 * 64 - 1 bytes that
occurs in the training text holds one of them whole."""
MIN_CHECKED_BYTES = 2 * _BLOCK - 1
"""The shortest run `in_training` checks (127 bytes): shorter windows are not checked, and runs that short recur all
over the library anyway (indentation, `return self`)."""


@dataclass(frozen=True)
class StdlibCorpus:
    """The standard library's sources as two texts: the training files' and the held-out files', each in order."""

    train: bytes
    """The training files' bytes, in path order, joined by a blank line."""
    held_out: bytes
    """The held-out files' bytes, the same way."""
    train_files: int
    """Files in `train`."""
    held_out_files: int
    """Files in `held_out`."""
    digest: str
    """Hex SHA-256 of every file read (its relative path, its length and its bytes, in path order)."""
    root: str
    """The library folder it was read from."""

    @functools.cached_property
    def _blocks(self) -> frozenset[bytes]:
        return frozenset(self.train[i : i + _BLOCK] for i in range(0, len(self.train) - _BLOCK + 1, _BLOCK))

    def in_training(self, text: bytes) -> bool:
        """Whether `text`, at least `MIN_CHECKED_BYTES` long, occurs verbatim in the training text: looked up in an
        index of the training text's aligned 64-byte blocks (built once, about 170,000 of them), and searched for
        only where one of its 64-byte runs is such a block."""
        if len(text) < MIN_CHECKED_BYTES:
            raise ValueError(f"only runs of at least {MIN_CHECKED_BYTES} bytes are checked, got {len(text)}")
        runs = (text[i : i + _BLOCK] for i in range(len(text) - _BLOCK + 1))
        return any(run in self._blocks for run in runs) and text in self.train

    @property
    def source(self) -> str:
        """Where the text came from, for the data report."""
        return (
            f"the Python {platform.python_version()} standard library's sources "
            f"({self.train_files + self.held_out_files} files, {self.held_out_files} held out)"
        )


def is_held_out(relative_path: str) -> bool:
    """Whether the file at `relative_path` (POSIX, relative to the library's root) is held out of training."""
    return hashlib.sha256(relative_path.encode()).digest()[0] < HELD_OUT_OF_256


def corpus_files(root: Path) -> list[str]:
    """The corpus's files under `root`: every `*.py` outside `_SKIPPED_DIRS`, as sorted relative POSIX paths."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
        base = Path(folder).relative_to(root)
        found.extend((base / f).as_posix() for f in files if f.endswith(".py"))
    return sorted(found)


def read_stdlib_corpus(root: str | Path | None = None) -> StdlibCorpus | None:
    """The corpus under `root` (None: this Python's `sysconfig` stdlib folder); None when it holds no sources
    (an embedded or stripped Python). Files that cannot be read or look binary (a NUL byte) are skipped. Read
    once per process and root (about 12 MB)."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root).resolve()
    return _read(str(root))


@functools.lru_cache(maxsize=4)
def _read(root: str) -> StdlibCorpus | None:
    digest = hashlib.sha256()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for relative in corpus_files(Path(root)) if Path(root).is_dir() else []:
        try:
            data = (Path(root) / relative).read_bytes()
        except OSError:
            continue
        if not data or b"\0" in data:
            continue
        digest.update(relative.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        parts[is_held_out(relative)].append(data)
    if not parts[False] or not parts[True]:
        return None
    return StdlibCorpus(
        train=_SEPARATOR.join(parts[False]),
        held_out=_SEPARATOR.join(parts[True]),
        train_files=len(parts[False]),
        held_out_files=len(parts[True]),
        digest=digest.hexdigest(),
        root=root,
    )
