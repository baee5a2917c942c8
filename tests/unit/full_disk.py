"""A real full disk for tests: a tiny tmpfs mounted under a test's tmp_path (root only; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tiny_disk(tmp_path: Path, size_kib: int = 64) -> Iterator[Path]:
    """A directory on a `size_kib` KiB tmpfs: writes past it fail with ENOSPC, as on a full disk."""
    mount = tmp_path / "tiny-disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=30)


def fill(directory: Path) -> None:
    """Fills the disk under `directory` to its last byte (unbuffered: no flush left to fail at close)."""
    with open(directory / "filler", "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
