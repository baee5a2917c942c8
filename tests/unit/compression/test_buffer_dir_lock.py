"""One buffer directory, one process: a second stage given the same --buffer-dir refuses to start instead of
overwriting the first one's receive buffers; a stage rebuilt in the same process (a plan change) maps them again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from swarm.compression.buffers import BUFFER_DIR_LOCK, BufferDirInUse, MmapBufferStore, lock_buffer_dir

HOLDER = """
import fcntl, os, sys
os.makedirs(sys.argv[1], exist_ok=True)
fd = os.open(os.path.join(sys.argv[1], sys.argv[2]), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("locked", flush=True)
sys.stdin.read()  # holds the directory until its parent closes stdin
"""
"""Another stage's process, as `lock_buffer_dir` claims a directory (without importing torch: a fast start)."""


def hold(directory) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), BUFFER_DIR_LOCK],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "locked"
    return child


@pytest.fixture
def other_process(tmp_path):
    """A second process holding `tmp_path / "bufs"` as its buffer directory; reaped after the test."""
    directory = tmp_path / "bufs"
    child = hold(directory)
    try:
        yield directory, child
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_a_second_process_on_one_buffer_dir_refuses_to_start_naming_the_holder(other_process):
    directory, child = other_process
    with pytest.raises(BufferDirInUse, match=f"pid {child.pid}.*own --buffer-dir"):
        lock_buffer_dir(directory)


def test_a_peer_on_a_buffer_dir_held_by_another_exits_before_it_starts_anything(other_process, caplog):
    from swarm.compression import CodecConfig
    from swarm.daemon.peer import PeerConfig, PeerDaemon

    directory, child = other_process
    daemon = PeerDaemon(PeerConfig(fw_codec=CodecConfig.parse("aqsgd2", buffer_dir=str(directory))))
    assert daemon.run() == 2
    assert f"pid {child.pid}" in caplog.text
    assert not hasattr(daemon, "dht")  # refused before the DHT or any server started


def test_the_directory_is_free_again_once_its_holder_is_gone(tmp_path):
    directory = tmp_path / "bufs"
    child = hold(directory)
    child.kill()  # dies without cleaning up: the kernel drops its lock
    child.wait(timeout=30)
    assert lock_buffer_dir(directory) == directory.resolve()
    assert (directory / BUFFER_DIR_LOCK).read_text().strip() == str(os.getpid())


def test_one_process_claims_its_directory_again_on_a_plan_change(tmp_path):
    assert lock_buffer_dir(tmp_path) == lock_buffer_dir(tmp_path)  # the stage rebuilt under a new plan
    first = MmapBufferStore(8, torch.float16, tmp_path / "fw-recv.buf")
    first.admit([1], torch.ones(1, 4))
    again = MmapBufferStore(8, torch.float16, tmp_path / "fw-recv.buf")
    again.admit([2], torch.ones(1, 4))
    assert 2 in again
